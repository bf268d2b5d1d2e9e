"""The take point's spill: the moved bytes in a tmpfs file of the trainer's own, handed to the
executor over the take socket (SCM_RIGHTS) and passed back with the release; the executor's side
(`_spill.Spill`, `files.FileCopy`, the manifest's names). Real PyTorch on CPU storages, real unix
sockets and files; the whole path through CRIU is tests/system/test_bare.py's take-point test,
the spill on tmpfs mounts of its own (root) tests/system/test_root_spill.py."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from snapguard import files  # noqa: E402
from snapguard.takepoint import client as take  # noqa: E402
from snapguard.takepoint import protocol  # noqa: E402
from snapguard.takepoint import spill as _spill  # noqa: E402
from snapguard.takepoint.workload import env  # noqa: E402
from snapguard.takepoint.workload.offload import Offload  # noqa: E402
from snapguard.takepoint.workload.point import TakePoint  # noqa: E402
from snapguard.takepoint.workload.ring import Ring  # noqa: E402
from snapguard.takepoint.workload.server import answer, serve  # noqa: E402
from snapguard.takepoint.workload.spill import SpillArena  # noqa: E402
from snapguard.reasons import Reason, SnapguardError  # noqa: E402
from tests.fake_proc import with_mountinfo  # noqa: E402


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A directory on a tmpfs (the spill's files must be in memory): /dev/shm, as by default."""
    d = Path(tempfile.mkdtemp(prefix="snapguard-test-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _stepped_trainer(monkeypatch: pytest.MonkeyPatch, shm: Path,
                     width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A CPU model whose AdamW has stepped once, with the take point's CPU move spilling to `shm`."""
    monkeypatch.setenv("SNAPGUARD_TAKE_OFFLOAD_DEVICE", "cpu")
    monkeypatch.setenv("SNAPGUARD_TAKE_SPILL_DIR", str(shm))
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return model, opt


def _state() -> list[torch.Tensor]:
    torch.manual_seed(3)
    return [torch.randn(3000), torch.randn(70000), torch.randn(5)]


@pytest.mark.parametrize("ring", ["default", "2 slots of 4 KiB"])
def test_a_spilled_take_leaves_the_bytes_in_its_file_and_none_mapped(shm: Path, ring: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Taken with a spill directory: every storage empty, its bytes in a file there (0600, the
    take's name), the file unmapped and its descriptor handed over; reloaded from that descriptor
    (through a ring whose slots are read again and again when small), the bytes come back exact and
    the file's name is gone."""

    if ring != "default":
        monkeypatch.setattr(Ring, "SLOTS", 2)
        monkeypatch.setattr(Ring, "SLOT_BYTES", 4096)
    tensors = _state()
    before = [t.clone() for t in tensors]
    offload = Offload("cpu")
    figures = offload.take(torch, tensors, spill_dir=str(shm))
    assert figures["state"] == "moved" and "spill_error" not in figures, figures
    spill = figures["spill"]
    path = Path(spill["path"])
    assert path.parent == shm and protocol.TAKE_SPILL_SOURCE.fullmatch(path.name), spill
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_size == spill["bytes"]
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    fd = offload.spill_fd
    assert fd is not None and os.fstat(fd).st_ino == path.stat().st_ino
    assert isinstance(offload.arena, SpillArena) and offload.arena.map is None  # nothing of it mapped
    offload.reload(torch, source_fd=fd)
    os.close(fd)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    assert not path.exists() and offload.arena is None


def test_a_hold_released_without_its_file_reloads_from_its_own_name(shm: Path) -> None:
    """The executor gave up (or is gone) and passed nothing back, or passed something that is not
    the file: the bytes come back from the file's own name, which is then removed."""
    for passed in (None, "fifo"):
        tensors = _state()
        before = [t.clone() for t in tensors]
        offload = Offload("cpu")
        offload.take(torch, tensors, spill_dir=str(shm))
        assert offload.spill_fd is not None
        os.close(offload.spill_fd)
        source = None
        if passed == "fifo":
            os.mkfifo(shm / "not-it")
            source = os.open(shm / "not-it", os.O_RDWR)
        offload.reload(torch, source_fd=source)
        if source is not None:
            os.close(source)
            os.unlink(shm / "not-it")
        assert all(torch.equal(a, b) for a, b in zip(tensors, before))
        assert list(shm.iterdir()) == []


def test_a_spill_that_cannot_be_made_or_filled_moves_nothing_into_it(shm: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """No such directory, or one not on a tmpfs: the bytes move into the process's memory as
    without a spill, the reason in `spill_error`, no file left. Pages that cannot be had part way
    (a full tmpfs, where a plain write into the mapping would be a SIGBUS): the take fails, every
    storage stays, the file is removed."""
    probe = os.open(tmp_path, os.O_RDONLY)
    disk = protocol.fs_type(probe) != protocol.TMPFS_MAGIC  # a CI's /tmp may be a tmpfs
    os.close(probe)
    for where, why in ((shm / "absent", "No such file"), (tmp_path, "not a tmpfs")):
        if where == tmp_path and not disk:
            continue
        tensors = _state()
        offload = Offload("cpu")
        figures = offload.take(torch, tensors, spill_dir=str(where))
        assert figures["state"] == "moved" and why in figures["spill_error"] and "spill" not in figures, figures
        assert offload.spill_fd is None and list(shm.iterdir()) == [] and list(tmp_path.iterdir()) == []
        offload.reload(torch)

    real, calls = SpillArena.populate, []

    def full(self, host, n=None):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 2:
            raise OSError(28, "injected: no space left on the tmpfs")
        return real(self, host, n)

    monkeypatch.setattr(SpillArena, "populate", full)
    tensors = _state()
    before = [t.clone() for t in tensors]
    offload = Offload("cpu")
    figures = offload.take(torch, tensors, spill_dir=str(shm))
    assert figures["state"] == "failed" and "injected" in figures["error"], figures
    assert offload.spill_fd is None and offload.moved == [] and list(shm.iterdir()) == []
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_the_take_socket_hands_the_file_over_and_the_release_brings_it_back(shm: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a real unix socket: `take <s> spill` is answered with the figures and the file's
    descriptor (the trainer's own closed before the answer ends), which `_spill.Spill.received`
    accepts; a release that passes it back lets the trainer reload its optimizer from it, and
    the trainer's step goes on with its state exact. A take without `spill` hands nothing over."""
    model, opt = _stepped_trainer(monkeypatch, shm, 64)
    saved = [p.detach().clone() for p in model.parameters()] + \
        [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    point = TakePoint()
    path = _served(point, tmp_path)
    assert take._ask(path, os.getpid(), "status\n", 5)["spill"] is True
    for spill in (True, False):
        trainer = threading.Thread(target=point.at_step_end, args=(opt, (), {}))
        asked: dict[str, object] = {}

        def ask() -> None:
            asked["reply"], asked["fds"] = take._ask_fds(path, os.getpid(), f"take 5{' spill' if spill else ''}\n", 10)

        asker = threading.Thread(target=ask)
        asker.start()
        while point.hold_at is None:
            threading.Event().wait(0.01)
        trainer.start()
        asker.join(10)
        reply, fds = asked["reply"], asked["fds"]
        assert isinstance(reply, dict) and isinstance(fds, list) and reply["ok"], reply
        if spill:
            got = _spill.Spill.received(os.getpid(), reply, fds)
            assert got is not None and os.fstat(got.fd).st_size == reply["offload"]["spill"]["bytes"]
            assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
            # the trainer holds no descriptor of it any more: only the name and ours
            own = []
            for n in os.listdir("/proc/self/fd"):
                try:
                    own.append(os.readlink(f"/proc/self/fd/{n}"))
                except FileNotFoundError:
                    pass  # the listing's own descriptor
            assert own.count(reply["offload"]["spill"]["path"]) == 1
            take.release_all({os.getpid(): {"socket": path}}, {os.getpid(): got})
            got.close()
        else:
            assert fds == [] and "spill" not in reply["offload"], reply
            take.release_all({os.getpid(): {"socket": path}})
        trainer.join(10)
        assert not trainer.is_alive()
        now = [p.detach() for p in model.parameters()] + \
            [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        assert all(torch.equal(a, b) for a, b in zip(now, saved))
        assert list(shm.iterdir()) == []


def _fd_of(shm: Path, name: str, size: int) -> int:
    p = shm / name
    p.write_bytes(b"x" * size)
    return os.open(p, os.O_RDONLY)


def test_an_answer_whose_file_does_not_match_it_is_refused_and_its_descriptors_closed(shm: Path,
                                                                                      tmp_path: Path) -> None:
    """The executor takes a spill only as the take point makes it: asked for, one descriptor, a
    regular file on a tmpfs of the size reported, holding the bytes moved (not a sparse file of
    any size), under an absolute name of this pid's; anything else is refused (ValueError) with
    every descriptor that came closed. A malformed answer is refused the same way."""
    name = "snapguard-take-7-0123456789abcdef"

    def answer(path: object = str(shm / name), size: object = 8192, moved: object = 8000,
               storages: object = 2) -> dict[str, object]:
        return {"ok": True, "offload": {"bytes": moved, "storages": storages,
                                        "spill": {"path": path, "bytes": size}}}

    fd = _fd_of(shm, name, 8192)
    spill = _spill.Spill.received(7, answer(), [fd])
    assert spill is not None and spill.fd == fd and os.get_inheritable(fd) is False
    spill.close()
    assert _spill.Spill.received(7, {"ok": True, "offload": {"state": "moved"}}, []) is None
    assert _spill.Spill.received(7, {"ok": True}, [], asked=False) is None
    cases = [
        (answer(size=4096), "a size that is not the file's"),
        (answer(path="/etc/passwd"), "not the take point's name"),
        (answer(path=str(shm / "snapguard-take-8-0123456789abcdef")), "another pid's name"),
        (answer(path=f"{shm}/../{shm.name}/{name}"), "a path not normal"),
        (answer(path=name), "a relative path"),
        (answer(size=True), "a bool"),
        (answer(moved=100, storages=1), "far more bytes than moved: a sparse file"),
        (answer(moved=9000), "more moved than the file holds"),
        (answer(), "two descriptors"),
        ({"ok": True, "offload": {"state": "moved"}}, "a descriptor for no spill"),
        (answer(), "no descriptor"),
        (answer(), "not asked"),
        ({"ok": True, "offload": "x"}, "a malformed answer"),
    ]
    for reply, why in cases:
        fds = [] if why == "no descriptor" else [_fd_of(shm, name, 8192)]
        if why == "two descriptors":
            fds.append(_fd_of(shm, "other", 10))
        with pytest.raises(ValueError):
            _spill.Spill.received(7, reply, fds, asked=why != "not asked")
        for n in fds:
            with pytest.raises(OSError):
                os.fstat(n)  # closed
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(ValueError):
        _spill.Spill.received(7, answer(), [r])
    # the name the answer gives is another file than the descriptor's (same size, same place):
    # what the executor would journal and remove by that name is not the spill
    other = _fd_of(shm, f"{name}-handed", 8192)
    with pytest.raises(ValueError, match="does not name the descriptor's file"):
        _spill.Spill.received(7, answer(), [other])
    (shm / f"{name}-handed").unlink()
    # a container's answer: its directory as it names it, mapped to the directory here; a spill
    # anywhere else in the container is refused
    moved_in = _fd_of(shm, name, 8192)
    spill = _spill.Spill.received(7, answer(path=f"/run/snapguard-spill/{name}"), [moved_in],
                                where=("/run/snapguard-spill", str(shm)))
    assert spill is not None and spill.path == str(shm / name)
    spill.close()
    with pytest.raises(ValueError, match="in /run/snapguard-spill"):
        _spill.Spill.received(7, answer(path=f"/dev/shm/{name}"), [_fd_of(shm, name, 8192)],
                            where=("/run/snapguard-spill", str(shm)))
    (shm / name).unlink()
    sparse = os.open(shm / name, os.O_RDWR | os.O_CREAT)
    os.ftruncate(sparse, 8192)  # the size, but no bytes in it
    with pytest.raises(ValueError, match="holding"):
        _spill.Spill.received(7, answer(), [sparse])
    probe = os.open(tmp_path, os.O_RDONLY)
    disk = protocol.fs_type(probe) != protocol.TMPFS_MAGIC
    os.close(probe)
    if not disk:
        pytest.skip("the test directory is on a tmpfs: the refusal of a file not in memory is not checked here")
    (tmp_path / name).write_bytes(b"x" * 8192)  # a file that is not in memory (a FUSE file's reads could hang)
    with pytest.raises(ValueError, match="not on a tmpfs"):  # named as in memory, handed over from the disk
        _spill.Spill.received(7, answer(), [os.open(tmp_path / name, os.O_RDONLY)])
    with pytest.raises(ValueError, match="is not one the take point makes"):  # named outside any tmpfs
        _spill.Spill.received(7, answer(path=str(tmp_path / name)), [_fd_of(shm, f"{name}x", 8192)])


def test_the_executor_removes_only_the_trainers_own_file_by_its_name(shm: Path) -> None:
    """After a stop snapshot the trainer's name of its file goes, but only while that name is
    the very file handed over and owned by the trainer's user: a name swapped for another file
    (a link, or another file of anyone's) stays."""
    name = "snapguard-take-9-0123456789abcdef"
    fd = _fd_of(shm, name, 4096)
    spill = _spill.Spill(9, fd, str(shm / name), 4096)
    assert not spill.remove_source(os.getuid() + 1)  # someone else's
    assert not spill.remove_source(None)
    os.rename(shm / name, shm / "moved-away")
    (shm / "other").write_bytes(b"y")
    os.symlink(shm / "other", shm / name)
    assert not spill.remove_source(os.getuid()) and (shm / name).is_symlink()
    os.unlink(shm / name)
    os.rename(shm / "moved-away", shm / name)
    assert spill.remove_source(os.getuid()) and not (shm / name).exists()
    spill.close()


def test_a_file_copy_writes_every_byte_and_refuses_an_existing_name(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files.FileCopy, "CHUNK", 4096)
    data = os.urandom(4096 * 9 + 123)
    src = tmp_path / "src"
    src.write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    dir_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with open(src, "rb") as f:
            copy = files.FileCopy(f.fileno(), dir_fd, "a.bin", len(data))
            copy.start()
            copy.wait()
            copy.close()
            assert copy.seconds is not None
        assert (out / "a.bin").read_bytes() == data and stat.S_IMODE((out / "a.bin").stat().st_mode) == 0o600
        os.symlink(src, out / "b.bin")
        with open(src, "rb") as f, pytest.raises(FileExistsError):
            files.FileCopy(f.fileno(), dir_fd, "b.bin", len(data))  # never written through a link
        assert src.read_bytes() == data
        with open(src, "rb") as f:  # a source shorter than said
            copy = files.FileCopy(f.fileno(), dir_fd, "c.bin", len(data) + 5000)
            copy.start()
            with pytest.raises(OSError, match="short"):
                copy.wait()
            copy.close()
        real_sendfile = os.sendfile

        def stuck(*args):  # type: ignore[no-untyped-def]
            threading.Event().wait(1.0)
            return real_sendfile(*args)

        monkeypatch.setattr(os, "sendfile", stuck)
        with open(src, "rb") as f:  # past its deadline: an error, not a hang
            copy = files.FileCopy(f.fileno(), dir_fd, "e.bin", len(data))
            copy.start()
            with pytest.raises(OSError, match="not written within"):
                copy.wait(0.2)
            copy.close()
        monkeypatch.setattr(os, "sendfile", real_sendfile)
        with open(src, "rb") as f:  # never started
            copy = files.FileCopy(f.fileno(), dir_fd, "d.bin", len(data))
            with pytest.raises(OSError, match="0 of"):
                copy.wait()
            copy.close()
    finally:
        os.close(dir_fd)


def test_a_manifest_names_a_spill_only_as_snapguard_writes_it(tmp_path: Path) -> None:
    def manifest(pid_key: str, file: object, size: object, listed: int | None = 8192) -> dict[str, object]:
        return {"take_point": {pid_key: {"ok": True, "offload": {"spill": {"file": file, "bytes": size}}}},
                "files": {"snapguard-take-5.bin": {"size": listed}} if listed is not None else {}}

    assert _spill.image_spills(manifest("5", "snapguard-take-5.bin", 8192), str(tmp_path)) == \
        {5: ("snapguard-take-5.bin", 8192)}
    assert _spill.image_spills({"take_point": {"5": {"ok": True, "offload": {"state": "moved"}}}}, "x") == {}
    for bad in (manifest("5", "../pages-1.img", 8192), manifest("6", "snapguard-take-5.bin", 8192),
                manifest("5", "snapguard-take-5.bin", 4096), manifest("5", "snapguard-take-5.bin", 8192, None),
                manifest("x", "snapguard-take-5.bin", 8192), manifest("5", ["a"], 8192)):
        with pytest.raises(SnapguardError) as e:
            _spill.image_spills(bad, str(tmp_path))
        assert e.value.failure.reason is Reason.MANIFEST_INVALID

    (tmp_path / "snapguard-take-5.bin").write_bytes(b"z" * 100)
    with pytest.raises(SnapguardError) as e:
        _spill.open_image_spills(str(tmp_path), {5: ("snapguard-take-5.bin", 8192)})
    assert e.value.failure.reason is Reason.IMAGE_CORRUPT
    got = _spill.open_image_spills(str(tmp_path), {5: ("snapguard-take-5.bin", 100)})
    assert os.fstat(got[5].fd).st_size == 100
    got[5].close()
    os.unlink(tmp_path / "snapguard-take-5.bin")
    os.symlink("/etc/hostname", tmp_path / "snapguard-take-5.bin")
    with pytest.raises(SnapguardError) as e:  # never followed
        _spill.open_image_spills(str(tmp_path), {5: ("snapguard-take-5.bin", 100)})
    assert e.value.failure.reason is Reason.IMAGE_CORRUPT


def test_a_request_carries_at_most_its_descriptors_to_the_take_point() -> None:
    """Descriptors sent with anything but a release are closed by the take point, not kept."""

    point = TakePoint()
    r, w = os.pipe()
    reply, handed = answer(point, ["status"], [r])
    assert reply["ok"] and handed is None
    with pytest.raises(OSError):
        os.fstat(r)
    os.close(w)


def test_a_release_counts_only_for_the_hold_under_way() -> None:
    """A release that comes when no hold is under way (its hold ended by itself) gives the take
    point nothing to keep: a later hold would reload older bytes from it. A new take drops one
    that is left."""
    point = TakePoint()
    r, w = os.pipe()
    point.release([r])
    assert point.release_fd is None
    with pytest.raises(OSError):
        os.fstat(r)
    os.close(w)
    point.holding = True
    r, w = os.pipe()
    extra, w2 = os.pipe()
    point.release([r, extra])
    assert point.release_fd == r
    with pytest.raises(OSError):
        os.fstat(extra)
    point.arm(None, 1.0)
    assert point.release_fd is None
    with pytest.raises(OSError):
        os.fstat(r)
    os.close(w)
    os.close(w2)


def test_a_spilled_hold_whose_file_name_is_gone_waits_for_its_release(shm: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Past SNAPGUARD_TAKE_HOLD_S a hold goes on by itself, reloading from its file's name; when
    that name is gone (the executor removed it after a stop snapshot; another node's restore has
    none), the trainer cannot go on without the release's file and waits for it, instead of
    failing: a trainer restored long after its hold began (its wait's deadline long past on the
    clock of the node it is restored on) is released normally."""

    monkeypatch.setattr(env, "HOLD_S", 0.2)
    model, opt = _stepped_trainer(monkeypatch, shm, 32)
    saved = [p.detach().clone() for p in model.parameters()]
    point = TakePoint()
    point.arm(None, 5.0, spill=True)
    trainer = threading.Thread(target=point.at_step_end, args=(opt, (), {}))
    trainer.start()
    assert point.reached.wait(10)
    fd = point.pop_handover()
    assert fd is not None
    path = Path(point.figures["offload"]["spill"]["path"])
    os.unlink(path)  # as after a stop snapshot
    trainer.join(0.8)  # four times its hold limit
    assert trainer.is_alive(), "the hold went on without its bytes"
    point.release([fd])  # the release passes the file (the image's, after a restore)
    trainer.join(10)
    assert not trainer.is_alive()
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), saved))
    assert list(shm.iterdir()) == []


def test_the_executor_never_follows_a_link_on_the_way_to_the_name_it_removes(shm: Path) -> None:
    """The trainer reports the path; a directory on it swapped for a link (here, from the start)
    sends the executor nowhere: the name is removed only through real directories."""
    name = "snapguard-take-9-0123456789abcdef"
    (shm / "real").mkdir()
    fd = _fd_of(shm / "real", name, 4096)
    os.symlink(shm / "real", shm / "link")
    for path in (str(shm / "link" / name), f"real/{name}"):
        assert not _spill.Spill(9, fd, path, 4096).remove_source(os.getuid())
        assert (shm / "real" / name).exists()
    spill = _spill.Spill(9, fd, str(shm / "real" / name), 4096)
    assert spill.remove_source(os.getuid()) and not (shm / "real" / name).exists()
    spill.close()


def test_a_partial_spilled_take_keeps_its_moved_bytes_in_one_run_from_the_start(shm: Path) -> None:
    """Past the deadline a spilled take stops at the first storage it cannot copy in time (no
    hole between moved ones: here the first, so nothing moves and no file stays), and a file
    handed over is cut after the last moved byte: the executor's copy has no hole to write."""
    import time

    small, large = torch.arange(16.0), torch.empty(64 << 20)  # 256 MiB after it, largest first: large, small
    offload = Offload("cpu")
    figures = offload.take(torch, [small, large], deadline=time.monotonic() + 0.25, spill_dir=str(shm))
    assert figures["state"] == "partial" and figures["storages"] == 0 and "spill" not in figures, figures
    assert offload.spill_fd is None and list(shm.iterdir()) == []
    offload.reload(torch)
    # the cut: a spill handed over ends at its last moved byte
    arena = SpillArena(torch, 3 * 4096, str(shm))
    arena.bytes[:4096] = 7
    fd = arena.handover(4096)
    assert fd is not None and os.fstat(fd).st_size == 4096 == arena.size and arena.map is None
    assert os.pread(fd, 4096, 0) == bytes([7]) * 4096
    os.close(fd)
    arena.discard()
    assert list(shm.iterdir()) == []


def test_no_room_for_the_spills_in_the_image_is_found_before_anything_is_frozen(
        shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The image's filesystem must hold every spill: checked when they are handed over (the
    trainers held, nothing frozen yet), typed IMAGE_WRITE_FAILED, no file made, the spill's own
    name left for its trainer."""
    name = "snapguard-take-7-0123456789abcdef"
    spill = _spill.Spill(7, _fd_of(shm, name, 8192), str(shm / name), 8192)
    figures = {7: {"offload": {"spill": {"path": spill.path, "bytes": 8192}}}}
    real = os.fstatvfs

    class Full:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize, self.f_bavail = st.f_frsize, 1

    monkeypatch.setattr(os, "fstatvfs", lambda fd: Full(real(fd)))
    with pytest.raises(SnapguardError) as e:
        _spill.SpillCopies(str(tmp_path), {7: spill}, figures)
    assert e.value.failure.reason is Reason.IMAGE_WRITE_FAILED and "nothing was frozen" in str(e.value)
    assert list(tmp_path.iterdir()) == [] and (shm / name).exists() and "file" not in figures[7]["offload"]["spill"]
    spill.close()


def test_a_spills_name_goes_with_its_trainer_and_stays_while_it_lives(shm: Path, tmp_path: Path) -> None:
    """When a snapshot ends, the executor removes the name of each spill whose trainer is gone; a
    stop snapshot's trainers, which CRIU killed without waiting, are given a moment to go. A
    trainer that lives keeps its name (it removes it at its reload)."""
    for ended in (False, True):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
        name = f"snapguard-take-{child.pid}-0123456789abcdef"
        spill = _spill.Spill(child.pid, _fd_of(shm, name, 8192), str(shm / name), 8192)
        figures = {child.pid: {"offload": {"spill": {"path": spill.path, "bytes": 8192}}}}
        image_dir = tmp_path / f"img-{ended}"
        image_dir.mkdir()
        copies = _spill.SpillCopies(str(image_dir), {child.pid: spill}, figures)
        copies.trainers_ended = ended
        copies.close()
        assert (shm / name).exists() is not ended
        child.wait()
        (shm / name).unlink(missing_ok=True)



def _trainer_child(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_an_executor_that_dies_leaves_its_spills_to_the_next_sweep(shm: Path, tmp_path: Path) -> None:
    """Each spill handed over is recorded until its name is gone. An executor that never closed
    its copies (killed after a stop snapshot's dump) leaves the record: the next sweep keeps it
    while the trainer runs, and once the trainer is gone removes its name and the record. A
    record whose name the trainer already removed (its reload) is dropped, the trainer alive."""
    journal = tmp_path / "spills"
    journal.mkdir(mode=0o700)
    image = tmp_path / "img"
    image.mkdir()
    child = _trainer_child(30)
    try:
        name = f"snapguard-take-{child.pid}-0123456789abcdef"
        spill = _spill.Spill(child.pid, _fd_of(shm, name, 8192), str(shm / name), 8192)
        figures = {child.pid: {"offload": {"spill": {"path": spill.path, "bytes": 8192}}}}
        _spill.SpillCopies(str(image), {child.pid: spill}, figures, str(journal))  # never closed: it "died"
        records = list(journal.iterdir())
        assert len(records) == 1 and records[0].stat().st_mode & 0o777 == 0o600
        assert _spill.sweep(str(journal)) == [] and list(journal.iterdir()) == records
        assert (shm / name).exists()  # the trainer lives: its name stays
        child.kill()
        child.wait()
        assert _spill.sweep(str(journal)) == [str(shm / name)]
        assert not (shm / name).exists() and list(journal.iterdir()) == []
        spill.close()
    finally:
        child.kill()
        child.wait()
    # the trainer reloaded (its name gone) and lives: the record goes, nothing else
    alive = _trainer_child(30)
    try:
        name = f"snapguard-take-{alive.pid}-fedcba9876543210"
        spill = _spill.Spill(alive.pid, _fd_of(shm, name, 4096), str(shm / name), 4096)
        copies = _spill.SpillCopies(str(tmp_path / "img"), {alive.pid: spill},
                                    {alive.pid: {"offload": {"spill": {}}}}, str(journal))
        copies.close()  # the trainer lives: the record stays with its name
        assert len(list(journal.iterdir())) == 1 and (shm / name).exists()
        (shm / name).unlink()
        assert _spill.sweep(str(journal)) == [] and list(journal.iterdir()) == []
    finally:
        alive.kill()
        alive.wait()


def test_a_spill_no_executor_heard_of_goes_once_its_trainer_is_gone(shm: Path, tmp_path: Path) -> None:
    """A trainer killed while it filled its spill leaves a name no journal covers: found by its
    name in the spill directories, removed once its pid is no process, or one that started after
    the file was written (the pid given again) or runs as another user; kept while the trainer
    lives, and while the file is younger than the sweep's age. Nothing but a regular file of
    the take point's name is touched, and no link is followed."""
    gone = _trainer_child(0)
    gone.wait()
    living = _trainer_child(30)
    try:
        time.sleep(0.05)  # the living trainer started before its spill was written
        dead_spill = shm / f"snapguard-take-{gone.pid}-0123456789abcdef"
        live_spill = shm / f"snapguard-take-{living.pid}-0123456789abcdef"
        for f in (dead_spill, live_spill):
            f.write_bytes(b"x" * 4096)
        other = shm / "snapguard-take-1-notaspillname"
        other.write_bytes(b"y")
        target = tmp_path / "outside"
        target.write_bytes(b"z")
        link = shm / f"snapguard-take-{gone.pid}-fedcba9876543210"
        link.symlink_to(target)
        assert _spill.sweep_orphans((str(shm),)) == []  # all younger than the sweep's age
        assert _spill.sweep_orphans((str(shm), str(tmp_path)), min_age_s=0) == [str(dead_spill)]
        assert not dead_spill.exists() and live_spill.exists() and other.exists()
        assert link.is_symlink() and target.exists()
        # a pid given again: files for the next pids written first, then a process takes one of
        # them (pids are handed out in order), having started after its file was written
        last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
        ahead = {pid: shm / f"snapguard-take-{pid}-0123456789abcdef" for pid in range(last + 1, last + 200)}
        for f in ahead.values():
            f.write_bytes(b"x")
        time.sleep(0.05)
        later = _trainer_child(30)
        try:
            for pid, f in ahead.items():
                if pid != later.pid:
                    f.unlink()
            if later.pid in ahead:  # else 200 other processes started meanwhile: nothing to tell
                assert _spill.sweep_orphans((str(shm),), min_age_s=0) == [str(ahead[later.pid])]
        finally:
            later.kill()
            later.wait()
        if os.geteuid() == 0:  # a process of another user under the pid: not the trainer
            other_user = subprocess.Popen(["/bin/sleep", "30"], user=65534)
            try:
                time.sleep(0.05)
                theirs = shm / f"snapguard-take-{other_user.pid}-0123456789abcdef"
                theirs.write_bytes(b"x")
                assert _spill.sweep_orphans((str(shm),), min_age_s=0) == [str(theirs)]
            finally:
                other_user.kill()
                other_user.wait()
        assert live_spill.exists()
    finally:
        living.kill()
        living.wait()


def test_a_sweep_acts_only_on_records_as_snapguard_writes_them(shm: Path, tmp_path: Path) -> None:
    """A record that is not one of the executor's (not JSON, a link, a name or field that does not
    match, a path outside the spills' names, a file of another owner or another inode, a pid
    that now belongs to another process) is dropped, and the file it names is left alone."""
    journal = tmp_path / "spills"
    journal.mkdir(mode=0o700)
    gone = _trainer_child(0)
    gone.wait()
    name = f"snapguard-take-{gone.pid}-0123456789abcdef"
    victim = shm / name
    victim.write_bytes(b"x" * 4096)
    st = victim.stat()
    good = {"pid": gone.pid, "start": 7, "path": str(victim), "dev": st.st_dev, "ino": st.st_ino, "uid": os.getuid()}
    import json

    def record(fields: dict[str, object], file: str | None = None) -> None:
        rec = {**good, **fields}
        (journal / (file or f"{rec['pid']}-{rec['start']}-{rec['ino']}.json")).write_text(json.dumps(rec))

    record({"uid": os.getuid() + 1, "start": 1})  # another owner's file
    record({"ino": st.st_ino + 1})  # another file
    record({"path": str(shm / "not-a-spill"), "start": 3})
    record({"start": 4}, f"{gone.pid}-5-{st.st_ino}.json")  # its name does not match its fields
    record({"extra": 1, "start": 6})
    record({"pid": True}, f"{gone.pid}-12-{st.st_ino}.json")  # not an int
    (journal / f"{gone.pid}-10-{st.st_ino}.json").write_text("{not json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({**good, "start": 11}))
    os.symlink(tmp_path / "elsewhere.json", journal / f"{gone.pid}-11-{st.st_ino}.json")
    (journal / "notes.txt").write_text("not a record: left")
    assert _spill.sweep(str(journal)) == [] and victim.exists()
    assert sorted(p.name for p in journal.iterdir()) == ["notes.txt"]
    # a live process that took the pid over (here: this one, with its own start) is not the trainer
    record({"pid": os.getpid(), "start": 1})
    assert _spill.sweep(str(journal)) == [str(victim)] and not victim.exists()


def _served(point: TakePoint, tmp_path: Path) -> str:
    path = str(tmp_path / "take.sock")
    threading.Thread(target=serve, args=(path, point), daemon=True).start()
    for _ in range(200):
        if os.path.exists(path):
            break
        threading.Event().wait(0.01)
    return path


@pytest.mark.parametrize("move_s", [3.0, 6.0])
def test_a_spill_begun_as_the_wait_ran_out_is_waited_for_or_refuses_the_snapshot(
        shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, move_s: float) -> None:
    """The trainer's hold begins within the executor's wait, but its spilled move (slowed here to
    `move_s`) outlasts it: the take's answer is a timeout while the trainer still has its spill's
    file. The executor asks its status until the move and the reload are over, and only then lets
    the snapshot go on without the hold (TAKE_POINT_TIMEOUT); when that takes longer than the wait
    again, it refuses the snapshot before anything is frozen. Either way the trainer's state comes
    back exact and no spill is left behind."""

    model, opt = _stepped_trainer(monkeypatch, shm, 64)
    saved = [p.detach().clone() for p in model.parameters()]
    real_take = Offload.take
    point = TakePoint()
    busy_while_moving = threading.Event()

    def slow_take(self: Offload, *args: object, **kwargs: object) -> object:
        figures = real_take(self, *args, **kwargs)  # type: ignore[arg-type]
        if point.spill_busy and "spill" in figures:
            busy_while_moving.set()
        threading.Event().wait(move_s)
        return figures

    monkeypatch.setattr(Offload, "take", slow_take)
    path = _served(point, tmp_path)
    wait_s = 2.0

    def trainer() -> None:
        while point.hold_at is None:
            threading.Event().wait(0.01)
        point.at_step_end(opt, (), {})  # the hold begins at once, well within the wait

    t = threading.Thread(target=trainer)
    t.start()
    spills: dict[int, _spill.Spill] = {}
    try:
        if move_s < 2 * wait_s:  # over within the executor's second wait
            figures, warning = take._hold_one(path, os.getpid(), wait_s, True, None, spills)
            assert figures is None and warning is not None and warning.reason is Reason.TAKE_POINT_TIMEOUT
            assert take._ask(path, os.getpid(), "status\n", 5)["spill_busy"] is False  # done: a dump now needs no file
        else:
            with pytest.raises(SnapguardError) as e:
                take._hold_one(path, os.getpid(), wait_s, True, None, spills)
            assert e.value.failure.reason is Reason.PREFLIGHT_FAILED and "nothing was frozen" in str(e.value)
    finally:
        t.join(15)
    assert busy_while_moving.is_set(), "the trainer never spilled: the test tested nothing"
    assert not t.is_alive() and spills == {}
    assert all(torch.equal(a, b.detach()) for a, b in zip(saved, model.parameters()))
    assert list(shm.iterdir()) == []


def test_a_hold_begun_after_the_executor_stopped_waiting_moves_nothing(shm: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's wait ran out (disarm) between the step's end and the hold's move: the
    snapshot goes on without the hold, so nothing is moved (a second copy of it in the image, or
    a spill's file outside it) and no spill is made."""
    model, opt = _stepped_trainer(monkeypatch, shm, 64)
    point = TakePoint()
    point.arm(None, 5.0, spill=True)
    point.disarm()
    point._hold(opt)
    assert "offload" not in point.figures and point.spill_busy is False
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert list(shm.iterdir()) == []


def test_root_looks_up_a_trainers_spill_path_only_through_a_tmpfs(tmp_path: Path) -> None:
    """The trainer names its spill's path; root walks it (to remove the name) only where
    mountinfo says the directory is on a tmpfs reached through no file system whose lookups can
    wait on a daemon or a server (a FUSE mount, NFS, an automounter): a path anywhere else, or not
    canonical, is neither taken with a take's answer nor looked up."""
    root = with_mountinfo(
        tmp_path,
        "1 0 8:1 / / rw - ext4 /dev/vda rw",
        "2 1 0:5 / /dev/shm rw - tmpfs tmpfs rw",
        "3 2 0:6 / /dev/shm/fuse rw - fuse.sshfs host: rw,user_id=1000",
        "4 3 0:7 / /dev/shm/fuse/t rw - tmpfs  rw",  # a tmpfs under it, its source empty
        "5 1 0:8 / /home rw - nfs4 server:/home rw")
    from snapguard import procfs

    with procfs.using_procfs(str(root)):
        assert procfs.mounts_on_path("/dev/shm/fuse/t")[-1]["fstype"] == "tmpfs"  # type: ignore[index]
        assert _spill.in_tmpfs_dir("/dev/shm/snapguard-take-9-0123456789abcdef")
        for path in ("/dev/shm/fuse/t/snapguard-take-9-0123456789abcdef",  # through FUSE
                     "/home/u/snapguard-take-9-0123456789abcdef", "/snapguard-take-9-0123456789abcdef",
                     "/dev/shm/../shm/snapguard-take-9-0123456789abcdef", "dev/shm/snapguard-take-9-0123456789abcdef"):
            assert not _spill.in_tmpfs_dir(path), path
            assert not _spill.remove_spill_name(path, 1, 2, 0, dry_run=True)
    disk = Path(tempfile.mkdtemp(prefix="snapguard-test-", dir="/var/tmp"))
    try:
        fd = os.open(disk, os.O_RDONLY)
        on_tmpfs = protocol.fs_type(fd) == protocol.TMPFS_MAGIC
        os.close(fd)
        if not on_tmpfs:  # a real disk file of the right name, owner and inode: left alone
            victim = disk / "snapguard-take-9-0123456789abcdef"
            victim.write_bytes(b"x")
            st = victim.stat()
            assert not _spill.remove_spill_name(str(victim), st.st_dev, st.st_ino, st.st_uid)
            assert victim.exists()
    finally:
        shutil.rmtree(disk, ignore_errors=True)


def test_spill_dirs_are_the_hosts_own_or_a_containers_bind_of_a_host_tmpfs(tmp_path: Path, shm: Path) -> None:
    """Which trainers the executor asks to spill, and where their files are from here: a trainer
    in the executor's mount namespace spills where it says (a hook older than `spill_dir`: its
    answer's own path is checked instead); a container's only into a directory that is the mount
    point of a bind of a host tmpfs (runc makes it external to CRIU), named here under the host's
    mount of that tmpfs, and only where the directory it sees through its root is that very one.
    A container's own /dev/shm (CRIU dumps it), a mapping to another directory than the one the
    container sees, a directory reached through a link, a trainer that offers no spill or names
    its directory unnormalised, and, for a bare snapshot, any trainer in another mount namespace
    get none. The processes are a fake procfs's; the directories are real (a tmpfs's)."""
    from snapguard import procfs

    spill_dev = "0:31"
    rel = "/" + shm.name  # shm's path below /dev/shm, the tmpfs's root
    other = Path(tempfile.mkdtemp(prefix="snapguard-test-", dir="/dev/shm"))
    (shm / "link").symlink_to(other)
    try:
        root = with_mountinfo(
            tmp_path,
            "1 0 8:1 / / rw - ext4 /dev/vda rw",
            f"2 1 {spill_dev} / /dev/shm rw - tmpfs shm rw")
        (root / "self" / "ns").mkdir()
        (root / "self" / "ns" / "mnt").symlink_to("mnt:[1]")
        for pid, ns in ((10, 1), (11, 1), (12, 1), (20, 2), (21, 3), (22, 4), (23, 1), (24, 1)):
            (root / str(pid) / "ns").mkdir(parents=True)
            (root / str(pid) / "ns" / "mnt").symlink_to(f"mnt:[{ns}]")
            (root / str(pid) / "root").symlink_to("/")  # a container whose files are the host's own
        # 20: the host tmpfs's directory bound at the same path; 22: bound at that path, but from
        # another directory than the one its root shows there; 21: its own tmpfs only
        (root / "20" / "mountinfo").write_text(f"101 100 {spill_dev} {rel} {shm} rw - tmpfs shm rw\n")
        (root / "22" / "mountinfo").write_text(f"101 100 {spill_dev} /{other.name} {shm} rw - tmpfs shm rw\n")
        (root / "21" / "mountinfo").write_text(f"102 100 0:41 / {shm} rw - tmpfs shm rw\n")
        found = {10: {"spill": True, "spill_dir": str(shm)},
                 11: {"spill": True},  # an older hook
                 12: {"spill": True, "spill_dir": str(shm / "link")},
                 20: {"spill": True, "spill_dir": str(shm)},
                 21: {"spill": True, "spill_dir": str(shm)},
                 22: {"spill": True, "spill_dir": str(shm)},
                 23: {"spill": False, "spill_dir": str(shm)},
                 24: {"spill": True, "spill_dir": str(shm) + "/"}}
        with procfs.using_procfs(str(root)):
            assert _spill.spill_dirs(found, containers=True) == {10: (str(shm), str(shm)), 11: None,
                                                               20: (str(shm), str(shm))}
            assert _spill.spill_dirs(found, containers=False) == {10: (str(shm), str(shm)), 11: None}
            # the source of the bind removed: the kernel's "//deleted" root maps to nothing
            (root / "20" / "mountinfo").write_text(f"101 100 {spill_dev} {rel}//deleted {shm} rw - tmpfs shm rw\n")
            assert 20 not in _spill.spill_dirs(found, containers=True)
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_a_restored_containers_spills_go_to_their_trainers_by_the_pid_each_sees() -> None:
    """After a container's restore its trainers have new host pids: each spill goes to the process
    that has, in its namespace, the pid the manifest recorded for its trainer at the dump
    (`processes[].nspid`). A trainer not found in the restored tree, or two spills landing on one
    process, refuse the release (CRIU_RESTORE_FAILED) rather than give one trainer another's
    bytes. Real processes (in this namespace a process's pid is the one it sees)."""
    from snapguard.pipeline.restore import _by_restored_pid as _by_recorded

    def _by_restored_pid(wanted: dict, manifest: dict, root_pid: int) -> dict:  # the processes as the manifest reads them
        return _by_recorded(wanted, {p["pid"]: p.get("nspid", p["pid"]) for p in manifest["processes"]}, root_pid)

    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2)]
    try:
        a, b = (k.pid for k in kids)
        manifest = {"processes": [{"pid": 100, "nspid": a}, {"pid": 200, "nspid": b}, {"pid": 300}]}
        spills = {100: ("snapguard-take-100.bin", 1), 200: ("snapguard-take-200.bin", 2)}
        assert _by_restored_pid(spills, manifest, os.getpid()) == {a: spills[100], b: spills[200]}
        # the old pid of one is the new pid of the other: no spill is kept by an old key
        crossed = {"processes": [{"pid": b, "nspid": a}, {"pid": a, "nspid": b}]}
        assert _by_restored_pid({b: ("x", 1), a: ("y", 2)}, crossed, os.getpid()) == {a: ("x", 1), b: ("y", 2)}
        for manifest, wanted in (
                ({"processes": [{"pid": 100, "nspid": 999999999}]}, {100: ("x", 1)}),  # not restored
                ({"processes": [{"pid": 300}]}, {100: ("x", 1)}),  # no record of it
                ({"processes": [{"pid": 100, "nspid": a}, {"pid": 200, "nspid": a}]},
                 {100: ("x", 1), 200: ("y", 2)})):  # two onto one
            with pytest.raises(SnapguardError) as e:
                _by_restored_pid(wanted, manifest, os.getpid())
            assert e.value.failure.reason is Reason.CRIU_RESTORE_FAILED
    finally:
        for k in kids:
            k.kill()
            k.wait()
