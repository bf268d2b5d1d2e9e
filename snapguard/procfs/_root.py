"""The one procfs root every read of /proc goes through, and the read helpers the modules share.

The root is `procfs_path()` ("/proc" unless a test or a container-aware caller sets another with
`set_procfs_path` or `using_procfs`, as psutil's PROCFS_PATH); functions also take `proc=` for
fixture trees. A read that loses its process (it exited meanwhile) yields the caller's default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["procfs_path", "read", "root", "set_procfs_path", "using_procfs", "vanishing"]

_procfs = "/proc"

T = TypeVar("T")


def procfs_path() -> str:
    """The procfs root every read goes through."""
    return _procfs


def set_procfs_path(path: str) -> None:
    global _procfs
    _procfs = path


@contextmanager
def using_procfs(path: str) -> Iterator[str]:
    """Read another procfs root (a fixture tree) for the duration of the block."""
    old = _procfs
    set_procfs_path(path)
    try:
        yield path
    finally:
        set_procfs_path(old)


def root(proc: str | None) -> str:
    """`proc` when given, else the procfs root."""
    return proc or _procfs


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def vanishing(fn: Callable[[], T], default: T) -> T:
    """Run a procfs read; a process or fd that went away meanwhile (or that we may not read)
    yields `default`."""
    try:
        return fn()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
        return default
    except OSError as e:
        if e.errno in (3, 2):  # ESRCH, ENOENT from some procfs files of an exiting task
            return default
        raise
