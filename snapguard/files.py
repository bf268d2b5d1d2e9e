"""Writing files that hold process memory or its description: private to root, atomic."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from .trust import make_private_dir, resolve_trusted

__all__ = ["TMPFS_MAGIC", "FileCopy", "ensure_private_dir", "fs_type", "spill_tmpfs_usable", "write_private_bytes", "write_private_json"]

TMPFS_MAGIC = 0x01021994  # statfs(2)'s f_type of a tmpfs (and of a memfd's internal mount)


def ensure_private_dir(path: str) -> str:
    """Create `path` (and missing parents) 0700, or check and tighten an existing directory to
    0700; returns its canonical path. snapguard.trust.make_private_dir: the existing part of the
    path must be root's alone (whoever controls a directory on the way could swap what snapguard
    writes there), whatever the umask. Raises trust.UntrustedPathError (not an OSError).

    A relative path (`--images imgs`) is taken from the current directory as the kernel knows
    it (getcwd is canonical), so that the walk still sees every component."""
    path = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    if os.path.islink(path):
        # containerd's shim makes a task's work path a symlink into its own root-only state: a
        # link followed only when it and every hop are root's alone (the walk checks each)
        path = resolve_trusted(path, "dir")
    return make_private_dir(path)


def write_private_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` 0600 through a temporary file, fsync and rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_private_json(path: str, obj: Any) -> None:
    write_private_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def fs_type(fd: int) -> int:
    """The f_type of the filesystem an open file is on (fstatfs(2)); OSError when it fails."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    buf = (ctypes.c_long * 32)()  # struct statfs is 120 bytes on x86_64 and aarch64; f_type first
    if libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(buf[0]) & 0xFFFFFFFF


def spill_tmpfs_usable(path: str, anyone: bool = False) -> bool:
    """Whether `path` is a tmpfs mounted there (not merely a directory of the tmpfs above it, as
    one left on /run by a mount that failed would be) in which this process may make files; with
    `anyone`, in which every user may (mode 1777, as /dev/shm: what root asks for its trainers).
    Never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st, above = os.fstat(fd), os.stat("..", dir_fd=fd)
        if fs_type(fd) != TMPFS_MAGIC or st.st_dev == above.st_dev:
            return False
        if anyone:
            return st.st_mode & 0o1777 == 0o1777
        return os.access(f"/proc/self/fd/{fd}", os.W_OK | os.X_OK)
    except OSError:
        return False
    finally:
        os.close(fd)


class FileCopy:
    """`size` bytes of an open file copied into a new file `name` of the directory `dir_fd`
    (created 0600, exclusively, never through a link), front to back by one thread with
    sendfile (the kernel copies from the source's page cache: no mapping, no copy through user
    memory). One thread, because a buffered write takes the file's inode lock: on the H200 four
    threads writing 64 MiB spans of one 19.2 GB file wrote 1.6-1.8 GB/s into ext4, against CRIU's
    2.7 GB/s front to back (bench/results/h200/offload-2026-12-01/run12b). Used for a trainer's
    spilled bytes (snapguard.hooks.take.Spill): written into the image beside CRIU's run, or after
    the release, instead of by CRIU inside the stall.

    `start()` returns at once; `wait()` returns once every byte is written, or raises the first
    OSError; `close()` stops what is left (after a failure) and closes the new file."""

    CHUNK = 64 << 20

    def __init__(self, src_fd: int, dir_fd: int, name: str, size: int) -> None:
        self.src, self.size, self.name = src_fd, size, name
        self.error: OSError | None = None
        self.seconds: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                            dir_fd=dir_fd)

    def start(self) -> None:
        if self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="snapguard-spill-copy", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        done = 0
        try:
            while done < self.size and not self._stop.is_set():
                sent = os.sendfile(self._dst, self.src, done, min(self.CHUNK, self.size - done))
                if sent <= 0:
                    raise OSError(f"{self.name}: the source ends {done} bytes in, {self.size - done} short")
                done += sent
        except OSError as e:
            self.error = e
        finally:
            self.seconds = time.monotonic() - self._t0

    def wait(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._stop.set()
                raise OSError(f"{self.name}: not written within {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        written = os.fstat(self._dst).st_size
        if written != self.size:  # never started, or stopped
            raise OSError(f"{self.name}: {written} of {self.size} bytes written")

    def close(self) -> None:
        """Stopped and closed; a copy stuck in a write (a disk that does not answer) is left to
        its daemon thread, with its file open, rather than waited for."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            if self._thread.is_alive():
                return
        if self._dst >= 0:
            os.close(self._dst)
            self._dst = -1
