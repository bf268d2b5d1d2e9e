"""A spill the executor writes into the image is bound by what the take reported and by what the
file holds: a trainer reporting 4 KiB moved that hands over a 256 MiB sparse file (claiming
enough storages to pass the page-per-storage bound) is refused, and a copy whose source grows
past the bytes it held when handed over stops. Real files on /dev/shm (a tmpfs)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from snapguard import files
from snapguard.takepoint import spill as _spill


def test_a_sparse_spill_larger_than_the_take_moved_is_refused() -> None:
    shm = Path(tempfile.mkdtemp(prefix="snapguard-test-", dir="/dev/shm"))
    try:
        name = f"snapguard-take-{os.getpid()}-0123456789abcdef"
        size = 256 << 20
        with open(shm / name, "wb") as f:
            f.write(b"x" * 4096)
            f.truncate(size)
        fd = os.open(shm / name, os.O_RDONLY)
        reply = {"ok": True, "offload": {"bytes": 4096, "storages": size // 4096,
                                         "spill": {"path": str(shm / name), "bytes": size}}}
        with pytest.raises(ValueError, match="more than the take moved"):
            _spill.Spill.received(os.getpid(), reply, [fd])
        with pytest.raises(OSError):
            os.fstat(fd)  # closed with the refusal
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_copy_stops_once_its_source_holds_more_than_it_did(tmp_path: Path) -> None:
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.write(b"y" * 4096)
        f.truncate(1 << 20)
    out = tmp_path / "out"
    out.mkdir()
    dir_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with open(src, "r+b") as f:
            held = os.fstat(f.fileno()).st_blocks * 512
            f.seek(0)
            f.write(b"z" * (1 << 20))  # filled after it was handed over
            f.flush()
            os.fsync(f.fileno())
            copy = files.FileCopy(f.fileno(), dir_fd, "a.bin", 1 << 20, max_allocated=held)
            copy.start()
            with pytest.raises(OSError, match="grew"):
                copy.wait(10)
            copy.close()
    finally:
        os.close(dir_fd)
