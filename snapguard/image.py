"""The compatibility manifest and the integrity of an image directory.

At checkpoint: every file of the image is hashed into the manifest (sha256 over the sha256s of its
64 MiB spans, so that large page files hash on every core), the manifest is written 0600,
and a completion marker holding the manifest's sha256 is written last. At restore: no marker means
a half-written or half-copied image; a changed file or manifest means corruption; and the manifest,
which may come from another host, is validated against a JSON Schema (manifest.schema.json)
before anything reads it.

snapguard runs as root and an image directory may have passed through other hands, so neither
seal nor verify ever follows a link: the directory is opened once with O_NOFOLLOW and every file
is opened relative to that descriptor (O_NOFOLLOW, O_NONBLOCK), checked with fstat to be a
regular file, and then read, hashed or chmod-ed through that descriptor. CRIU images are flat:
a symlink, FIFO, device, socket or subdirectory in an image is refused. At restore the directory
must be root's alone (and every directory above it, see trust.py), each file must be root's and
not writable by others, and nothing the manifest does not list may sit in the directory, since
CRIU reads whatever image files it finds there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import threading
import time
from typing import Any

from . import __version__, prefetch, trust
from .names import MANIFEST_NAME, MARKER_NAME, NOT_IMAGE_FILES
from .reasons import Finding, Reason, Severity, SnapguardError

__all__ = ["MANIFEST_NAME", "MARKER_NAME", "SCHEMA", "Inspected", "PageFileHasher", "SpanDigests",
           "compare_with_host", "inspect", "seal", "validate_manifest", "verify"]

SCHEMA = "snapguard.manifest/1"
SCHEMA_FILE = "manifest.schema.json"  # in this package: the JSON Schema of a SCHEMA manifest
# what an image directory may hold beside what was dumped: snapguard's own files and what a
# restore writes there in place (snapguard.names is the one list of these names)
_NOT_IMAGE = NOT_IMAGE_FILES
_MAX_FILES = 100_000  # also the schema's maxProperties of `files`
_MAX_MARKER_BYTES = 4096
_MAX_MANIFEST_BYTES = 64 << 20
_READ = 4 << 20
_SPAN = 64 << 20  # files are hashed in spans of this size (the manifest's digest scheme)
_PARALLEL_BYTES = 256 << 20
_PAGES_FILE = re.compile(r"pages-[0-9]+\.img")  # CRIU's page files: the bulk of an image
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO in a file's place must not block the open (nor the reads: they are refused
# by fstat before any read).
_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_DETAIL = 300

_validator_cache: Any = None


def _not_image(name: str) -> bool:
    return name in _NOT_IMAGE or ".tmp." in name


def _show(name: str, limit: int = 120) -> str:
    """A name from a directory or a manifest, fit for a one-line message."""
    text = name if name.isprintable() else ascii(name)
    return text if len(text) <= limit else text[:limit] + "..."


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _untrusted(st: os.stat_result) -> str | None:
    """Why an image directory or file owned or writable by someone else is not root's alone."""
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class _NotRegular(Exception):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class _Changed(Exception):
    """An image file was replaced between its check and its hashing."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _open_regular(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """`name` (one component) in the directory `dir_fd`, opened for reading; _NotRegular unless it
    is a regular file. Its type is checked before the open (opening a device can act on it) and
    again on the descriptor, which must be the object checked."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise _NotRegular(_kind(st.st_mode))
    fd = os.open(name, _O_FILE, dir_fd=dir_fd)
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise _NotRegular("replaced while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd, fst


def _read_capped(fd: int, cap: int) -> bytes:
    """At most cap + 1 bytes: a longer read tells the caller the file is over its cap."""
    chunks, left = [], cap + 1
    while left > 0:
        block = os.read(fd, min(_READ, left))
        if not block:
            break
        chunks.append(block)
        left -= len(block)
    return b"".join(chunks)


# (name, (st_dev, st_ino), offset, length): a span is read through its own descriptor, opened
# relative to the image directory's and checked to be the file that was checked before.
_Span = tuple[str, tuple[int, int], int, int]


def _sha256_span(dir_fd: int, span: _Span) -> bytes:
    name, ident, offset, length = span
    fd = os.open(name, _O_FILE, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != ident:
            raise _Changed(name)
        return _sha256_at(fd, offset, length)
    finally:
        os.close(fd)


def _sha256_at(fd: int, offset: int, length: int) -> bytes:
    h = hashlib.sha256()
    done = 0
    while done < length:
        block = os.pread(fd, min(_READ, length - done), offset + done)
        if not block:
            break  # the file shrank: its digest will not match
        h.update(block)
        done += len(block)
    return h.digest()


# {name: ((st_dev, st_ino), {span index: sha256})}: spans of files hashed before the seal
SpanDigests = dict[str, tuple[tuple[int, int], dict[int, bytes]]]


def _hash_all(dir_fd: int, files: dict[str, tuple[int, tuple[int, int]]],
              known: SpanDigests | None = None) -> dict[str, str]:
    """{name: digest} for {name: (size, (st_dev, st_ino))}: the digest is the sha256 of the sha256s
    of the file's 64 MiB spans, so that one 6 GB pages file is hashed by all cores, not one.
    `known`: whole spans already hashed (PageFileHasher), taken where the file is the same inode."""
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
    those files whole."""

    def __init__(self, image_dir: str, threads: int) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        self._stop = threading.Event()
        # name: (fd, (st_dev, st_ino), {span index: digest}); the fd is opened once the file holds
        # a whole span, so a tree of many small page files holds no descriptor for them
        self._files: dict[str, tuple[int, tuple[int, int], dict[int, Future[bytes]]]] = {}
        self._shrunk: set[str] = set()
        self.error: str | None = None
        self._dir_fd = os.open(image_dir, _O_DIR)
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
        except (OSError, _NotRegular) as e:
            self.error = f"{type(e).__name__}: {e}"

    def done_spans(self) -> int:
        """How many spans are hashed by now."""
        return sum(1 for _, _, spans in list(self._files.values()) for f in list(spans.values()) if f.done())

    def _look(self) -> None:
        for name in os.listdir(self._dir_fd):
            if not _PAGES_FILE.fullmatch(name) or name in self._before or name in self._shrunk:
                continue
            if name not in self._files:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_size < _SPAN:
                    continue  # not a whole span yet; anything but a regular file: _open_regular says
                fd, st = _open_regular(self._dir_fd, name)
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


def _write_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write `data` to `name` in `dir_fd` 0600, atomically: a new temporary file (O_EXCL,
    O_NOFOLLOW: never an existing file or a link), fsync, rename over `name` (a rename replaces a
    symlink; it never writes through it), fsync of the directory."""
    tmp = f"{name}.tmp.{os.getpid()}"
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # left by a killed run with this pid
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    os.fsync(dir_fd)


def _seal_refused(image_dir: str, detail: str, name: str | None = None) -> SnapguardError:
    evidence = {"image": image_dir}
    if name is not None:
        evidence["path"] = os.path.join(image_dir, name)
    return SnapguardError(Reason.IMAGE_WRITE_FAILED, detail, evidence=evidence)


def _open_seal_dir(image_dir: str) -> int:
    try:
        dir_fd = os.open(image_dir, _O_DIR)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP) and os.path.islink(image_dir):
            raise _seal_refused(image_dir, f"image directory {image_dir} is a symlink: snapguard never "
                                "follows one") from None
        raise
    try:
        why = _untrusted(os.fstat(dir_fd))
        if why:
            raise _seal_refused(image_dir, f"image directory {image_dir} {why}: others could have "
                                "planted or could change what is sealed")
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def _seal_files(dir_fd: int, image_dir: str) -> dict[str, tuple[int, tuple[int, int]]]:
    """{name: (size, (st_dev, st_ino))} of the image's files, each tightened to 0600 through its
    own descriptor. Every entry must be a regular file of root's with one link, or sealing is
    refused: chmod-ing or hashing through a planted link would act on a file outside the image."""
    found: dict[str, tuple[int, tuple[int, int]]] = {}
    for name in sorted(os.listdir(dir_fd)):
        try:
            fd, st = _open_regular(dir_fd, name)
        except _NotRegular as e:
            raise _seal_refused(image_dir, f"{_show(name)} in image {image_dir} is {e.kind}: an image holds "
                                "regular files only, refusing to seal it", name) from None
        try:
            if st.st_uid not in (0, os.geteuid()):
                raise _seal_refused(image_dir, f"image file {_show(name)} in {image_dir} is owned by uid "
                                    f"{st.st_uid}, not root", name)
            if st.st_nlink != 1:
                raise _seal_refused(image_dir, f"image file {_show(name)} in {image_dir} has {st.st_nlink} hard "
                                    "links: it may be a file outside the image", name)
            if _not_image(name):
                continue
            # CRIU writes its images 0644; they hold process memory.
            os.fchmod(fd, 0o600)
            found[name] = (st.st_size, (st.st_dev, st.st_ino))
        finally:
            os.close(fd)
    if len(found) > _MAX_FILES:
        raise _seal_refused(image_dir, f"image {image_dir} has {len(found)} files, more than {_MAX_FILES}")
    return found


def seal(image_dir: str, fields: dict[str, Any], known: SpanDigests | None = None) -> dict[str, Any]:
    """Tighten the image to root alone, hash it, write the manifest, then the completion marker.
    `known`: spans hashed while the image was written (PageFileHasher.finish()).

    An OSError propagates as such; an image that must not be sealed (a symlink, FIFO, device,
    socket or directory in it, a file of another user's) raises SnapguardError(IMAGE_WRITE_FAILED).
    """
    dir_fd = _open_seal_dir(image_dir)
    try:
        found = _seal_files(dir_fd, image_dir)
        try:
            # a marker left from an earlier seal must not vouch for a seal that fails half way
            os.unlink(MARKER_NAME, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        try:
            digests = _hash_all(dir_fd, found, known)
        except _Changed as e:
            raise _seal_refused(image_dir, f"image file {_show(e.name)} in {image_dir} was replaced while it "
                                "was being sealed", e.name) from None
        manifest = {
            "schema": SCHEMA,
            "snapguard_version": __version__,
            "epoch": time.time(),
            **fields,
            "files": {name: {"size": size, "sha256": digests[name]} for name, (size, _) in found.items()},
            "image_bytes": sum(size for size, _ in found.values()),
        }
        data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
        _write_at(dir_fd, MANIFEST_NAME, data)
        marker = {"manifest_sha256": hashlib.sha256(data).hexdigest(), "schema": SCHEMA}
        _write_at(dir_fd, MARKER_NAME, (json.dumps(marker, indent=2, sort_keys=True) + "\n").encode())
    finally:
        os.close(dir_fd)
    return manifest


def _invalid(detail: str, image_dir: str) -> SnapguardError:
    return SnapguardError(Reason.MANIFEST_INVALID, detail, evidence={"image": image_dir})


def _validator() -> Any:
    """The manifest schema's validator, compiled once. jsonschema is imported here, not at module
    level: the executor's pass-through path imports this module and must stay fast."""
    global _validator_cache
    if _validator_cache is None:
        from importlib import resources

        import jsonschema
        from jsonschema import validators

        schema = json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text("utf-8"))
        base = jsonschema.Draft202012Validator
        base.check_schema(schema)
        # JSON Schema counts 1.0 as an integer; a pid or a size read from a manifest must be an int.
        strict = base.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
        _validator_cache = validators.extend(base, type_checker=strict)(schema)
    return _validator_cache


def _json_path(parts: Any) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out if len(out) <= 120 else out[:120] + "..."


def validate_manifest(manifest: Any, image_dir: str) -> dict[str, Any]:
    """Check a manifest that may come from another host against the schema; return it.

    The first (most relevant) violation becomes one MANIFEST_INVALID line naming the field."""
    from jsonschema.exceptions import best_match

    error = best_match(_validator().iter_errors(manifest))
    if error is None:
        return manifest
    message = error.message
    if error.validator == "const":
        message = f"{error.instance!r} is not {error.validator_value!r}"
    elif error.validator == "not":
        message = f"{error.instance!r} is not allowed"
    shown = repr(error.instance)
    if len(shown) > 80:  # the messages quote the bad value whole: keep its start only
        message = message.replace(shown, shown[:80] + "...")
    message = " ".join(message.split())
    if len(message) > _MAX_DETAIL:
        message = message[:_MAX_DETAIL] + "..."
    where = _json_path(error.absolute_path)
    raise _invalid(f"manifest field {where}: {message}" if where else f"manifest: {message}", image_dir)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _open_image_dir(image_dir: str) -> tuple[int, str]:
    """The image directory opened (O_NOFOLLOW) once it and every directory above it are root's
    alone; with its canonical path."""
    evidence = {"image": image_dir}
    parent, base = os.path.split(os.path.abspath(image_dir))
    if not base:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"{image_dir} is not an image directory", evidence=evidence)
    try:
        # The walk of the image directory itself: a sticky parent (/tmp) is fine when the image
        # directory in it is root's (nobody else can rename it), which the walk checks
        if os.path.islink(os.path.join(parent, base)):
            raise trust.UntrustedPathError(os.path.join(parent, base), "is a symlink: snapguard never follows "
                                           "one into an image")
        parent, base = os.path.split(trust.resolve_trusted(os.path.join(parent, base), "dir"))
    except trust.UntrustedPathError as e:
        if e.missing:
            raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir} does not exist",
                                 evidence=evidence) from None
        if e.unusable:  # not a directory, name too long, a link loop: no image directory at all
            raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir}: {e.why}",
                                 evidence={"image": image_dir, "path": e.path}) from None
        raise SnapguardError(Reason.UNTRUSTED_PATH, str(e), evidence={"image": image_dir, "path": e.path}) from None
    path = os.path.join(parent, base)
    evidence["path"] = path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir} does not exist",
                             evidence=evidence) from None
    except OSError as e:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir}: {e.strerror}",
                             evidence=evidence) from None
    if stat.S_ISLNK(st.st_mode):
        raise SnapguardError(Reason.UNTRUSTED_PATH, f"image directory {path} is a symlink: snapguard never "
                             "follows one into an image", evidence=evidence)
    if not stat.S_ISDIR(st.st_mode):
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {image_dir} is not a directory",
                             evidence=evidence)
    try:
        dir_fd = os.open(path, _O_DIR)
    except OSError as e:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"image directory {path} cannot be opened: {e.strerror}",
                             evidence=evidence) from None
    try:
        why = _untrusted(os.fstat(dir_fd))
        if why:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"image directory {path} {why}: others could have "
                                 "planted or changed what CRIU would restore as root", evidence=evidence)
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd, path


