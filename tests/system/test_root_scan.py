"""The C helper and the pure-Python scanner on a planted process holding a device node (mknod,
so root) and an io_uring: both find them alike. The rest is in tests/unit/test_scan.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from snapguard.preflight import scan
from snapguard_lab.planted import DEVICE_MAP, IO_URING, planted

pytestmark = pytest.mark.root


@pytest.fixture
def planted_device(tmp_path: Path) -> Path:
    """A char device node of /dev/zero's numbers (1:5) under a path no real device has."""
    node = tmp_path / "planted-gpu0"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    return node


def test_planted_device_found_by_path_and_major(planted_device: Path) -> None:
    mapped = planted_device.with_name("planted-gpumem")
    with planted(DEVICE_MAP, str(planted_device), str(mapped)) as pid:
        for impl in ("c", "python"):
            by_path = scan.scan([pid], prefixes=(str(planted_device.parent / "planted-"),), majors=(), impl=impl)
            # Device numbers of mappings are read only under /dev/; an fd's always come from its stat.
            assert {(m.kind[0], m.path, m.major, m.minor) for m in by_path} == {
                ("m", str(mapped), 0, 0), ("f", str(planted_device), 1, 5), ("f", str(mapped), 0, 0)}, impl
            by_major = scan.scan([pid], prefixes=(), majors=(1,), impl=impl)
            assert ("f", str(planted_device)) in {(m.kind[0], m.path) for m in by_major}, impl


def test_io_uring_found(planted_device: Path) -> None:
    with planted(IO_URING) as pid:
        found = scan.scan([pid], impl="c")
        assert any(m.path == "anon_inode:[io_uring]" and m.is_fd for m in found)
        assert sorted(found) == sorted(scan.scan([pid], impl="python"))
