import hashlib
import json
import os
import socket
import stat
import time
from pathlib import Path

import pytest

from snapguard import image, names
from snapguard.procfs import host_facts
from snapguard.reasons import Reason, Severity, SnapguardError
from tests.trusted import image_fields, sealed_image



@pytest.fixture
def sealed(tmp_path: Path) -> Path:
    return sealed_image(tmp_path / "img")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A root-only file outside the image, of a size no image file has."""
    secret_dir = tmp_path / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "secret"
    secret.write_bytes(b"s" * 123_457)
    secret.chmod(0o644)
    return secret


def _reseal(d: Path, m: dict) -> None:
    """Write a manifest as someone with root on another host would: with a matching marker."""
    data = json.dumps(m).encode()
    (d / image.MANIFEST_NAME).write_bytes(data)
    (d / image.MARKER_NAME).write_text(json.dumps({"manifest_sha256": hashlib.sha256(data).hexdigest()}))


def _refusal(d: Path) -> SnapguardError:
    with pytest.raises(SnapguardError) as e:
        image.verify(str(d))
    assert "\n" not in str(e.value)
    return e.value


def test_seal_writes_private_manifest_and_marker(sealed: Path) -> None:
    manifest = image.verify(str(sealed)).to_json()
    assert set(manifest["files"]) == {"pages-1.img", "core-1.img"}
    assert manifest["image_bytes"] == 300_000 + 4
    for name in (image.MANIFEST_NAME, image.MARKER_NAME, "pages-1.img", "core-1.img"):
        assert stat.S_IMODE((sealed / name).stat().st_mode) == 0o600
    assert not [p for p in sealed.iterdir() if ".tmp." in p.name]


def test_parallel_span_hashing_matches_sequential(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(10_000))
    (d / "empty.img").write_bytes(b"")
    sequential = image.seal(str(d), image_fields())["files"]
    monkeypatch.setattr(image.hashing, "_SPAN", 1000)
    monkeypatch.setattr(image.hashing, "_PARALLEL_BYTES", 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    parallel = image.seal(str(d), image_fields())["files"]
    assert image.verify(str(d)).to_json()["files"] == parallel
    assert parallel["empty.img"] == sequential["empty.img"]
    # the span scheme: the sha256 of the spans' sha256s
    data = (d / "pages-1.img").read_bytes()
    spans = b"".join(hashlib.sha256(data[i:i + 1000]).digest() for i in range(0, len(data), 1000))
    assert parallel["pages-1.img"]["sha256"] == hashlib.sha256(spans).hexdigest()


def test_missing_marker_is_incomplete(sealed: Path) -> None:
    (sealed / image.MARKER_NAME).unlink()
    assert _refusal(sealed).reason is Reason.IMAGE_INCOMPLETE


def test_missing_image_dir_is_incomplete(tmp_path: Path) -> None:
    assert _refusal(tmp_path / "nothing-here").reason is Reason.IMAGE_INCOMPLETE


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
    e = _refusal(sealed)
    assert e.reason is Reason.IMAGE_CORRUPT
    assert "pages-1.img" in str(e)


def test_edited_manifest_is_corrupt(sealed: Path) -> None:
    path = sealed / image.MANIFEST_NAME
    m = json.loads(path.read_text())
    m["container_id"] = "other"
    path.write_text(json.dumps(m))
    assert _refusal(sealed).reason is Reason.IMAGE_CORRUPT


# --- seal never follows a link ------------------------------------------------------------------

@pytest.mark.parametrize("how", ["symlink", "symlink-to-dir", "hardlink"])
def test_seal_refuses_planted_link_and_leaves_its_target_alone(tmp_path: Path, outside: Path, how: str) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / "core-1.img").write_bytes(b"core")
    if how == "symlink":
        (d / "pages-2.img").symlink_to(outside)
    elif how == "symlink-to-dir":
        (d / "pages-2.img").symlink_to(outside.parent)
    else:
        os.link(outside, d / "pages-2.img")
    before = outside.stat()
    with pytest.raises(SnapguardError) as e:
        image.seal(str(d), image_fields())
    assert e.value.reason is Reason.IMAGE_WRITE_FAILED
    assert "pages-2.img" in str(e.value)
    after = outside.stat()
    assert stat.S_IMODE(after.st_mode) == 0o644 == stat.S_IMODE(before.st_mode)
    assert stat.S_IMODE(outside.parent.stat().st_mode) == 0o700
    assert not (d / image.MARKER_NAME).exists()


@pytest.mark.parametrize("kind", ["fifo", "socket", "subdirectory"])
def test_seal_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / "core-1.img").write_bytes(b"core")
    odd = d / "odd.img"
    if kind == "fifo":
        os.mkfifo(odd)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(odd))
        s.close()
    else:
        odd.mkdir()
        (odd / "x.img").write_bytes(b"x")
    t0 = time.monotonic()
    with pytest.raises(SnapguardError) as e:
        image.seal(str(d), image_fields())
    assert time.monotonic() - t0 < 5
    assert e.value.reason is Reason.IMAGE_WRITE_FAILED and "odd.img" in str(e.value)
    assert not (d / image.MARKER_NAME).exists()


def test_seal_refuses_symlinked_image_dir(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "core-1.img").write_bytes(b"core")
    (tmp_path / "img").symlink_to(real)
    with pytest.raises(SnapguardError) as e:
        image.seal(str(tmp_path / "img"), image_fields())
    assert e.value.reason is Reason.IMAGE_WRITE_FAILED
    assert stat.S_IMODE((real / "core-1.img").stat().st_mode) == 0o644


def test_seal_refuses_a_symlinked_manifest_name(tmp_path: Path, outside: Path) -> None:
    """A leftover manifest name that is a symlink is refused; the link's target is untouched."""
    d = tmp_path / "img"
    d.mkdir()
    (d / "core-1.img").write_bytes(b"core")
    (d / image.MANIFEST_NAME).symlink_to(outside)
    with pytest.raises(SnapguardError) as e:
        image.seal(str(d), image_fields())
    assert e.value.reason is Reason.IMAGE_WRITE_FAILED and image.MANIFEST_NAME in str(e.value)
    assert outside.read_bytes() == b"s" * 123_457