def _read_member(dir_fd: int, name: str, cap: int, image_dir: str, reason: Reason) -> bytes:
    """The whole of snapguard's own file `name` in the image (marker or manifest), at most `cap`
    bytes; anything but a regular file of root's is refused with `reason`. FileNotFoundError
    propagates."""
    evidence = {"image": image_dir, "path": os.path.join(image_dir, name)}
    try:
        fd, st = _open_regular(dir_fd, name)
    except _NotRegular as e:
        raise SnapguardError(reason, f"{name} in {image_dir} is {e.kind}, not a regular file",
                             evidence=evidence) from None
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SnapguardError(reason, f"cannot open {name} in {image_dir}: {e.strerror}", evidence=evidence) from None
    try:
        why = _untrusted(st)
        if why:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"{name} in {image_dir} {why}", evidence=evidence)
        if st.st_size > cap:
            raise SnapguardError(reason, f"{name} in {image_dir} is {st.st_size} bytes, more than {cap}",
                                 evidence=evidence)
        try:
            data = _read_capped(fd, cap)
        except OSError as e:
            raise SnapguardError(reason, f"cannot read {name} in {image_dir}: {e.strerror}",
                                 evidence=evidence) from None
    finally:
        os.close(fd)
    if len(data) > cap:
        raise SnapguardError(reason, f"{name} in {image_dir} is more than {cap} bytes", evidence=evidence)
    return data


