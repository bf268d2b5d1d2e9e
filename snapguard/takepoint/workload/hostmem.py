"""The trainer's host memory as the hold sees it: its resident anonymous bytes, the room it may
still take (the kernel's and its cgroup's), and the C heap's free pages given back."""

from __future__ import annotations

import os

__all__ = ["host_anon_bytes", "host_room", "malloc_trim"]


def host_anon_bytes() -> int:
    """Resident anonymous memory (RssAnon) of this process, 0 where procfs does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def malloc_trim() -> None:
    """glibc's malloc_trim(0): return free heap pages to the kernel. Nothing elsewhere (musl)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def host_room(proc_self: str = "/proc/self", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Bytes of memory this process may still take: the kernel's MemAvailable, and below it what
    its cgroup (v2) leaves under memory.max; 0 when the kernel does not say."""
    room = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return 0
    try:
        with open(f"{proc_self}/cgroup") as f:
            path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        if path is not None:
            base = os.path.join(cgroup_root, path.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(base, "memory.current")) as f:
                    room = min(room, max(0, int(limit) - int(f.read().strip())))
    except (OSError, ValueError):
        pass  # no cgroup v2 here, or no memory controller: the kernel's figure alone
    return room