def test_failed_reseal_leaves_no_marker(sealed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(image.sealing, "_write", fail)
    with pytest.raises(OSError):
        image.seal(str(sealed), image_fields())
    assert not (sealed / image.MARKER_NAME).exists()
    assert _refusal(sealed).reason is Reason.IMAGE_INCOMPLETE


# --- verify reads nothing outside the image -----------------------------------------------------

def test_manifest_path_through_symlinked_subdir_is_refused_without_disclosure(sealed: Path, outside: Path) -> None:
    (sealed / "sub").symlink_to(outside.parent)
    m = json.loads((sealed / image.MANIFEST_NAME).read_text())
    m["files"]["sub/secret"] = {"size": 1, "sha256": "0" * 64}
    _reseal(sealed, m)
    e = _refusal(sealed)
    assert e.reason is Reason.MANIFEST_INVALID
    assert "files" in str(e) and "sub/secret" in str(e)
    assert "123457" not in str(e) and "123457" not in json.dumps(e.failure.evidence)


def test_listed_symlink_to_outside_file_is_refused_without_disclosure(sealed: Path, outside: Path) -> None:
    (sealed / "secret.img").symlink_to(outside)
    m = json.loads((sealed / image.MANIFEST_NAME).read_text())
    m["files"]["secret.img"] = {"size": 1, "sha256": "0" * 64}
    _reseal(sealed, m)
    e = _refusal(sealed)
    assert e.reason is Reason.IMAGE_CORRUPT and "secret.img" in str(e) and "symlink" in str(e)
    assert "123457" not in str(e)


@pytest.mark.timeout(10)
def test_listed_fifo_does_not_block(sealed: Path) -> None:
    os.mkfifo(sealed / "fifo.img")
    m = json.loads((sealed / image.MANIFEST_NAME).read_text())
    m["files"]["fifo.img"] = {"size": 0, "sha256": "0" * 64}
    _reseal(sealed, m)
    e = _refusal(sealed)
    assert e.reason is Reason.IMAGE_CORRUPT and "fifo.img" in str(e)


# --- nothing unlisted reaches CRIU --------------------------------------------------------------

def test_unlisted_file_is_refused(sealed: Path) -> None:
    (sealed / "cgroup.img").write_bytes(b"planted")
    (sealed / "cgroup.img").chmod(0o600)
    e = _refusal(sealed)
    assert e.reason is Reason.IMAGE_CORRUPT and "cgroup.img" in str(e)


def test_what_a_restore_adds_is_tolerated(sealed: Path) -> None:
    for name in ("restore.log", "stats-restore", "restored.pid", "snapguard-result.json",
                 f"snapguard-result.json.tmp.{os.getpid()}"):
        (sealed / name).write_bytes(b"x")
    image.verify(str(sealed))
    (sealed / "stats-restore").write_bytes(b"second restore")
    image.verify(str(sealed))


def test_symlink_where_a_restore_writes_is_refused(sealed: Path, outside: Path) -> None:
    (sealed / "restore.log").symlink_to(outside)
    e = _refusal(sealed)
    assert e.reason is Reason.IMAGE_CORRUPT and "restore.log" in str(e)


# --- snapguard's own files: never blocked, never anything but regular files ---------------------

@pytest.mark.timeout(10)
@pytest.mark.parametrize("name, reason", [(image.MARKER_NAME, Reason.IMAGE_CORRUPT),
                                          (image.MANIFEST_NAME, Reason.MANIFEST_INVALID)])
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_marker_or_manifest_that_is_not_a_regular_file(sealed: Path, outside: Path, name: str, reason: Reason,
                                                       kind: str) -> None:
    (sealed / name).unlink()
    if kind == "fifo":
        os.mkfifo(sealed / name)
    elif kind == "directory":
        (sealed / name).mkdir()
    else:
        (sealed / name).symlink_to(outside)
    e = _refusal(sealed)
    assert e.reason is reason and name in str(e)


def test_oversized_marker_is_corrupt(sealed: Path) -> None:
    (sealed / image.MARKER_NAME).write_bytes(b" " * 5000)
    assert _refusal(sealed).reason is Reason.IMAGE_CORRUPT


@pytest.mark.parametrize("marker", [b"[]", b'"x"', b'{"manifest_sha256": 5}', b"{", b"\xff"])
def test_malformed_marker_is_corrupt(sealed: Path, marker: bytes) -> None:
    (sealed / image.MARKER_NAME).write_bytes(marker)
    assert _refusal(sealed).reason is Reason.IMAGE_CORRUPT


# --- directory and file trust at restore --------------------------------------------------------

def test_group_writable_image_dir_is_untrusted(sealed: Path) -> None:
    sealed.chmod(0o770)
    assert _refusal(sealed).reason is Reason.UNTRUSTED_PATH


def test_symlinked_image_dir_is_untrusted(sealed: Path) -> None:
    link = sealed.parent / "link"
    link.symlink_to(sealed)
    assert _refusal(link).reason is Reason.UNTRUSTED_PATH


def test_group_writable_image_file_is_untrusted(sealed: Path) -> None:
    (sealed / "core-1.img").chmod(0o660)
    e = _refusal(sealed)
    assert e.reason is Reason.UNTRUSTED_PATH and "core-1.img" in str(e)


# --- the manifest's schema ----------------------------------------------------------------------

def _gpu(**over) -> dict:
    g = {"index": 0, "name": "H200", "uuid": "GPU-1", "pci_bus_id": "0000:01:00.0", "minor": 0,
         "compute_capability": "9.0", "memory_total": 1 << 30, "used_by_image": 1 << 20}
    return {"driver_version": "570.1", "cuda_driver_version": 12080, "gpus": [{**g, **over}]}


_PROC = {"pid": 7, "comm": "python", "gpu": True, "gpu_memory_bytes": 0, "rss_bytes": 1}


def _file(name: str, size: object = 1, sha256: object = "0" * 64, **more: object):
    return lambda m: m["files"].update({name: {"size": size, "sha256": sha256, **more}})


def _set(**fields: object):
    return lambda m: m.update(fields)


@pytest.mark.parametrize("mutate, message", [
    pytest.param(_set(schema="other/9"), "field schema", id="schema"),
    pytest.param(_file("../etc/passwd"), "field files", id="traversal"),
    pytest.param(_file("/abs"), "field files", id="absolute"),
    pytest.param(_file("sub/x.img"), "field files", id="subdirectory"),
    pytest.param(_file(".."), "field files", id="dotdot"),
    pytest.param(_file(""), "field files", id="empty-name"),
    pytest.param(_file("a\0b"), "field files", id="nul"),
    pytest.param(_file("x" * 256), "field files", id="long-name"),
    pytest.param(_file("a.img", size=-1), "size", id="size-negative"),
    pytest.param(_file("a.img", size=1.0), "size", id="size-float"),
    pytest.param(_file("a.img", size=None), "size", id="size-null"),
    pytest.param(_file("a.img", sha256="zz"), "sha256", id="sha"),
    pytest.param(_file("a.img", sha256="0" * 64 + "\n"), "sha256", id="sha-newline"),
    pytest.param(_file("a.img", path="/etc"), "path", id="entry-extra-field"),
    pytest.param(_set(files=[]), "field files", id="files-array"),
    pytest.param(lambda m: m["host"]["cpu"].update(flags="sse2"), "flags", id="flags-string"),
    pytest.param(lambda m: m["host"]["cpu"].update(flags=["sse2\n"]), "flags", id="flags-newline"),
    pytest.param(lambda m: m["host"].pop("arch"), "arch", id="host-arch-missing"),
    pytest.param(_set(epoch="yesterday"), "epoch", id="epoch"),
    pytest.param(_set(epoch=True), "epoch", id="epoch-bool"),
    pytest.param(_set(processes=5), "processes", id="processes-number"),
    pytest.param(_set(processes=None), "processes", id="processes-null"),
    pytest.param(lambda m: m.pop("processes"), "processes", id="processes-missing"),
    pytest.param(_set(processes=[5]), "processes", id="process-number"),
    pytest.param(_set(processes=[{**_PROC, "pid": 0}]), "pid", id="pid-zero"),
    pytest.param(_set(processes=[{**_PROC, "pid": "1"}]), "pid", id="pid-string"),
    pytest.param(_set(processes=[{**_PROC, "nspid": 1.5}]), "nspid", id="nspid-float"),
    pytest.param(_set(processes=[{**_PROC, "gpu": "yes"}]), "gpu", id="process-gpu-string"),
    pytest.param(_set(image_bytes=None), "image_bytes", id="image-bytes-null"),
    pytest.param(_set(criu_version=4), "criu_version", id="criu-version-number"),
    pytest.param(_set(network_lock="all"), "network_lock", id="network-lock"),
    pytest.param(_set(own_netns="no"), "own_netns", id="own-netns"),
    pytest.param(_set(tcp_connections=-1), "tcp_connections", id="tcp-connections"),
    pytest.param(_set(leave_running=1), "leave_running", id="leave-running"),
    pytest.param(_set(take_point=[]), "take_point", id="take-point"),
    pytest.param(_set(gpu=5), "gpu", id="gpu-number"),
    pytest.param(_set(gpu=_gpu(used_by_image=-1)), "used_by_image", id="gpu-used-negative"),
    pytest.param(_set(gpu={**_gpu(), "gpus": None}), "gpus", id="gpus-null"),
    pytest.param(_set(gpu=_gpu(uuid=None)), "uuid", id="gpu-uuid-null"),
    pytest.param(_set(container_id=["c"]), "container_id", id="container-id"),
    pytest.param(_set(root_pid=-1), "root_pid", id="root-pid"),
])
def test_invalid_manifest_from_another_host(mutate, message: str, sealed: Path) -> None:
    """A manifest resealed with a valid marker but invalid content is one line of MANIFEST_INVALID."""
    m = json.loads((sealed / image.MANIFEST_NAME).read_text())
    mutate(m)
    _reseal(sealed, m)
    e = _refusal(sealed)
    assert e.reason is Reason.MANIFEST_INVALID
    assert message in str(e)


def test_processes_not_an_array_names_the_field(sealed: Path) -> None:
    m = json.loads((sealed / image.MANIFEST_NAME).read_text())
    m["processes"] = 5
    _reseal(sealed, m)
    assert _refusal(sealed).failure.detail == "manifest field processes: 5 is not of type 'array'"


def test_long_values_are_truncated(sealed: Path) -> None:
    m = json.loads((sealed / image.MANIFEST_NAME).read_text())
    m["processes"] = "p" * 100_000
    _reseal(sealed, m)
    assert len(str(_refusal(sealed))) < 600


@pytest.mark.parametrize("data", [b'{"epoch": NaN}', b"[" * 100_000, b"\xff\xfe", b"{}"])
def test_manifest_that_is_not_a_manifest(sealed: Path, data: bytes) -> None:
    (sealed / image.MANIFEST_NAME).write_bytes(data)
    (sealed / image.MARKER_NAME).write_text(json.dumps({"manifest_sha256": hashlib.sha256(data).hexdigest()}))
    assert _refusal(sealed).reason is Reason.MANIFEST_INVALID


def test_valid_full_manifest_and_unknown_top_level_fields(sealed: Path) -> None:
    m = json.loads((sealed / image.MANIFEST_NAME).read_text())
    m.update(processes=[{**_PROC, "nspid": 1}], gpu=_gpu(), network_lock="skip", own_netns=True, tcp_connections=2,
             leave_running=False, take_point={"7": {"step": 3}}, root_pid=7, bare=True, added_in_v2={"x": 1})
    _reseal(sealed, m)
    assert image.verify(str(sealed)).to_json()["gpu"]["gpus"][0]["uuid"] == "GPU-1"
    assert image.validate_manifest(m, str(sealed)) is m


def _typed(m: dict) -> image.Manifest:
    """A manifest of the fields given, the rest the least the schema takes."""
    full = {"schema": image.SCHEMA, "snapguard_version": "0", "epoch": 0, "processes": [], "files": {}, **m}
    return image.Manifest.from_json(json.loads(json.dumps(full)), "test")


def test_image_larger_than_available_memory() -> None:
    host = host_facts()
    manifest = {"host": json.loads(json.dumps(host)), "criu_version": "4.2.1", "image_bytes": 8 << 30}
    (f,) = image.compare_with_host(_typed(manifest), {**host, "mem_available": 4 << 30}, "4.2.1")
    assert f.reason is Reason.HOST_MEMORY_INSUFFICIENT and f.evidence == {"needed": 8 << 30, "available": 4 << 30}
    assert image.compare_with_host(_typed(manifest), {**host, "mem_available": 9 << 30}, "4.2.1") == []


def test_compare_with_host() -> None:
    host = host_facts()
    manifest = {"host": json.loads(json.dumps(host)), "criu_version": "4.2.1", "image_bytes": 1}
    assert image.compare_with_host(_typed(manifest), host, "4.2.1") == []
    manifest["host"]["cpu"]["flags"] = host["cpu"]["flags"] + ["avx512_imaginary"]
    manifest["host"]["kernel"] = "5.4.0-old"
    findings = image.compare_with_host(_typed(manifest), host, "4.1.1")
    by_reason = {f.reason: f for f in findings}
    assert by_reason[Reason.CPU_FEATURE_MISMATCH].severity is Severity.BLOCKER
    assert by_reason[Reason.CPU_FEATURE_MISMATCH].evidence["missing_flags"] == ["avx512_imaginary"]
    assert by_reason[Reason.KERNEL_CHANGED].severity is Severity.WARNING
    assert by_reason[Reason.CRIU_VERSION_CHANGED].severity is Severity.WARNING


def test_digests_verified_while_written_are_not_read_again_but_stay_bound_to_the_inode(sealed: Path) -> None:
    """A store's pull checks every span as it writes the file; verification then skips that file
    only while it is the same inode with the manifest's digest."""
    manifest = json.loads((sealed / image.MANIFEST_NAME).read_text())
    pages = sealed / "pages-1.img"
    digest = manifest["files"]["pages-1.img"]["sha256"]
    data = bytearray(pages.read_bytes())
    data[1000] ^= 0xFF
    with open(pages, "r+b") as f:  # same inode, same size, other bytes
        f.write(bytes(data))
    st = pages.stat()
    ident = (st.st_dev, st.st_ino)
    # told it was verified as written: not read again (this is what saves the second pass)
    assert image.verify(str(sealed), {"pages-1.img": (digest, ident)}).to_json()["files"]
    with pytest.raises(SnapguardError) as e:  # not told: read, and the flip is found
        image.verify(str(sealed))
    assert e.value.reason is Reason.IMAGE_CORRUPT
    with pytest.raises(SnapguardError):  # another inode than the one verified: read again
        image.verify(str(sealed), {"pages-1.img": (digest, (st.st_dev, st.st_ino + 1))})
    with pytest.raises(SnapguardError):  # a digest other than the manifest's: read again
        image.verify(str(sealed), {"pages-1.img": ("0" * 64, ident)})


def _wait_for(what, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "not within 30 s"
        time.sleep(0.01)


@pytest.fixture
def small_spans(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(image.hashing, "_SPAN", 4096)
    return 4096


def _three_spans_hashed(tmp_path: Path, span: int) -> tuple[Path, image.PageFileHasher]:
    """An image directory whose pages-1.img, new since the hasher started, holds three whole spans
    the hasher has hashed."""
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    hasher = image.PageFileHasher(str(d), threads=1)
    (d / "pages-1.img").write_bytes(os.urandom(span * 3))
    _wait_for(lambda: hasher.done_spans() == 3)
    return d, hasher


def test_spans_hashed_while_written_give_the_seal_its_digests(tmp_path: Path, small_spans: int) -> None:
    """A page file appended to while the hasher runs: the spans it hashed while the file was still
    growing go to the seal, which hashes the rest, and the manifest is what a seal from scratch
    writes. A page file without a whole span is not even opened."""
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    hasher = image.PageFileHasher(str(d), threads=2)
    data = os.urandom(small_spans * 7 + 123)
    with open(d / "pages-1.img", "wb") as f:  # as CRIU does: at the file's position, in pieces
        for i in range(0, small_spans * 3, 1000):
            f.write(data[i:i + 1000])
        f.flush()
        _wait_for(lambda: hasher.done_spans() == 3)  # hashed while the file is still being written
        for i in range(small_spans * 3, len(data), 1000):
            f.write(data[i:i + 1000])
    (d / "pages-2.img").write_bytes(b"p" * 100)
    (d / "core-1.img").write_bytes(b"core")  # not a page file: the seal hashes it
    _wait_for(lambda: hasher.done_spans() == 7)
    time.sleep(0.1)  # polls enough to have opened pages-2.img, were it to
    known = hasher.finish()
    assert set(known) == {"pages-1.img"} and sorted(known["pages-1.img"][1]) == list(range(7))
    assert hasher.finish() == {} and hasher.error is None  # once
    manifest = image.seal(str(d), image_fields(), known)
    assert image.verify(str(d)).to_json()["files"] == manifest["files"]
    assert image.seal(str(d), image_fields())["files"] == manifest["files"]


def test_a_spill_copy_is_hashed_while_written_though_made_before_the_hasher(tmp_path: Path, small_spans: int) -> None:
    """The take point's spill copy is created (O_EXCL, empty) before a stop snapshot's hasher starts
    and written front to back beside CRIU: named `fresh`, its spans are hashed as they land, and
    the manifest is what a seal from scratch writes. Another file that is no page file and not
    named is left to the seal."""
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    name = names.take_spill_name(4242)
    fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    (d / "other.bin").write_bytes(os.urandom(small_spans * 2))
    hasher = image.PageFileHasher(str(d), threads=2, fresh=frozenset({name}))
    try:
        data = os.urandom(small_spans * 5 + 7)
        for i in range(0, len(data), 3000):
            os.write(fd, data[i:i + 3000])
    finally:
        os.close(fd)
    _wait_for(lambda: hasher.done_spans() == 5)
    time.sleep(0.1)  # polls enough to have taken other.bin, were it to
    known = hasher.finish()
    assert set(known) == {name} and sorted(known[name][1]) == list(range(5))
    manifest = image.seal(str(d), image_fields(), known)
    assert image.verify(str(d)).to_json()["files"] == manifest["files"]
    assert image.seal(str(d), image_fields())["files"] == manifest["files"]
    # without the name, the same file is the seal's alone
    assert image.PageFileHasher(str(d), threads=1).finish() == {}


def test_a_page_file_there_before_the_dump_is_hashed_by_the_seal_alone(tmp_path: Path, small_spans: int) -> None:
    """An earlier attempt's page file: CRIU truncates and rewrites the same inode, so what was read
    of it before is no digest of the new one."""
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    (d / "pages-1.img").write_bytes(os.urandom(small_spans * 3))
    hasher = image.PageFileHasher(str(d), threads=1)
    time.sleep(0.1)
    with open(d / "pages-1.img", "r+b") as f:  # O_TRUNC on the same inode, as CRIU's open
        f.truncate(0)
        f.write(os.urandom(small_spans * 3))
    time.sleep(0.1)
    assert hasher.done_spans() == 0
    manifest = image.seal(str(d), image_fields(), hasher.finish())
    assert image.verify(str(d)).to_json()["files"] == manifest["files"]


def test_a_page_file_seen_shorter_loses_what_was_hashed_of_it(tmp_path: Path, small_spans: int) -> None:
    d, hasher = _three_spans_hashed(tmp_path, small_spans)
    with open(d / "pages-1.img", "r+b") as f:
        f.truncate(small_spans)
        _wait_for(lambda: "pages-1.img" in hasher._shrunk)
        f.seek(small_spans)
        f.write(os.urandom(small_spans * 2))
    known = hasher.finish()
    assert "pages-1.img" not in known
    manifest = image.seal(str(d), image_fields(), known)
    assert image.verify(str(d)).to_json()["files"] == manifest["files"]


def test_a_span_changed_after_it_was_hashed_is_refused_at_restore(tmp_path: Path, small_spans: int) -> None:
    """What the hasher read is what the manifest vouches for: a span rewritten in place after it
    (CRIU never does) is found by the restore's check, never passed."""
    d, hasher = _three_spans_hashed(tmp_path, small_spans)
    with open(d / "pages-1.img", "r+b") as f:
        f.seek(small_spans + 5)
        f.write(b"\0" * 8)
    image.seal(str(d), image_fields(), hasher.finish())
    with pytest.raises(SnapguardError) as e:
        image.verify(str(d))
    assert e.value.failure.reason is Reason.IMAGE_CORRUPT and "pages-1.img" in str(e.value)


def test_a_page_file_replaced_after_it_was_hashed_is_hashed_again(tmp_path: Path, small_spans: int) -> None:
    d, hasher = _three_spans_hashed(tmp_path, small_spans)
    known = hasher.finish()
    (d / "new").write_bytes(os.urandom(small_spans * 3))
    os.replace(d / "new", d / "pages-1.img")  # another inode under the name
    manifest = image.seal(str(d), image_fields(), known)
    assert image.verify(str(d)).to_json()["files"] == manifest["files"]


def test_a_page_file_that_is_not_a_regular_file_stops_the_hasher_and_the_seal_refuses_it(
        tmp_path: Path, outside: Path, small_spans: int) -> None:
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    hasher = image.PageFileHasher(str(d), threads=1)
    os.symlink(outside, d / "pages-2.img")
    _wait_for(lambda: hasher.error is not None)
    assert "symlink" in hasher.error
    known = hasher.finish()
    with pytest.raises(SnapguardError) as e:
        image.seal(str(d), image_fields(), known)
    assert e.value.failure.reason is Reason.IMAGE_WRITE_FAILED