def _read_marker(dir_fd: int, image_dir: str) -> str:
    """The manifest's sha256 as the completion marker records it."""
    try:
        data = _read_member(dir_fd, MARKER_NAME, _MAX_MARKER_BYTES, image_dir, Reason.IMAGE_CORRUPT)
    except FileNotFoundError:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE,
                             f"{image_dir} has no {MARKER_NAME}: the image was not completed or not fully copied",
                             evidence={"image": image_dir}) from None
    try:
        expected = json.loads(data, parse_constant=_no_constant)["manifest_sha256"]
        if not isinstance(expected, str):
            raise TypeError("manifest_sha256 is not a string")
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:_MAX_DETAIL]
        raise SnapguardError(Reason.IMAGE_CORRUPT,
                             f"completion marker {os.path.join(image_dir, MARKER_NAME)} is unreadable: {detail}",
                             evidence={"image": image_dir}) from None
    return expected


def _read_manifest(dir_fd: int, image_dir: str) -> dict[str, Any]:
    expected = _read_marker(dir_fd, image_dir)
    manifest_path = os.path.join(image_dir, MANIFEST_NAME)
    try:
        data = _read_member(dir_fd, MANIFEST_NAME, _MAX_MANIFEST_BYTES, image_dir, Reason.MANIFEST_INVALID)
    except FileNotFoundError:
        raise _invalid(f"{manifest_path} is missing", image_dir) from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"{MANIFEST_NAME} does not match the completion marker",
                             evidence={"image": image_dir, "path": manifest_path})
    try:
        manifest = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        detail = " ".join(str(e).split())[:_MAX_DETAIL] or type(e).__name__
        raise _invalid(f"{manifest_path} is not JSON: {detail}", image_dir) from None
    return validate_manifest(manifest, image_dir)


