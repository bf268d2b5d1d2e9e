"""The fork handler: a child forked from a process with a CUDA context cannot use CUDA, yet
inherits the parent's /dev/nvidia* descriptors and mappings, which keep CRIU from dumping it.
Right after the fork, in the child, each such descriptor is pointed at /dev/null (its number stays
taken) and each such mapping becomes an inaccessible anonymous reservation (`drop_inherited`)."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from ..protocol import NVIDIA_DEV
from .libc import MAP_ANONYMOUS, MAP_FIXED, MAP_NORESERVE, MAP_PRIVATE, PROT_NONE, bound_libc

__all__ = ["ForkHandler", "drop_inherited", "install", "installed"]

def drop_inherited(pattern: re.Pattern[str], proc_self: str = "/proc/self") -> dict[str, list[Any]]:
    """Drop this process's handles on the paths `pattern` matches (protocol.NVIDIA_DEV in a trainer's
    forked child): each descriptor whose target matches now refers to /dev/null, with the same
    number (close-on-exec); each mapping of such a path is replaced in place by an anonymous
    PROT_NONE reservation. Returns {"fds": [numbers], "maps": [[start, end, path], ...]}."""
    libc = bound_libc()
    fds: list[int] = []
    null = -1
    try:
        for name in os.listdir(f"{proc_self}/fd"):
            try:
                target = os.readlink(f"{proc_self}/fd/{name}")
            except OSError:
                continue  # the listing's own descriptor, gone by now
            if name.isdigit() and pattern.match(target):
                if null < 0:
                    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
                os.dup2(null, int(name), inheritable=False)
                fds.append(int(name))
    finally:
        if null >= 0:
            os.close(null)
    # the whole list first: the mappings change under the reader of /proc/self/maps otherwise
    with open(f"{proc_self}/maps") as f:
        lines = f.read().splitlines()
    maps: list[list[Any]] = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and pattern.match(parts[5].strip()):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            maps.append([lo, hi, parts[5].strip()])
    for lo, hi, _ in maps:
        got = libc.mmap(lo, hi - lo, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0)
        if got is None or got == libc.failed:
            libc.munmap(lo, hi - lo)  # cannot reserve it: at least it no longer maps the device
    return {"fds": fds, "maps": maps}

class ForkHandler:
    """os.register_at_fork: `before` notes whether the parent has a CUDA context; in the child,
    the inherited GPU handles are dropped when it did (PyTorch's CUDA initialised, or any inherited
    /dev/nvidia-uvm descriptor: only a CUDA context opens it, NVML does not). A child of a process
    that only used NVML keeps its handles: it may still use CUDA itself."""

    def __init__(self) -> None:
        self.pattern: re.Pattern[str] | None = None
        self.parent_cuda = False
        self.dropped: dict[str, list[Any]] | None = None  # in a child: what it dropped

    def before(self) -> None:
        try:
            if self.pattern is None:
                self.pattern = NVIDIA_DEV  # the pattern the preflight matches with
            bound_libc()
            cuda = sys.modules.get("torch.cuda")
            self.parent_cuda = bool(cuda is not None and cuda.is_initialized())
        except Exception:  # never in the way of a fork
            self.parent_cuda = False

    def _uvm_inherited(self) -> bool:
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}").startswith("/dev/nvidia-uvm"):
                    return True
            except OSError:
                continue
        return False

    def after_in_child(self) -> None:
        try:
            if self.pattern is not None and (self.parent_cuda or self._uvm_inherited()):
                self.dropped = drop_inherited(self.pattern)
        except Exception as e:  # the preflight still names a child that kept them
            print(f"snapguard take point: GPU handles not dropped in forked child {os.getpid()}: {e}",
                  file=sys.stderr)

_fork_handler: ForkHandler | None = None

def install() -> ForkHandler:
    global _fork_handler
    if _fork_handler is None:
        _fork_handler = ForkHandler()
        os.register_at_fork(before=_fork_handler.before, after_in_child=_fork_handler.after_in_child)
    return _fork_handler

def installed() -> bool:
    """Whether the fork handler is registered in this process."""
    return _fork_handler is not None
