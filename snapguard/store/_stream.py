"""Upload an image while CRIU is still writing it, so that the copy overlaps the dump.

CRIU writes each image file front to back (pages-*.img, the bulk of a GPU process's image, grows
for the whole dump). A `StreamingPush` watches the image directory from the moment it exists:
every time a file has grown by a whole 64 MiB span (the manifest's digest scheme), that span is
read, hashed and sent as one part of the file's object, several spans in flight. Nothing it sends
counts yet. `finish()`, called after the seal, takes the manifest as the authority: the tail of
each streamed file is sent, its span digests are combined and compared with the manifest's; a
file whose streamed bytes differ (CRIU went back and rewrote it, or replaced it) is uploaded again
whole, from the sealed file. (A stop snapshot's manifest takes the page files' span digests from
snapguard.image.PageFileHasher, which reads them as early as this does: a span rewritten in place
after both read it would agree with the manifest; CRIU only appends to a page file it created.)
Files the manifest does not list are dropped; small files the dump finished without a whole span
are uploaded then. Only after that come the manifest, the store
record and, last and create-only, the marker, under the same fencing check as `Store.push`. A
dump that fails ends with `abort()`: every part and object sent is deleted, nothing is marked.
"""

from __future__ import annotations

import contextvars
import os
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..names import NOT_IMAGE_FILES, TAKE_SPILL
from . import _exchange
from ._digest import SPAN, combine
from ._members import check_member, read_sealed, read_span, upload_member

__all__ = ["StreamingPush"]

_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Follower:
    """One image file being streamed: its open fd (the inode seen first), the object's handle
    in the store, and the digest of each span sent, by index."""

    def __init__(self, name: str, fd: int, handle: Any) -> None:
        self.name, self.fd, self.handle = name, fd, handle
        self.sent = 0  # spans submitted
        self.digests: dict[int, bytes] = {}
        self.futures: list[Future[None]] = []