def _check_files(dir_fd: int, image_dir: str, files: dict[str, dict[str, Any]]
                 ) -> dict[str, tuple[int, tuple[int, int]]]:
    """Each listed file: a regular file of root's with the recorded size. {name: (size, ident)}."""
    checked = {}
    for name, entry in files.items():
        evidence = {"image": image_dir, "path": os.path.join(image_dir, name)}
        try:
            fd, st = _open_regular(dir_fd, name)
        except _NotRegular as e:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {_show(name)} is {e.kind}, not a regular file",
                                 evidence=evidence) from None
        except FileNotFoundError:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {_show(name)} is missing",
                                 evidence=evidence) from None
        except (OSError, ValueError) as e:  # ValueError: a name the file system cannot encode
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {_show(name)} cannot be opened: "
                                 f"{getattr(e, 'strerror', None) or type(e).__name__}", evidence=evidence) from None
        os.close(fd)
        why = _untrusted(st)
        if why:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"image file {_show(name)} {why}", evidence=evidence)
        if st.st_size != entry["size"]:
            raise SnapguardError(Reason.IMAGE_CORRUPT,
                                 f"image file {_show(name)} has size {st.st_size}, manifest says {entry['size']}",
                                 evidence=evidence)
        checked[name] = (st.st_size, (st.st_dev, st.st_ino))
    return checked


