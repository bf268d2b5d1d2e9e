"""A wait that ends when a file lands in one directory (inotify), so that the agent reads a notice
`snapguard notice` posted at once rather than at its next poll (`--interval`, 5 s by default).

The watch is on the directory itself (IN_ONLYDIR, IN_DONT_FOLLOW: a link in its place is not
followed) for a file renamed into it or closed after writing (IN_MOVED_TO, IN_CLOSE_WRITE); the
events only wake the waiter, which then reads the directory as it always did. Where inotify cannot
be had (no such call, the per-user limit reached, the directory gone), `wait` sleeps out its
timeout as the poll's interval did: a hint, never a new way to fail.
"""

from __future__ import annotations

import ctypes
import os
import select
import threading
import time

__all__ = ["DirWatch"]

_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_IN_CLOSE_WRITE, _IN_MOVED_TO = 0x00000008, 0x00000080
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_IGNORED = 0x00000400, 0x00000800, 0x00008000
_IN_ONLYDIR, _IN_DONT_FOLLOW = 0x01000000, 0x02000000
_SLICE_S = 0.25  # how soon a wait sees its stop event


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):
        return None


class DirWatch:
    """inotify on `path`, made by `arm()` (before the directory is read, so nothing written between
    the read and the wait is missed) and ended by `close()`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()

    @property
    def armed(self) -> bool:
        return self._fd is not None

    def arm(self) -> bool:
        """The watch, made if it is not there yet; False where inotify cannot be had."""
        with self._lock:
            if self._fd is not None:
                return True
            libc = _libc()
            if libc is None:
                return False
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if fd < 0:
                return False
            mask = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR | _IN_DONT_FOLLOW
            if libc.inotify_add_watch(fd, os.fsencode(self.path), mask) < 0:
                os.close(fd)
                return False
            self._fd = fd
            return True

    def _drain(self, fd: int) -> bool:
        """Reads the queued events; False when the directory itself went (the watch is then closed,
        and made again by the next arm())."""
        gone = False
        while True:
            try:
                buf = os.read(fd, 64 * 1024)
            except BlockingIOError:
                break
            except OSError:
                gone = True
                break
            if not buf:
                break
            off = 0
            while off + 16 <= len(buf):  # struct inotify_event: wd, mask, cookie, len, name[len]
                mask = int.from_bytes(buf[off + 4:off + 8], "little")
                size = int.from_bytes(buf[off + 12:off + 16], "little")
                gone = gone or bool(mask & (_IN_DELETE_SELF | _IN_MOVE_SELF | _IN_IGNORED))
                off += 16 + size
        if gone:
            self.close()
        return not gone

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """Until something lands in the directory (True), `timeout` seconds pass or `stop` is set
        (False). Unarmed, it sleeps out the timeout (or until `stop`)."""
        end = time.monotonic() + max(0.0, timeout)
        while not stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            fd = self._fd
            if fd is None:
                stop.wait(left)
                return False
            try:
                ready, _, _ = select.select([fd], [], [], min(left, _SLICE_S))
            except (OSError, ValueError):  # closed meanwhile
                stop.wait(left)
                return False
            if ready:
                return self._drain(fd)
        return False

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
