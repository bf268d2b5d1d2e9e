"""Whole-node scan of /proc/*/maps and /proc/*/fd for device handles and special files.

The C helper (snapguard._procscan, built by cffi at install time) does the reading; this module
holds the policy (which prefixes and device majors matter) and a pure-Python scanner with the same
semantics, used where the helper was not built and compared with it in the tests.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from typing import Literal

from .. import procfs

__all__ = ["Match", "NVIDIA_MAJOR", "all_pids", "have_c_helper", "scan", "scan_c", "scan_python"]

NVIDIA_MAJOR = 195  # /dev/nvidia0.., nvidiactl; nvidia-uvm has a dynamic major, matched by path
GPU_AND_RDMA_PREFIXES = ("/dev/nvidia", "/dev/infiniband/", "/dev/gdrdrv", "anon_inode:[io_uring]")

# addr perms offset dev inode, then the path: the same five fields the C helper skips
_MAPS_PATH = re.compile(rb"^\S+ +\S+ +\S+ +\S+ +\S+ +(.+)$", re.M)

try:
    from .. import _procscan  # type: ignore[attr-defined]
except ImportError:
    _procscan = None


@dataclass(frozen=True, order=True)
class Match:
    pid: int
    kind: str  # "m" for a mapping, "f<N>" for file descriptor N
    major: int
    minor: int
    path: str

    @property
    def is_fd(self) -> bool:
        return self.kind.startswith("f")


def have_c_helper() -> bool:
    return _procscan is not None


def all_pids(proc: str | None = None) -> list[int]:
    return [int(name) for name in os.listdir(proc or procfs.procfs_path()) if name.isdigit()]


def _parse(text: str) -> list[Match]:
    out = []
    for line in text.splitlines():
        pid, kind, dev, path = line.split(" ", 3)
        major, minor = dev.split(":")
        out.append(Match(int(pid), kind, int(major), int(minor), path))
    return out


def scan_c(pids: list[int], prefixes: tuple[str, ...], majors: tuple[int, ...] = (), proc: str | None = None,
           threads: int | None = None) -> list[Match]:
    """The C helper; `threads` defaults to one per CPU this process may run on, at most 16."""
    if _procscan is None:
        raise RuntimeError("the C helper snapguard._procscan was not built")
    ffi, lib = _procscan.ffi, _procscan.lib
    proc = proc or procfs.procfs_path()
    if threads is None:
        threads = min(16, len(os.sched_getaffinity(0)))
    c_pids = ffi.new("int[]", pids)
    keep = [ffi.new("char[]", p.encode()) for p in prefixes]
    c_prefixes = ffi.new("char *[]", keep)
    c_majors = ffi.new("unsigned[]", list(majors))
    size = 1 << 20
    while True:
        buf = ffi.new("char[]", size)
        n = lib.sg_scan(proc.encode(), c_pids, len(pids), c_prefixes, len(prefixes), c_majors, len(majors),
                        threads, buf, size)
        if n >= 0:
            return _parse(ffi.string(buf, n).decode(errors="surrogateescape")) if n else []
        if ffi.errno != errno.ENOSPC:
            raise OSError(ffi.errno, os.strerror(ffi.errno))
        size *= 4


def _rdev(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return os.major(st.st_rdev), os.minor(st.st_rdev)
    return None


def _scan_maps(pid: int, prefixes: tuple[str, ...], majors: tuple[int, ...], proc: str) -> list[Match]:
    try:
        with open(f"{proc}/{pid}/maps", "rb") as f:
            data = f.read()
    except OSError:
        return []
    out = []
    for m in _MAPS_PATH.finditer(data):
        path = m.group(1).decode(errors="surrogateescape")
        dev = _rdev(path) if path.startswith("/dev/") else None
        if path.startswith(prefixes) or (dev and dev[0] in majors):
            out.append(Match(pid, "m", *(dev or (0, 0)), path))
    return out


def _scan_fds(pid: int, prefixes: tuple[str, ...], majors: tuple[int, ...], proc: str) -> list[Match]:
    fd_dir = f"{proc}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return []
    out = []
    for name in names:
        link = f"{fd_dir}/{name}"
        try:
            target = os.readlink(link)
        except OSError:
            continue
        matched = target.startswith(prefixes)
        dev = _rdev(link) if target.startswith("/") and (matched or majors) else None
        if matched or (dev and dev[0] in majors):
            out.append(Match(pid, f"f{name}", *(dev or (0, 0)), target))
    return out


def scan_python(pids: list[int], prefixes: tuple[str, ...], majors: tuple[int, ...] = (),
                proc: str | None = None) -> list[Match]:
    proc = proc or procfs.procfs_path()
    out: list[Match] = []
    for pid in pids:
        out += _scan_maps(pid, prefixes, majors, proc)
        out += _scan_fds(pid, prefixes, majors, proc)
    return out


def scan(pids: list[int] | None = None, prefixes: tuple[str, ...] = GPU_AND_RDMA_PREFIXES,
         majors: tuple[int, ...] = (NVIDIA_MAJOR,), proc: str | None = None,
         impl: Literal["auto", "c", "python"] = "auto") -> list[Match]:
    """Every mapping and fd in `pids` (default: every process) whose path starts with one of
    `prefixes` or that is a device node with one of `majors`."""
    pids = all_pids(proc) if pids is None else pids
    use_c = impl == "c" or (impl == "auto" and _procscan is not None)
    return (scan_c if use_c else scan_python)(pids, prefixes, majors, proc)