def _check_unlisted(dir_fd: int, image_dir: str, files: dict[str, Any]) -> None:
    """Nothing the manifest does not list, but for _NOT_IMAGE and temporary names; those must be
    regular files of root's too (CRIU and snapguard write restore.log and the like in place)."""
    try:
        names = sorted(os.listdir(dir_fd))
    except OSError as e:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"cannot list image directory {image_dir}: {e.strerror}",
                             evidence={"image": image_dir}) from None
    for name in names:
        if name in files:
            continue
        evidence = {"image": image_dir, "path": os.path.join(image_dir, name)}
        if not _not_image(name):
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image directory holds {_show(name)}, which the manifest "
                                 "does not list: CRIU would read it", evidence=evidence)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"{_show(name)} in the image: {e.strerror}",
                                 evidence=evidence) from None
        if not stat.S_ISREG(st.st_mode):
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"{_show(name)} in the image is {_kind(st.st_mode)}, not "
                                 "a regular file: a restore would write through it", evidence=evidence)
        why = _untrusted(st)
        if why:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"{_show(name)} in the image {why}", evidence=evidence)


class Inspected:
    """An image whose marker, manifest, file types, owners and sizes were checked, its digests not
    yet (`check_digests`): a restore of a workload held at its take point hashes the image while
    CRIU reads it and ends the restored copy before releasing it when a digest differs."""

    def __init__(self, image_dir: str, manifest: dict[str, Any], pending: dict[str, tuple[int, tuple[int, int]]],
                 known: dict[str, str]) -> None:
        self.image_dir, self.manifest, self.pending, self.known = image_dir, manifest, pending, known

    def read_ahead(self, max_file_bytes: int) -> tuple[int, int]:
        """Every image file of at most `max_file_bytes` (CRIU's small files: its process tree,
        cores, memory maps, file tables) read into memory ahead of whoever reads the image next;
        (files, bytes). Nothing followed as a link; never raises."""
        names = [name for name, entry in self.manifest["files"].items()
                 if isinstance(entry, dict) and isinstance(entry.get("size"), int) and entry["size"] <= max_file_bytes]
        try:
            dir_fd, _ = _open_image_dir(self.image_dir)
        except (OSError, SnapguardError):
            return 0, 0
        try:
            return prefetch.willneed_at(dir_fd, names, wait=True)
        finally:
            os.close(dir_fd)

    def check_digests(self) -> None:
        """IMAGE_CORRUPT unless every file not yet verified has its manifest digest and is still
        the inode that was checked."""
        files: dict[str, dict[str, Any]] = self.manifest["files"]
        if not self.pending:
            return
        dir_fd, _ = _open_image_dir(self.image_dir)
        try:
            digests = _hash_all(dir_fd, self.pending)
        except _Changed as e:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {_show(e.name)} was replaced while it was "
                                 "being verified", evidence={"image": self.image_dir,
                                                             "path": os.path.join(self.image_dir, e.name)}) from None
        except OSError as e:
            name = e.filename if isinstance(e.filename, str) else "?"
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {_show(name)} cannot be read: {e.strerror}",
                                 evidence={"image": self.image_dir,
                                           "path": os.path.join(self.image_dir, name)}) from None
        finally:
            os.close(dir_fd)
        for name, digest in digests.items():
            if digest != files[name]["sha256"]:
                raise SnapguardError(Reason.IMAGE_CORRUPT,
                                     f"image file {_show(name)} has sha256 {digest[:16]}..., manifest says "
                                     f"{files[name]['sha256'][:16]}...",
                                     evidence={"image": self.image_dir, "path": os.path.join(self.image_dir, name),
                                               "expected": files[name]["sha256"], "actual": digest})


