"""The take point's spill on tmpfs mounts of its own (mount(2), so root): a huge=within_size tmpfs
as a node mounts its spill tmpfs, and one mounted huge=advise, give the spill huge pages; a trainer
spills where it is told, else on the node's spill tmpfs, else /dev/shm. The rest of the spill is in
tests/unit/test_take_spill.py, whose /dev/shm fixture these share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from snapguard.takepoint import protocol  # noqa: E402
from snapguard.takepoint.workload import env  # noqa: E402
from snapguard.takepoint.workload.offload import Offload  # noqa: E402
from tests.unit.test_take_spill import shm  # noqa: E402

pytestmark = pytest.mark.root

__all__ = ["shm"]  # the shared fixture


@contextmanager
def _tmpfs(target: Path, huge: str) -> Iterator[Path]:
    """A tmpfs mounted on `target` with huge=`huge`, mode 1777, as a node mounts its spill tmpfs."""
    import ctypes

    if not os.path.isdir("/sys/kernel/mm/transparent_hugepage"):
        pytest.skip("this kernel has no transparent huge pages: a tmpfs cannot be mounted huge=")
    target.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"snapguard-test", str(target).encode(), b"tmpfs", 0,
                  f"size=512m,huge={huge},mode=1777".encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount tmpfs on {target}")
    try:
        yield target
    finally:
        libc.umount2(str(target).encode(), 2)  # MNT_DETACH


@pytest.fixture
def huge_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mounted as a node mounts protocol.SPILL_TMPFS: huge=within_size."""
    with _tmpfs(tmp_path / "spill-tmpfs", "within_size") as target:
        yield target


def _shmem_huge_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no ShmemHugePages in /proc/meminfo")


def test_a_spill_on_a_huge_page_tmpfs_gets_huge_pages_and_on_dev_shm_none(huge_tmpfs: Path, shm: Path,
                                                                          tmp_path: Path) -> None:
    """A tmpfs mounted huge=within_size (the node's protocol.SPILL_TMPFS) gives the spill huge
    pages, 2 MiB a fault instead of 4 KiB (bench/spill_fill.py measures the fill); one mounted
    huge=advise gives them because the spill's mapping asks; /dev/shm as distributions mount it
    (no huge=) gives none, unless the node's shmem_enabled is "force". The bytes come back exact
    each time."""
    forced = "[force]" in Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    with _tmpfs(tmp_path / "advise", "advise") as advise:
        _huge_pages_or_none([(huge_tmpfs, True), (advise, True), (shm, forced)])


def _huge_pages_or_none(where: list[tuple[Path, bool]]) -> None:
    for directory, huge in where:
        torch.manual_seed(5)
        tensors = [torch.randn(8 << 20), torch.randn(4 << 20)]  # 48 MiB
        before = [t.clone() for t in tensors]
        offload = Offload("cpu")
        shmem_huge = _shmem_huge_bytes()
        figures = offload.take(torch, tensors, spill_dir=str(directory))
        assert figures["state"] == "moved" and Path(figures["spill"]["path"]).parent == directory, figures
        grown = _shmem_huge_bytes() - shmem_huge
        if huge:
            assert grown >= 40 << 20, f"{grown} bytes of huge pages for a 48 MiB spill"
        else:
            assert grown == 0, f"{grown} bytes of huge pages on a tmpfs mounted without huge="
        fd = offload.spill_fd
        assert fd is not None
        offload.reload(torch, source_fd=fd)
        os.close(fd)
        assert all(torch.equal(a, b) for a, b in zip(tensors, before))
        assert list(directory.iterdir()) == []


def test_a_trainer_spills_where_it_is_told_else_on_the_nodes_spill_tmpfs_else_dev_shm(
        huge_tmpfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SNAPGUARD_TAKE_SPILL_DIR first; else protocol.SPILL_TMPFS when a tmpfs is mounted there (not
    when it is missing, a directory on a disk or a directory of a tmpfs mounted above it); else
    /dev/shm. `snapguard preflight --node` reports the
    same choice, and whether its tmpfs gives huge pages."""
    from snapguard.preflight import host

    monkeypatch.delenv("SNAPGUARD_TAKE_SPILL_DIR", raising=False)
    monkeypatch.delenv("SNAPGUARD_TAKE_SPILL", raising=False)
    plain = huge_tmpfs / "plain"  # a directory of a tmpfs, as one left on /run by a mount that failed
    plain.mkdir(mode=0o1777)
    for where, expected in ((str(huge_tmpfs), str(huge_tmpfs)), (str(tmp_path), "/dev/shm"),
                            (str(tmp_path / "missing"), "/dev/shm"), (str(plain), "/dev/shm")):
        monkeypatch.setattr(protocol, "SPILL_TMPFS", where)
        monkeypatch.setattr(host, "SPILL_TMPFS", where)
        assert env.spill_dir() == expected
        fact = host.spill_tmpfs()
        assert fact["dir"] == expected and fact["huge_pages"] is (expected == str(huge_tmpfs)), fact
        assert ("hint" in fact) is not fact["huge_pages"]
    monkeypatch.setenv("SNAPGUARD_TAKE_SPILL_DIR", str(tmp_path))
    assert env.spill_dir() == str(tmp_path)
    monkeypatch.setenv("SNAPGUARD_TAKE_SPILL", "0")
    assert env.spill_dir() is None
