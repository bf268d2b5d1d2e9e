"""snapguard.ocicheckpoint.publish_archive: a CRI checkpoint archive made an OCI image and pushed
with one read of its bytes (the layer streamed up, hashed as it is sent), against a loopback
registry peer in a child process that speaks the OCI distribution API's blob upload (POST, PATCH,
PUT ?digest=) and manifest PUT/HEAD, and digests what it receives itself.

The one read is measured, not assumed: the kernel's count of the bytes this process read
(/proc/self/io rchar) across the publish, against the archive's size. Building the image first
(build_image's digest pass) and pushing it after reads the archive twice.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard import ocicheckpoint
from snapguard.reasons import Reason, SnapguardError
from snapguard_lab.cri_archive import ROOTFS_DIFF, SPILL, write_archive

PAGES = 48 << 20

PEER = textwrap.dedent('''
    import hashlib, http.server, json, sys
    blobs, uploads, log = {}, {}, []
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def _body(self):
            n, h, size = int(self.headers.get("Content-Length") or 0), hashlib.sha256(), 0
            data = bytearray()
            while n > 0:
                c = self.rfile.read(min(n, 1 << 20)); n -= len(c); h.update(c); size += len(c)
                if size <= (1 << 20): data += c
            return "sha256:" + h.hexdigest(), size, bytes(data)
        def _send(self, status, headers=(), body=b""):
            self.send_response(status)
            for k, v in [("Content-Length", str(len(body))), *headers]: self.send_header(k, v)
            self.end_headers(); self.wfile.write(body)
        def do_HEAD(self):
            log.append(("HEAD", self.path, 0)); name = self.path.rsplit("/", 1)[1]
            if name in blobs: self._send(200, [("Docker-Content-Digest", name)])
            else: self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers()
        def do_GET(self):
            if self.path == "/log": self._send(200, body=json.dumps([log, {k: v[1] for k, v in blobs.items()}]).encode())
            else: self._send(404)
        def do_POST(self):
            self._body(); log.append(("POST", self.path, 0)); u = str(len(uploads)); uploads[u] = None
            self._send(202, [("Location", f"/v2/up/{u}?_state=s{u}")])
        def do_PATCH(self):
            d, size, _ = self._body(); log.append(("PATCH", self.path, size))
            if MODE in ("refuse-patch", "refuse-uploads"):
                return self._send(405, body=b'{"errors":[{"code":"UNSUPPORTED"}]}')
            uploads[self.path.split("/")[3].split("?")[0]] = (d, size)
            self._send(202, [("Location", self.path + "&after=patch")])
        def do_PUT(self):
            d, size, data = self._body(); log.append(("PUT", self.path, size))
            if "/manifests/" in self.path:
                blobs[d] = (data.decode(), size); return self._send(201, [("Docker-Content-Digest", d)])
            if MODE == "refuse-uploads" and size: return self._send(405, body=b'{"errors":[{"code":"DENIED"}]}')
            u = self.path.split("/")[3].split("?")[0]; want = self.path.split("digest=")[1].replace("%3A", ":")
            if size: uploads[u] = (d, size)
            got = uploads[u]
            if got[0] != want: return self._send(400, body=b'{"errors":[{"code":"DIGEST_INVALID"}]}')
            blobs[want] = (data.decode("latin-1") if got[1] < 4096 else "", got[1])
            self._send(201, [("Docker-Content-Digest", want)])
        def do_DELETE(self):
            log.append(("DELETE", self.path, 0)); uploads.pop(self.path.split("/")[3].split("?")[0], None)
            self._send(204)
    MODE = sys.argv[1]
    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(s.server_address[1], flush=True)
    s.serve_forever()
''')


def _peer(mode: str = "") -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", PEER, mode or "ok"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def registry() -> Iterator[str]:
    yield from _peer()


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    return write_archive(tmp_path / "checkpoint.tar", PAGES)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _log(url: str) -> tuple[list[list[object]], dict[str, int]]:
    import urllib.request

    with urllib.request.urlopen(url + "/log", timeout=10) as r:
        log, blobs = json.loads(r.read())
    return log, blobs


def test_publish_reads_the_archive_once_and_the_registry_gets_its_digest(archive: Path, registry: str) -> None:
    size = archive.stat().st_size
    want = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
    before = _rchar()
    out = ocicheckpoint.publish_archive(str(archive), registry, "ckpt/job-1", "e3", job="job-1", epoch=3,
                                        deadline_s=30)
    read = _rchar() - before
    assert size <= read < size + (2 << 20), f"read {read} bytes for an archive of {size}"

    log, blobs = _log(registry)
    methods = [m for m, _, _ in log]
    assert methods[:3] == ["POST", "PATCH", "PUT"], methods
    assert log[1][2] == size and log[2][2] == 0 and f"digest={want.replace(':', '%3A')}" in log[2][1]
    assert blobs[want] == size and out.upload == "streamed"
    image = out.image
    manifest = json.loads(image.manifest)
    assert manifest["layers"] == [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": want,
                                   "size": size}]
    assert json.loads(image.config)["rootfs"]["diff_ids"] == [want]
    assert out.pushed.digest == image.digest and image.digest in blobs
    assert out.pushed.reference == f"{registry[7:]}/ckpt/job-1@{image.digest}"
    assert manifest["annotations"]["io.snapguard.epoch"] == "3"
    assert manifest["annotations"][ocicheckpoint.ANNOTATION_CONTAINER] == "trainer"
    p = image.parts
    assert (p.pages, p.spill, p.rootfs_diff, p.archive) == (PAGES, SPILL, ROOTFS_DIFF, size)
    assert p.other > 1000 and p.files == 8
    # the same image as the two-pass build makes
    built = ocicheckpoint.build_image(str(archive), job="job-1", epoch=3)
    assert (built.digest, built.layer_digest) == (image.digest, want)


def test_a_registry_that_refuses_the_streamed_upload_gets_one_monolithic_put(archive: Path) -> None:
    """PATCH answered 405 (a registry, or a proxy in front of it, allowing monolithic uploads only):
    the session is cancelled and the layer goes up in one PUT ?digest= with its bytes; the same
    image as a streamed upload makes, the archive read twice (not hashed a second time)."""
    size = archive.stat().st_size
    want = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
    for url in _peer("refuse-patch"):
        before = _rchar()
        out = ocicheckpoint.publish_archive(str(archive), url, "ckpt/job-1", "e3", job="job-1", epoch=3,
                                            deadline_s=30)
        read = _rchar() - before
        assert 2 * size <= read < 2 * size + (2 << 20), f"read {read} bytes for an archive of {size}"
        log, blobs = _log(url)
        methods = [m for m, _, _ in log]
        assert methods[:6] == ["POST", "PATCH", "DELETE", "HEAD", "POST", "PUT"], methods
        assert log[1][2] == size and log[5][2] == size and f"digest={want.replace(':', '%3A')}" in log[5][1]
        assert log[2][1] == log[1][1]  # the refused session is the one cancelled
        assert blobs[want] == size and out.upload == "monolithic"
        assert out.image.layer_digest == want and out.pushed.digest in blobs
        built = ocicheckpoint.build_image(str(archive), job="job-1", epoch=3)
        assert out.image.digest == built.digest


def test_a_registry_that_refuses_both_uploads_is_one_typed_line(archive: Path) -> None:
    for url in _peer("refuse-uploads"):
        with pytest.raises(SnapguardError) as refused:
            ocicheckpoint.publish_archive(str(archive), url, "ckpt/job-1", "e3", job="job-1", epoch=3, deadline_s=30)
        assert refused.value.reason is Reason.REGISTRY_UNREACHABLE
        text = str(refused.value)
        assert "streamed upload (PATCH) was refused (HTTP 405)" in text and "monolithic upload" in text, text
        assert "DENIED" in text and "\n" not in text
        log, blobs = _log(url)
        assert blobs == {}  # nothing half-published: no manifest
