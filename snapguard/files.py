"""Writing files that hold process memory or its description: private to root, atomic."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from .trust import make_private_dir, resolve_trusted

__all__ = ["FileCopy", "ensure_private_dir", "rename_into_place", "write_atomic", "write_private_bytes",
           "write_private_json"]


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


def write_atomic(path: str, data: bytes, mode: int = 0o600, *, dir_fd: int | None = None,
                 exclusive_tmp: bool = False) -> None:
    """The one atomic write: `data` to a temporary file beside `path` (created `mode`, never
    through a link), fsync, rename over `path`, fsync of the directory. With `dir_fd`, `path` is a
    name in that directory, and both names are resolved against it (no path walk). With
    `exclusive_tmp`, a temporary file left by a killed run of this pid is removed and the new one
    created O_EXCL. On failure the temporary file is removed and `path` is as it was."""
    tmp = f"{path}.tmp.{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    if exclusive_tmp:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        flags |= os.O_EXCL
    else:
        flags |= os.O_TRUNC
    fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
    try:
        try:
            if mode != 0o600:
                os.fchmod(fd, mode)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    if dir_fd is not None:
        os.fsync(dir_fd)
        return
    parent = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(parent)
    finally:
        os.close(parent)


def rename_into_place(tmp: str, path: str) -> None:
    """Rename the finished temporary file `tmp` (fsynced by its writer, in `path`'s directory)
    over `path`, then fsync the directory: how a file written in pieces (streamed, copied) takes
    its name atomically."""
    os.replace(tmp, path)
    parent = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(parent)
    finally:
        os.close(parent)


def write_private_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` 0600, atomically (write_atomic)."""
    write_atomic(path, data, 0o600)


def write_private_json(path: str, obj: Any) -> None:
    write_private_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


class FileCopy:
    """`size` bytes of an open file copied into a new file `name` of the directory `dir_fd`
    (created 0600, exclusively, never through a link), front to back by one thread with
    sendfile (the kernel copies from the source's page cache: no mapping, no copy through user
    memory). One thread, because a buffered write takes the file's inode lock: on the H200 four
    threads writing 64 MiB spans of one 19.2 GB file wrote 1.6-1.8 GB/s into ext4, against CRIU's
    2.7 GB/s front to back (bench/results/h200/offload-2026-12-01/run12b). Used for a trainer's
    spilled bytes (snapguard.takepoint.spill.Spill): written into the image beside CRIU's run, or after
    the release, instead of by CRIU inside the stall.

    `max_allocated`: the copy stops with an OSError once the source holds more allocated bytes
    than that (a file filled while copied is not written). `start()` returns at once; `wait()` returns once every byte is written, or raises the first
    OSError; `close()` stops what is left (after a failure) and closes the new file."""

    CHUNK = 64 << 20

    def __init__(self, src_fd: int, dir_fd: int, name: str, size: int, max_allocated: int | None = None) -> None:
        self.src, self.size, self.name = src_fd, size, name
        self.max_allocated = max_allocated  # the source's allocated bytes may not grow past this while copied
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
                held = os.fstat(self.src).st_blocks * 512
                if self.max_allocated is not None and held > self.max_allocated:
                    raise OSError(f"{self.name}: the source grew to {held} allocated bytes while copied, past the "
                                  f"{self.max_allocated} it held when it was handed over")
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
