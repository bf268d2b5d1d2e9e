"""file://: a directory, typically on a shared file system every node mounts.

Objects are files under the root (directories 0700, files 0600, root's alone). A put writes a
temporary file in the object's directory, fsyncs it and renames it into place
(snapguard.files.rename_into_place); a create-only put links it into place (link(2) fails on an
existing name: one winner, and a reader never sees a half-written object). Nothing is ever
followed through a symlink.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from .. import files, trust
from ..reasons import Reason, SnapguardError
from ._base import _SMALL_CAP, Store
from ._digest import SPAN
from ._records import Progress

__all__ = ["FileStore"]

_READ = 4 << 20
_TMP = ".tmp-"


class FileStore(Store):
    scheme = "file"

    def __init__(self, url: str, root: str) -> None:
        super().__init__(url)
        try:
            self.root = trust.make_private_dir(root)
        except trust.UntrustedPathError as e:
            reason = Reason.STORE_UNREACHABLE if e.unusable else Reason.UNTRUSTED_PATH
            raise SnapguardError(reason, f"store {url}: {e}", evidence={"store": url, "path": e.path}) from None

    def _path(self, key: str) -> str:
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise SnapguardError(Reason.USAGE_ERROR, f"bad store key {key!r}")
        return os.path.join(self.root, *parts)

    def _dir_for(self, key: str) -> str:
        d = os.path.dirname(self._path(key))
        os.makedirs(d, mode=0o700, exist_ok=True)
        return d

    def _tmp(self, key: str) -> tuple[str, int]:
        d = self._dir_for(key)
        tmp = os.path.join(d, f"{_TMP}{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return tmp, fd

    @staticmethod
    def _sync_dir(path: str) -> None:
        fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_tmp(self, key: str, data: bytes) -> str:
        tmp, fd = self._tmp(key)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def _put(self, key: str, data: bytes) -> None:
        tmp = self._write_tmp(key, data)
        files.rename_into_place(tmp, self._path(key))

    def _put_new(self, key: str, data: bytes) -> bool:
        tmp = self._write_tmp(key, data)
        try:
            os.link(tmp, self._path(key), follow_symlinks=False)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        self._sync_dir(tmp)
        return True

    def _open(self, key: str) -> int | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"store object {key} is not a regular file")
        return fd

    def _get(self, key: str, cap: int = _SMALL_CAP) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            if os.fstat(fd).st_size > cap:
                raise SnapguardError(Reason.IMAGE_CORRUPT, f"store object {key} is over {cap} bytes")
            return os.read(fd, cap + 1)
        finally:
            os.close(fd)

    def _list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        out = []
        for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
            rel = os.path.relpath(dirpath, self.root)
            for f in filenames:
                if f.startswith(_TMP):
                    continue
                key = f if rel == "." else f"{rel}/{f}".replace(os.sep, "/")
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    def _delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def _upload(self, key: str, fd: int, size: int, progress: Progress) -> list[bytes]:
        tmp, out = self._tmp(key)
        try:
            digests = _copy_spans(fd, out, size, progress)
            os.fsync(out)
        except BaseException:
            os.close(out)
            os.unlink(tmp)
            raise
        os.close(out)
        files.rename_into_place(tmp, self._path(key))
        return digests

    def _begin(self, key: str) -> tuple[str, str, int]:
        tmp, fd = self._tmp(key)
        return key, tmp, fd

    def _part(self, handle: tuple[str, str, int], index: int, data: bytes) -> None:
        off, view = index * SPAN, memoryview(data)
        while view:
            n = os.pwrite(handle[2], view, off)
            view, off = view[n:], off + n
        # the disk writes each span while the dump goes on: little is left for the commit's fsync
        os.fdatasync(handle[2])

    def _commit(self, handle: tuple[str, str, int]) -> None:
        key, tmp, fd = handle
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        files.rename_into_place(tmp, self._path(key))

    def _abort(self, handle: tuple[str, str, int]) -> None:
        try:
            os.close(handle[2])
        except OSError:
            pass
        try:
            os.unlink(handle[1])
        except FileNotFoundError:
            pass

    def _sweep(self, prefix: str) -> int:
        try:
            d = self._path(prefix.rstrip("/"))
            names = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        gone = 0
        for n in names:
            if n.startswith(_TMP):
                try:
                    os.unlink(os.path.join(d, n))
                    gone += 1
                except FileNotFoundError:
                    pass
        return gone

    def _download(self, key: str, size: int, out_fd: int, progress: Progress) -> list[bytes]:
        fd = self._open(key)
        if fd is None:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {key} is missing from the store",
                                 evidence={"store": self.url, "key": key})
        try:
            if os.fstat(fd).st_size != size:
                raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {key} in the store has "
                                     f"{os.fstat(fd).st_size} bytes, manifest says {size}",
                                     evidence={"store": self.url, "key": key})
            return _copy_spans(fd, out_fd, size, progress, mapped=True)
        finally:
            os.close(fd)


def _copy_spans(src: int, out: int, size: int, progress: Progress, parallel: int = 8,
                mapped: bool = False) -> list[bytes]:
    """Copy `size` bytes from src to out at the same offsets, each SPAN by one of `parallel`
    threads (hashlib and the copies let go of the GIL), hashing it as it passes: the span digests
    of the manifest's scheme, computed from the bytes actually copied. A file that ends early
    yields a short span, whose digest then disagrees with the manifest.

    With `mapped` (a pull, into a local copy opened for reading and writing), a file of several
    spans is copied into a shared mapping of `out` (preadv straight into it): write(2) to one
    file holds its inode lock, so threads writing it take turns, while stores through a mapping
    do not (on the H200's tmpfs 3.5 GB took 1.9 s through pwrite). Only the
    kernel stores into the mapping (preadv), so a page it cannot allocate fails that call (EFAULT,
    raised as EIO) instead of raising SIGBUS in this process; the file is sized with ftruncate, not
    allocated (allocating zeroes every page first, single-threaded), after a check for the space."""
    from concurrent.futures import ThreadPoolExecutor

    from ._digest import spans

    todo = spans(size)
    if len(todo) == 1:
        return [_copy_span(src, out, todo[0], progress)]
    if not mapped:
        with ThreadPoolExecutor(max_workers=min(parallel, len(todo)), thread_name_prefix="copy") as pool:
            return list(pool.map(lambda span: _copy_span(src, out, span, progress), todo))
    import mmap

    fs = os.fstatvfs(out)
    if fs.f_bavail * fs.f_frsize < size:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {size} bytes to store, "
                                    f"{fs.f_bavail * fs.f_frsize} free")
    os.ftruncate(out, size)
    mapping = mmap.mmap(out, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        view = memoryview(mapping)
        try:
            with ThreadPoolExecutor(max_workers=min(parallel, len(todo)), thread_name_prefix="copy") as pool:
                return list(pool.map(lambda span: _copy_span_mapped(src, view, span, progress), todo))
        finally:
            view.release()
    finally:
        mapping.close()


def _copy_span(src: int, out: int, span: tuple[int, int], progress: Progress) -> bytes:
    import hashlib

    off, length = span
    h, done = hashlib.sha256(), 0
    while done < length:
        block = os.pread(src, min(_READ, length - done), off + done)
        if not block:
            break
        h.update(block)
        view, at = memoryview(block), off + done
        while view:
            n = os.pwrite(out, view, at)
            view, at = view[n:], at + n
        done += len(block)
        progress.add(len(block))
    return h.digest()


def _copy_span_mapped(src: int, out: memoryview, span: tuple[int, int], progress: Progress) -> bytes:
    import hashlib

    off, length = span
    h, done = hashlib.sha256(), 0
    while done < length:
        at = off + done
        with out[at:at + min(_READ, length - done)] as block:
            try:
                n = os.preadv(src, [block], at)
            except OSError as e:
                if e.errno != errno.EFAULT:
                    raise
                raise OSError(errno.EIO, "the pulled copy could not take a page (its file system filled up "
                                         "or failed)") from None
            if not n:
                break
            with block[:n] as got:
                h.update(got)
        done += n
        progress.add(n)
    return h.digest()
