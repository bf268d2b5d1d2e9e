import json
import os
import stat
from pathlib import Path

import pytest

from snapguard import image
from snapguard._host import host_facts
from snapguard.reasons import Reason, Severity, SnapguardError


def _fields() -> dict:
    return {"container_id": "c", "criu_version": "4.2.1", "host": host_facts(), "processes": []}


@pytest.fixture
def sealed(tmp_path: Path) -> Path:
    d = tmp_path / "img"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(300_000))
    (d / "core-1.img").write_bytes(b"core")
    (d / "sub").mkdir()
    (d / "sub" / "x.img").write_bytes(b"x")
    image.seal(str(d), _fields())
    return d


def test_seal_writes_private_manifest_and_marker(sealed: Path) -> None:
    manifest = image.verify(str(sealed))
    assert set(manifest["files"]) == {"pages-1.img", "core-1.img", "sub/x.img"}
    assert manifest["image_bytes"] == 300_000 + 4 + 1
    for name in (image.MANIFEST_NAME, image.MARKER_NAME, "pages-1.img"):
        assert stat.S_IMODE((sealed / name).stat().st_mode) == 0o600


def test_missing_marker_is_incomplete(sealed: Path) -> None:
    (sealed / image.MARKER_NAME).unlink()
    with pytest.raises(SnapguardError) as e:
        image.verify(str(sealed))
    assert e.value.reason is Reason.IMAGE_INCOMPLETE


@pytest.mark.parametrize("tamper", ["flip", "truncate", "delete", "symlink"])
def test_tampered_file_is_corrupt(sealed: Path, tamper: str) -> None:
    target = sealed / "pages-1.img"
    if tamper == "flip":
        data = bytearray(target.read_bytes())
        data[1000] ^= 0xFF
        target.write_bytes(bytes(data))
    elif tamper == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    elif tamper == "delete":
        target.unlink()
    else:
        data = target.read_bytes()
        (sealed / "elsewhere").write_bytes(data)
        target.unlink()
        target.symlink_to(sealed / "elsewhere")
    with pytest.raises(SnapguardError) as e:
        image.verify(str(sealed))
    assert e.value.reason is Reason.IMAGE_CORRUPT
    assert "pages-1.img" in str(e.value)


def test_edited_manifest_is_corrupt(sealed: Path) -> None:
    path = sealed / image.MANIFEST_NAME
    m = json.loads(path.read_text())
    m["container_id"] = "other"
    path.write_text(json.dumps(m))
    with pytest.raises(SnapguardError) as e:
        image.verify(str(sealed))
    assert e.value.reason is Reason.IMAGE_CORRUPT


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m.update(schema="other/9"), "schema"),
    (lambda m: m["files"].update({"../etc/passwd": {"size": 1, "sha256": "0" * 64}}), "plain relative path"),
    (lambda m: m["files"].update({"/abs": {"size": 1, "sha256": "0" * 64}}), "plain relative path"),
    (lambda m: m["files"].update({"a.img": {"size": -1, "sha256": "0" * 64}}), "needs a size"),
    (lambda m: m["files"].update({"a.img": {"size": 1, "sha256": "zz"}}), "needs a size"),
    (lambda m: m["host"]["cpu"].update(flags="sse2"), "flags"),
    (lambda m: m.update(epoch="yesterday"), "epoch"),
    (lambda m: m.update(epoch=True), "epoch"),
], ids=["schema", "traversal", "absolute", "size", "sha", "flags", "epoch", "epoch-bool"])
def test_invalid_manifest_from_another_host(mutate, message: str, sealed: Path) -> None:
    """A manifest resealed with a valid marker but invalid content is MANIFEST_INVALID."""
    path = sealed / image.MANIFEST_NAME
    m = json.loads(path.read_text())
    mutate(m)
    data = json.dumps(m).encode()
    path.write_bytes(data)
    import hashlib
    (sealed / image.MARKER_NAME).write_text(json.dumps({"manifest_sha256": hashlib.sha256(data).hexdigest()}))
    with pytest.raises(SnapguardError, match=message) as e:
        image.verify(str(sealed))
    assert e.value.reason is Reason.MANIFEST_INVALID


def test_image_larger_than_available_memory() -> None:
    host = host_facts()
    manifest = {"host": json.loads(json.dumps(host)), "criu_version": "4.2.1", "image_bytes": 8 << 30}
    (f,) = image.compare_with_host(manifest, {**host, "mem_available": 4 << 30}, "4.2.1")
    assert f.reason is Reason.HOST_MEMORY_INSUFFICIENT and f.evidence == {"needed": 8 << 30, "available": 4 << 30}
    assert image.compare_with_host(manifest, {**host, "mem_available": 9 << 30}, "4.2.1") == []


def test_compare_with_host() -> None:
    host = host_facts()
    manifest = {"host": json.loads(json.dumps(host)), "criu_version": "4.2.1", "image_bytes": 1}
    assert image.compare_with_host(manifest, host, "4.2.1") == []
    manifest["host"]["cpu"]["flags"] = host["cpu"]["flags"] + ["avx512_imaginary"]
    manifest["host"]["kernel"] = "5.4.0-old"
    findings = image.compare_with_host(manifest, host, "4.1.1")
    by_reason = {f.reason: f for f in findings}
    assert by_reason[Reason.CPU_FEATURE_MISMATCH].severity is Severity.BLOCKER
    assert by_reason[Reason.CPU_FEATURE_MISMATCH].evidence["missing_flags"] == ["avx512_imaginary"]
    assert by_reason[Reason.KERNEL_CHANGED].severity is Severity.WARNING
    assert by_reason[Reason.CRIU_VERSION_CHANGED].severity is Severity.WARNING
