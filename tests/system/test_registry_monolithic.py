"""A checkpoint image published through a proxy that allows only monolithic uploads: Debian's
docker-registry (distribution 2.8) on loopback behind a loopback HTTP proxy that answers PATCH
with 405 (as an nginx `limit_except` or a pull-through front does) and forwards everything else,
Location headers rewritten to itself as a reverse proxy does. publish_archive cancels the refused
session and sends the layer in one `PUT ?digest=`; the real registry then serves the manifest by
digest and the layer's bytes are the archive's."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from snapguard import ocicheckpoint
from snapguard_lab.cri import Registry
from snapguard_lab.cri_archive import write_archive

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _proxy(upstream: str, seen: list[str]) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(self.command)
            if self.command == "PATCH":
                out = b'{"errors":[{"code":"UNSUPPORTED","message":"chunked uploads are not allowed here"}]}'
                self.send_response(405)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                return
            conn = http.client.HTTPConnection(upstream, timeout=30)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                             headers=headers)
                answer = conn.getresponse()
                data = answer.read()
            finally:
                conn.close()
            self.send_response(answer.status)
            for k, v in answer.getheaders():
                if k.lower() in ("content-length", "connection", "transfer-encoding"):
                    continue
                if k.lower() == "location" and urlsplit(v).netloc:
                    v = urlunsplit(urlsplit(v)._replace(netloc=f"127.0.0.1:{self.server.server_address[1]}"))
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data) if self.command != "HEAD" else
                                                   answer.getheader("Content-Length") or 0))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    return http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def front(tmp_path: Path) -> Iterator[tuple[str, Registry, list[str]]]:
    reg = Registry(str(tmp_path / "registry"))
    reg.start()
    seen: list[str] = []
    srv = _proxy(f"127.0.0.1:{reg.port}", seen)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", reg, seen
    finally:
        srv.shutdown()
        srv.server_close()
        assert reg.proc is not None
        reg.proc.terminate()
        reg.proc.wait(10)


def test_the_layer_goes_up_in_one_put_and_the_registry_serves_the_image(
        front: tuple[str, Registry, list[str]], tmp_path: Path) -> None:
    url, reg, seen = front
    archive = write_archive(tmp_path / "checkpoint.tar", 6 << 20)
    out = ocicheckpoint.publish_archive(str(archive), url, "ckpt/job-1", "e3", job="job-1", epoch=3, deadline_s=60)
    assert out.upload == "monolithic"
    assert seen[:3] == ["POST", "PATCH", "DELETE"] and "PUT" in seen[3:], seen
    # straight from the registry, not through the proxy
    direct = f"http://127.0.0.1:{reg.port}/v2/ckpt/job-1"
    with urllib.request.urlopen(urllib.request.Request(f"{direct}/manifests/{out.pushed.digest}",
                                                       headers={"Accept": MANIFEST}), timeout=30) as r:
        manifest = r.read()
    assert "sha256:" + hashlib.sha256(manifest).hexdigest() == out.pushed.digest
    layer = json.loads(manifest)["layers"][0]
    with urllib.request.urlopen(f"{direct}/blobs/{layer['digest']}", timeout=30) as r:
        assert r.read() == archive.read_bytes()
    assert layer["digest"] == "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