class StreamingPush:
    """See the module docstring. Use as `with store.stream(dir, job, ...) as s: <dump, seal>;
    s.finish()`; leaving the block without finish() aborts."""

    def __init__(self, store: Any, image_dir: str, job: str, name: str, epoch: int, progress: Any,
                 *, parallel: int = 4, poll_s: float = 0.02, deadline_s: float | None = None) -> None:
        self.store, self.image_dir, self.job, self.name, self.epoch = store, image_dir, job, name, epoch
        self.prefix = f"{job}/images/{name}/"
        self.progress = progress
        self.poll_s = poll_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="stream")
        self._followers: dict[str, _Follower] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._dir_fd = -1
        self.streamed_bytes = 0  # bytes sent before finish(): the overlap with the dump
        self._count = threading.Lock()
        self.resent: list[str] = []  # files uploaded again whole because their streamed bytes differed
        self.finished = False
        self.deadline_s = deadline_s  # from start() to the end of finish(); None: by the image's size
        self._ctx = contextvars.copy_context()

    # -- while the dump runs ------------------------------------------------------------------
    def start(self) -> StreamingPush:
        self._dir_fd = os.open(self.image_dir, _O_DIR)
        self.progress.start(0, f"push {self.job}/{self.name} (streaming)")
        with _exchange.operation(self.deadline_s, f"push {self.job}/{self.name}"):
            self._ctx = contextvars.copy_context()  # what every thread of this push runs under
        self._thread = threading.Thread(target=self._in(self._watch), name="stream-watch", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                self._scan()
                self._stop.wait(self.poll_s)
        except BaseException as e:  # kept for finish(), which raises it
            self._error = e

    def _scan(self) -> None:
        total = 0
        for entry in os.scandir(self._dir_fd):
            name = entry.name
            if name in NOT_IMAGE_FILES or name.endswith(".log") or \
                    (name.startswith((".", "snapguard-")) and not TAKE_SPILL.fullmatch(name)):
                continue  # snapguard's own files: but a take point's spill is image, written front to back
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            total += st.st_size
            f = self._followers.get(name)
            if f is None:
                if st.st_size < SPAN:
                    continue  # small files go at finish(), whole
                f = self._follow(name)
                if f is None:
                    continue
            self._submit_spans(f, os.fstat(f.fd).st_size, whole_only=True)
        self.progress.total = max(self.progress.total, total)

    def _follow(self, name: str) -> _Follower | None:
        try:
            fd = os.open(name, _O_FILE, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        f = _Follower(name, fd, self.store._begin(self.prefix + name))
        self._followers[name] = f
        return f

    def _submit_spans(self, f: _Follower, size: int, *, whole_only: bool) -> None:
        while f.sent * SPAN + (SPAN if whole_only else 1) <= size:
            index = f.sent
            f.futures.append(self._pool.submit(self._in(self._send), f, index, min(SPAN, size - index * SPAN)))
            f.sent += 1

    def _send(self, f: _Follower, index: int, length: int) -> None:
        import hashlib

        data = read_span(f.fd, index * SPAN, length)
        f.digests[index] = hashlib.sha256(data).digest()
        self.store._part(f.handle, index, data)
        self.progress.add(len(data))
        if not self.finished:
            with self._count:
                self.streamed_bytes += len(data)

    # -- after the seal -----------------------------------------------------------------------
    def _in(self, fn: Any) -> Any:
        """`fn` to run (in any thread) under this push's deadline."""
        return lambda *a: self._ctx.copy().run(fn, *a)

    def finish(self) -> Any:
        """Complete the upload against the sealed manifest; the marker last. Any failure aborts."""
        return self._in(self._finish)()

    def _finish(self) -> Any:
        self._halt()
        try:
            if self._error is not None:
                raise self._error
            self.finished = True
            marker, manifest_bytes, manifest = read_sealed(self._dir_fd, self.image_dir)
            files: dict[str, dict[str, Any]] = manifest["files"]
            total = sum(int(e["size"]) for e in files.values())
            self.progress.total = total
            _exchange.by_size(total, f"push {self.job}/{self.name}")
            for fname in files:
                check_member(fname)
            for name in list(self._followers):
                if name not in files:
                    self._drop(name)
            whole: list[str] = []
            for name, f in self._followers.items():
                size = int(files[name]["size"])
                if os.fstat(f.fd).st_size != size or f.sent * SPAN > size:
                    whole.append(name)
                    continue
                self._submit_spans(f, size, whole_only=False)
            for f in self._followers.values():
                for fut in f.futures:
                    fut.result()
            for name, f in list(self._followers.items()):
                if name in whole or combine([f.digests[i] for i in range(f.sent)]) != files[name]["sha256"]:
                    self._drop(name)
                    self.resent.append(name)
                else:
                    self.store._commit(f.handle)
                    f.handle = None
            todo = [n for n in sorted(files) if n not in self._followers]
            futures = [self._pool.submit(self._in(upload_member), self.store, self._dir_fd, self.image_dir, self.prefix,
                                         n, files[n], self.progress) for n in todo]
            for fut in futures:
                fut.result()
            ref = self.store._commit_image(self.job, self.name, self.epoch, manifest_bytes, marker, len(files), total)
        except BaseException:
            self.abort()
            raise
        finally:
            self._close()
        self.progress.report(final=True)
        return ref

    def abort(self) -> None:
        """Delete every part and object sent (best effort: an unmarked leftover never counts),
        under a short deadline of its own."""
        with _exchange.cleanup(f"remove the failed push {self.job}/{self.name}"):
            self._abort_all()

    def _abort_all(self) -> None:
        self._halt()
        for name in list(self._followers):
            try:
                self._drop(name)
            except Exception:
                pass
        try:
            for key in self.store._list(self.prefix):
                self.store._delete(key)
        except Exception:
            pass
        self._close()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _drop(self, name: str) -> None:
        f = self._followers.pop(name)
        for fut in f.futures:
            try:
                fut.result()
            except Exception:
                pass
        if f.handle is not None:
            self.store._abort(f.handle)
            f.handle = None
        os.close(f.fd)

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        for f in self._followers.values():
            try:
                os.close(f.fd)
            except OSError:
                pass
        self._followers.clear()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __enter__(self) -> StreamingPush:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.finished or exc[0] is not None:
            self.abort()

    def figures(self, started: float) -> dict[str, Any]:
        return {"streamed_bytes": self.streamed_bytes, "resent": self.resent,
                "seconds": round(time.monotonic() - started, 3)}
