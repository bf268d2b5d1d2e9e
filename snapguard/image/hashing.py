"""The digest scheme of an image's files: the sha256 of the sha256s of a file's 64 MiB spans, so
that one large page file is hashed by every core; and `PageFileHasher`, which hashes CRIU's page
files while a dump still writes them."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading

from ._io import O_DIR, O_FILE, READ, Changed, NotRegular, open_regular

__all__ = ["PageFileHasher", "SpanDigests", "hash_all"]

_SPAN = 64 << 20  # files are hashed in spans of this size (the manifest's digest scheme)
_PARALLEL_BYTES = 256 << 20
_PAGES_FILE = re.compile(r"pages-[0-9]+\.img")  # CRIU's page files: the bulk of an image

# (name, (st_dev, st_ino), offset, length): a span is read through its own descriptor, opened
# relative to the image directory's and checked to be the file that was checked before.
_Span = tuple[str, tuple[int, int], int, int]

# {name: ((st_dev, st_ino), {span index: sha256})}: spans of files hashed before the seal
SpanDigests = dict[str, tuple[tuple[int, int], dict[int, bytes]]]


def _sha256_span(dir_fd: int, span: _Span) -> bytes:
    name, ident, offset, length = span
    fd = os.open(name, O_FILE, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != ident:
            raise Changed(name)
        return _sha256_at(fd, offset, length)
    finally:
        os.close(fd)


def _sha256_at(fd: int, offset: int, length: int) -> bytes:
    h = hashlib.sha256()
    done = 0
    while done < length:
        block = os.pread(fd, min(READ, length - done), offset + done)
        if not block:
            break  # the file shrank: its digest will not match
        h.update(block)
        done += len(block)
    return h.digest()


def hash_all(dir_fd: int, files: dict[str, tuple[int, tuple[int, int]]],
             known: SpanDigests | None = None) -> dict[str, str]:
    """{name: digest} for {name: (size, (st_dev, st_ino))}: the digest is the sha256 of the sha256s
    of the file's 64 MiB spans, so that one 6 GB pages file is hashed by all cores, not one.
    `known`: whole spans already hashed (PageFileHasher), taken where the file is the same inode.
    Changed when a file is another inode than the one checked."""
    per_file = {name: [(name, ident, off, min(_SPAN, size - off)) for off in range(0, size, _SPAN)]
                or [(name, ident, 0, 0)] for name, (size, ident) in files.items()}
    spans = [span for file_spans in per_file.values() for span in file_spans]

    def ahead(span: _Span) -> bytes | None:
        name, ident, offset, length = span
        had = (known or {}).get(name)
        return had[1].get(offset // _SPAN) if had and had[0] == ident and length == _SPAN else None

    early = [ahead(span) for span in spans]
    todo = [span for span, digest in zip(spans, early) if digest is None]
    if sum(length for _, _, _, length in todo) < _PARALLEL_BYTES or (os.cpu_count() or 1) == 1:
        hashed = [_sha256_span(dir_fd, span) for span in todo]
    else:
        # hashlib releases the GIL on large buffers. Imported here: small images should not pay
        # for the import on every checkpoint.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            hashed = list(pool.map(lambda span: _sha256_span(dir_fd, span), todo))
    computed = dict(zip(todo, hashed))
    digests = [digest or computed[span] for span, digest in zip(spans, early)]
    out, i = {}, 0
    for name, file_spans in per_file.items():
        out[name] = hashlib.sha256(b"".join(digests[i:i + len(file_spans)])).hexdigest()
        i += len(file_spans)
    return out


class PageFileHasher:
    """Hashes the whole 64 MiB spans of CRIU's page files while a stop snapshot's dump is still
    writing them, so that the seal hashes only the rest (on the H200 the seal of the 85 M
    trainer's 3.4 GB image took 0.29 s after the dump, 1.5 s at 1.2 B).

    CRIU creates each page file at the start of its dump (O_TRUNC) and then only appends to it
    (page-xfer splices the pages at the file's position), so what lies below a file's size is
    final. Hence: a page file already in the directory when the hasher starts (left by an
    earlier attempt: CRIU truncates and rewrites the same inode) is never hashed early, and a file
    ever seen shorter than before loses what was hashed of it; the seal hashes both whole. A file
    replaced under its name is another inode, whose spans the seal does not take. What neither
    catches is a span rewritten in place after it was read, which CRIU does not do: the local
    restore's check would refuse it, but a copy streamed to the store (snapguard.store, which
    reads the spans as early) would agree with the manifest. Whatever goes wrong here (a file that
    is not a regular one, an error) only stops the hasher: the seal then hashes, and checks,
    those files whole.

    `fresh`: other files of the image this run created (O_EXCL) and writes front to back once,
    hashed as early whether or not they were there when the hasher started: the take point's
    spill copies (snapguard.files.FileCopy), which a stop snapshot writes beside CRIU's run and
    which the seal otherwise hashed whole after it (1.2 GB at 85 M on the H200)."""

    def __init__(self, image_dir: str, threads: int, fresh: frozenset[str] = frozenset()) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self._stop = threading.Event()
        # name: (fd, (st_dev, st_ino), {span index: digest}); the fd is opened once the file holds
        # a whole span, so a tree of many small page files holds no descriptor for them
        self._files: dict[str, tuple[int, tuple[int, int], dict[int, Future[bytes]]]] = {}
        self._shrunk: set[str] = set()
        self._fresh = fresh
        self.error: str | None = None
        self._dir_fd = os.open(image_dir, O_DIR)
        try:
            self._before = {name for name in os.listdir(self._dir_fd) if _PAGES_FILE.fullmatch(name)}
            self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="span-hash")
            self._thread = threading.Thread(target=self._watch, name="span-hasher", daemon=True)
            try:
                self._thread.start()
            except BaseException:
                self._pool.shutdown(wait=False)
                raise
        except BaseException:
            os.close(self._dir_fd)
            raise

    def _watch(self) -> None:
        try:
            while not self._stop.wait(0.02):
                self._look()
        except (OSError, NotRegular) as e:
            self.error = f"{type(e).__name__}: {e}"

    def done_spans(self) -> int:
        """How many spans are hashed by now."""
        return sum(1 for _, _, spans in list(self._files.values()) for f in list(spans.values()) if f.done())

    def _look(self) -> None:
        for name in os.listdir(self._dir_fd):
            early = name in self._fresh or (_PAGES_FILE.fullmatch(name) is not None and name not in self._before)
            if not early or name in self._shrunk:
                continue
            if name not in self._files:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_size < _SPAN:
                    continue  # not a whole span yet; anything but a regular file: open_regular says
                fd, st = open_regular(self._dir_fd, name)
                self._files[name] = (fd, (st.st_dev, st.st_ino), {})
            fd, _, spans = self._files[name]
            size = os.fstat(fd).st_size
            if size < len(spans) * _SPAN:  # it shrank: nothing hashed of it can be trusted
                self._shrunk.add(name)
                continue
            for i in range(len(spans), size // _SPAN):
                spans[i] = self._pool.submit(_sha256_at, fd, i * _SPAN, _SPAN)

    def finish(self) -> SpanDigests:
        """Stop, and the spans hashed by now (those still queued are left to the seal); once: a
        second call returns nothing. Never raises: the snapshot goes on without what it lacks."""
        if self._stop.is_set():
            return {}
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
        out: SpanDigests = {}
        for name, (fd, ident, spans) in self._files.items():
            if name not in self._shrunk:
                out[name] = (ident, {i: f.result() for i, f in spans.items()
                                     if not f.cancelled() and f.exception() is None})
            try:
                os.close(fd)
            except OSError:
                pass
        self._files.clear()
        try:
            os.close(self._dir_fd)
        except OSError:
            pass
        return out
