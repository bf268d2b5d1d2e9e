"""mmap, munmap and madvise through ctypes, bound once, before any fork (a forked child only calls
them), for the fork handler and the spill's arena."""

from __future__ import annotations

__all__ = ["Libc", "MAP_ANONYMOUS", "MAP_FIXED", "MAP_NORESERVE", "MAP_PRIVATE", "PROT_NONE", "bound_libc"]

# Linux's values (x86_64 and aarch64 alike)
PROT_NONE, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x0, 0x02, 0x10, 0x20, 0x4000


class Libc:
    """mmap, munmap and madvise through ctypes, bound in the parent so the child only calls them."""

    def __init__(self) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise = libc.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.failed = ctypes.c_void_p(-1).value


_libc: Libc | None = None


def bound_libc() -> Libc:
    """The libc calls, bound once (before a fork: the child only calls them)."""
    global _libc
    if _libc is None:
        _libc = Libc()
    return _libc

