"""packaging/image/oci_push.py, the chart image's pusher (build-oci.sh's last step), against Debian's
docker-registry (distribution 2.8) on loopback: an OCI layout's image goes up blob by blob and the
registry serves back the same manifest under the tag; a second push uploads nothing again; a layout
whose blob does not match its digest, or a registry that is not there, is one line and exit 1, with
nothing pushed."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from snapguard_lab.cri import Registry

REPO = Path(__file__).resolve().parents[2]
PUSH = REPO / "packaging" / "image" / "oci_push.py"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _layout(root: Path) -> str:
    """A one-layer OCI image layout in `root`; the manifest's digest."""
    (root / "blobs" / "sha256").mkdir(parents=True)

    def blob(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs" / "sha256" / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("hello")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
    layer = blob(buf.getvalue())
    config = blob(json.dumps({"architecture": "amd64", "os": "linux",
                              "rootfs": {"type": "layers", "diff_ids": [layer["digest"]]}}).encode())
    manifest = blob(json.dumps({"schemaVersion": 2, "mediaType": MANIFEST,
                                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
                                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer}]}).encode())
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": MANIFEST, **manifest}]}))
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    return manifest["digest"]


def _push(layout: Path, ref: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(PUSH), str(layout), ref, "--plain-http"], capture_output=True,
                          text=True, timeout=200, stdin=subprocess.DEVNULL)


def _manifest(registry: Registry, tag: str) -> bytes | None:
    req = urllib.request.Request(f"http://{registry.host}/v2/snapguard/manifests/{tag}", headers={"Accept": MANIFEST})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        assert e.code == 404
        return None


@pytest.fixture
def registry(tmp_path: Path):
    reg = Registry(str(tmp_path / "registry"))
    reg.start()
    try:
        yield reg
    finally:
        assert reg.proc is not None
        reg.proc.terminate()
        reg.proc.wait(10)


def test_push_serves_the_layout_back(registry: Registry, tmp_path: Path) -> None:
    digest = _layout(tmp_path / "oci")
    ref = f"{registry.host}/snapguard:0.1.0"
    out = _push(tmp_path / "oci", ref)
    assert out.returncode == 0 and out.stdout.strip() == f"{ref}@{digest}", out.stderr
    served = _manifest(registry, "0.1.0")
    assert served is not None and "sha256:" + hashlib.sha256(served).hexdigest() == digest
    again = _push(tmp_path / "oci", ref)
    assert again.returncode == 0 and again.stdout.strip() == f"{ref}@{digest}", again.stderr


def test_bad_layout_or_no_registry_is_one_line(registry: Registry, tmp_path: Path) -> None:
    _layout(tmp_path / "oci")
    layer = max((tmp_path / "oci" / "blobs" / "sha256").iterdir(), key=lambda p: p.stat().st_size)
    layer.write_bytes(layer.read_bytes()[:-1] + b"X")  # the largest blob, the layer, altered
    out = _push(tmp_path / "oci", f"{registry.host}/snapguard:bad")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "does not match its digest" in out.stderr and _manifest(registry, "bad") is None
    _layout(tmp_path / "good")
    gone = _push(tmp_path / "good", "127.0.0.1:9/snapguard:x")  # the discard port: nothing listens
    assert gone.returncode == 1 and gone.stderr.startswith("oci_push: ") and len(gone.stderr.strip().splitlines()) == 1