def inspect(image_dir: str, verified: dict[str, tuple[str, tuple[int, int]]] | None = None) -> Inspected:
    """Every check of `verify` but the digests of files not in `verified` (see verify)."""
    dir_fd, _ = _open_image_dir(image_dir)
    try:
        manifest = _read_manifest(dir_fd, image_dir)
        files: dict[str, dict[str, Any]] = manifest["files"]
        checked = _check_files(dir_fd, image_dir, files)
        _check_unlisted(dir_fd, image_dir, files)
    finally:
        os.close(dir_fd)
    known = {name: digest for name, (digest, ident) in (verified or {}).items()
             if name in checked and checked[name][1] == ident and digest == files[name]["sha256"]}
    return Inspected(image_dir, manifest, {n: v for n, v in checked.items() if n not in known}, known)


def verify(image_dir: str, verified: dict[str, tuple[str, tuple[int, int]]] | None = None) -> dict[str, Any]:
    """Refuse an untrusted, incomplete, corrupt or invalid image; return its validated manifest.

    `verified`: {name: (digest, (st_dev, st_ino))} that this process computed while it wrote the
    file into a directory it made root-only (a store's pull checks every span as it arrives). Such a
    file, while it is the same inode and its digest is the manifest's, is not read a second time;
    its type, owner, size, the unlisted files and the manifest against the marker still are."""
    found = inspect(image_dir, verified)
    found.check_digests()
    return found.manifest


def compare_with_host(manifest: dict[str, Any], host: dict[str, Any], criu_version: str) -> list[Finding]:
    """What stops this image from running here (blockers) and what differs (warnings)."""
    findings = []
    src = manifest["host"]
    if src["arch"] != host["arch"]:
        findings.append(Finding(Reason.CPU_FEATURE_MISMATCH,
                                f"image taken on {src['arch']}, this host is {host['arch']}",
                                evidence={"image_arch": src["arch"], "host_arch": host["arch"]}))
    missing = sorted(set(src["cpu"]["flags"]) - set(host["cpu"]["flags"]))
    if missing:
        findings.append(Finding(Reason.CPU_FEATURE_MISMATCH,
                                f"this host's CPU lacks {len(missing)} flag(s) the image's CPU had: "
                                f"{' '.join(missing[:12])}",
                                evidence={"missing_flags": missing, "image_cpu": src["cpu"]["model"],
                                          "host_cpu": host["cpu"]["model"]}))
    if src["kernel"] != host["kernel"]:
        findings.append(Finding(Reason.KERNEL_CHANGED,
                                f"image taken under kernel {src['kernel']}, this host runs {host['kernel']}",
                                Severity.WARNING, {"image_kernel": src["kernel"], "host_kernel": host["kernel"]}))
    available = host.get("mem_available")
    if isinstance(available, int) and manifest["image_bytes"] > available:
        findings.append(Finding(Reason.HOST_MEMORY_INSUFFICIENT,
                                f"the image holds {manifest['image_bytes'] >> 20} MiB of process and GPU memory, "
                                f"this host has {available >> 20} MiB available",
                                evidence={"needed": manifest["image_bytes"], "available": available}))
    if manifest["criu_version"] != criu_version:
        findings.append(Finding(Reason.CRIU_VERSION_CHANGED,
                                f"image written by CRIU {manifest['criu_version']}, this host has {criu_version}",
                                Severity.WARNING,
                                {"image_criu": manifest["criu_version"], "host_criu": criu_version}))
    return findings
