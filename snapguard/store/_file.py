"""file://: a directory, typically on a shared file system every node mounts.

Objects are files under the root (directories 0700, files 0600, root's alone). Every component of
an object's key is opened relative to its parent's descriptor with O_NOFOLLOW|O_DIRECTORY (the
final one O_NOFOLLOW), as snapguard.trust's walk does: a symlink anywhere inside the store is
refused (UNTRUSTED_PATH), never followed, so nothing outside the root is ever created, read,
listed or deleted through one. A put writes a temporary file in the object's directory, fsyncs it
and renames it into place relative to that directory's descriptor; a create-only put links it
into place (link(2) fails on an existing name: one winner, and a reader never sees a half-written
object). The root is checked (snapguard.trust.make_private_dir) when the store is opened if it
exists, else created by the first write: reading a store that does not exist creates nothing.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from .. import trust
from ..reasons import Reason, SnapguardError
from ._base import _SMALL_CAP, Store
from ._digest import SPAN
from ._records import Progress

__all__ = ["FileStore"]

_READ = 4 << 20
_TMP = ".tmp-"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class FileStore(Store):
    scheme = "file"

    def __init__(self, url: str, root: str) -> None:
        super().__init__(url)
        self.root, self._checked = os.path.abspath(root), False
        if os.path.lexists(root):
            self._check_root()

    def _check_root(self) -> None:
        try:
            self.root = trust.make_private_dir(self.root)
        except trust.UntrustedPathError as e:
            reason = Reason.STORE_UNREACHABLE if e.unusable else Reason.UNTRUSTED_PATH
            raise SnapguardError(reason, f"store {self.url}: {e}", evidence={"store": self.url, "path": e.path}) \
                from None
        self._checked = True

    @staticmethod
    def _parts(key: str) -> list[str]:
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise SnapguardError(Reason.USAGE_ERROR, f"bad store key {key!r}")
        return parts

    def _linked(self, key: str, name: str) -> SnapguardError:
        return SnapguardError(Reason.UNTRUSTED_PATH, f"store {self.url}: {name!r} on the way to {key} is a symbolic "
                              "link or not a directory; links inside a store are never followed",
                              evidence={"store": self.url, "key": key})

    def _dir(self, dirs: list[str], key: str, create: bool) -> int | None:
        """A descriptor of the directory `dirs` below the root, each component opened relative to
        its parent without following links (made 0700 where missing, with `create`); None when a
        component is missing and not to be made."""
        if not self._checked:
            if not create and not os.path.lexists(self.root):
                return None
            self._check_root()
        try:
            fd = os.open(self.root, _DIR)
        except FileNotFoundError:
            if not create:
                return None
            self._check_root()
            fd = os.open(self.root, _DIR)
        try:
            for name in dirs:
                try:
                    nxt = os.open(name, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                    try:
                        os.mkdir(name, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = os.open(name, _DIR, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    if not create and not stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        os.close(fd)
                        return None  # a file where a directory would be: nothing below it
                    raise self._linked(key, name) from None
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _parent(self, key: str, create: bool) -> tuple[int | None, str]:
        parts = self._parts(key)
        return self._dir(parts[:-1], key, create), parts[-1]

    def _tmp(self, key: str) -> tuple[int, str, int]:
        d, _ = self._parent(key, create=True)
        assert d is not None
        tmp = f"{_TMP}{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=d)
        except BaseException:
            os.close(d)
            raise
        return d, tmp, fd

    @staticmethod
    def _drop(d: int, tmp: str) -> None:
        try:
            os.unlink(tmp, dir_fd=d)
        except FileNotFoundError:
            pass

    def _into_place(self, d: int, tmp: str, key: str) -> None:
        """Rename the fsynced temporary file over the key's name, then fsync the directory."""
        try:
            os.replace(tmp, self._parts(key)[-1], src_dir_fd=d, dst_dir_fd=d)
            os.fsync(d)
        finally:
            os.close(d)

    def _write_tmp(self, key: str, data: bytes) -> tuple[int, str]:
        d, tmp, fd = self._tmp(key)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._drop(d, tmp)
            os.close(d)
            raise
        os.close(fd)
        return d, tmp

    def _put(self, key: str, data: bytes) -> None:
        d, tmp = self._write_tmp(key, data)
        self._into_place(d, tmp, key)

    def _put_new(self, key: str, data: bytes) -> bool:
        d, tmp = self._write_tmp(key, data)
        try:
            os.link(tmp, self._parts(key)[-1], src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
            os.fsync(d)
        except FileExistsError:
            return False
        finally:
            self._drop(d, tmp)
            os.close(d)
        return True

    def _open(self, key: str) -> int | None:
        d, name = self._parent(key, create=False)
        if d is None:
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise SnapguardError(Reason.IMAGE_CORRUPT, f"store object {key} is a symbolic link, not a regular "
                                     "file", evidence={"store": self.url, "key": key}) from None
            raise
        finally:
            os.close(d)
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
        """The keys under `prefix`; symbolic links (files or directories) are not objects and
        are neither listed nor followed."""
        base = prefix.rstrip("/")
        try:
            d = self._dir(self._parts(base) if base else [], prefix, create=False)
        except SnapguardError as e:
            if e.reason is Reason.USAGE_ERROR:
                return []
            raise
        out: list[str] = []
        if d is not None:
            _walk_fd(d, base, prefix, out)
        return sorted(out)

    def _delete(self, key: str) -> None:
        d, name = self._parent(key, create=False)
        if d is None:
            return
        try:
            os.unlink(name, dir_fd=d)
        except FileNotFoundError:
            pass
        finally:
            os.close(d)

    def _upload(self, key: str, fd: int, size: int, progress: Progress) -> list[bytes]:
        d, tmp, out = self._tmp(key)
        try:
            digests = _copy_spans(fd, out, size, progress)
            os.fsync(out)
        except BaseException:
            os.close(out)
            self._drop(d, tmp)
            os.close(d)
            raise
        os.close(out)
        self._into_place(d, tmp, key)
        return digests

    def _begin(self, key: str) -> tuple[str, int, str, int]:
        d, tmp, fd = self._tmp(key)
        return key, d, tmp, fd

    def _part(self, handle: tuple[str, int, str, int], index: int, data: bytes) -> None:
        off, view = index * SPAN, memoryview(data)
        while view:
            n = os.pwrite(handle[3], view, off)
            view, off = view[n:], off + n
        # the disk writes each span while the dump goes on: little is left for the commit's fsync
        os.fdatasync(handle[3])

    def _commit(self, handle: tuple[str, int, str, int]) -> None:
        key, d, tmp, fd = handle
        try:
            os.fsync(fd)
        except BaseException:
            os.close(d)
            raise
        finally:
            os.close(fd)
        self._into_place(d, tmp, key)

    def _abort(self, handle: tuple[str, int, str, int]) -> None:
        try:
            os.close(handle[3])
        except OSError:
            pass
        try:
            self._drop(handle[1], handle[2])
        finally:
            try:
                os.close(handle[1])
            except OSError:
                pass

    def _sweep(self, prefix: str) -> int:
        base = prefix.rstrip("/")
        d = self._dir(self._parts(base), prefix, create=False)
        if d is None:
            return 0
        gone = 0
        try:
            for n in os.listdir(d):
                if n.startswith(_TMP):
                    try:
                        os.unlink(n, dir_fd=d)
                        gone += 1
                    except FileNotFoundError:
                        pass
        finally:
            os.close(d)
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


def _walk_fd(d: int, rel: str, prefix: str, out: list[str]) -> None:
    """Append the keys of the regular files below directory descriptor `d` (closed here), whose
    key is `rel`, that start with `prefix`; entries are opened relative to `d`, never followed."""
    try:
        with os.scandir(d) as entries:
            found = [(e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False)) for e in entries]
        for name, is_dir, is_file in found:
            key = f"{rel}/{name}" if rel else name
            if is_file and not name.startswith(_TMP) and key.startswith(prefix):
                out.append(key)
            elif is_dir:
                try:
                    sub = os.open(name, _DIR, dir_fd=d)
                except OSError:
                    continue  # gone, or swapped for a link since it was listed
                _walk_fd(sub, key, prefix, out)
    finally:
        os.close(d)


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
