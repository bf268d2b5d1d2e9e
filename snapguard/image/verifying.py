"""Verifying an image at restore: the completion marker, the manifest against it and against the
schema, every listed file a regular file of root's with its recorded size and digest, and nothing
unlisted in the directory (CRIU reads whatever image files it finds there).

The directory must be root's alone (and every directory above it, see snapguard.trust); nothing is
followed as a link. `inspect` does every check but the digests, which `Inspected.check_digests`
does later (a held workload's image is hashed while CRIU reads it); `verify` does both.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat

from .. import prefetch
from ..names import MANIFEST_NAME, MARKER_NAME
from ..reasons import Reason, SnapguardError
from ._io import (MAX_DETAIL, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Changed, NotRegular, kind, no_constant,
                  not_image, open_image_dir, open_regular, read_member, show, untrusted)
from .hashing import hash_all
from .manifest import FileEntry, Manifest, invalid

__all__ = ["Inspected", "inspect", "verify"]

Verified = dict[str, tuple[str, tuple[int, int]]]  # {name: (digest, (st_dev, st_ino))} computed as written


def _read_marker(dir_fd: int, image_dir: str) -> str:
    """The manifest's sha256 as the completion marker records it."""
    try:
        data = read_member(dir_fd, MARKER_NAME, MAX_MARKER_BYTES, image_dir, Reason.IMAGE_CORRUPT)
    except FileNotFoundError:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE,
                             f"{image_dir} has no {MARKER_NAME}: the image was not completed or not fully copied",
                             evidence={"image": image_dir}) from None
    try:
        expected = json.loads(data, parse_constant=no_constant)["manifest_sha256"]
        if not isinstance(expected, str):
            raise TypeError("manifest_sha256 is not a string")
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:MAX_DETAIL]
        raise SnapguardError(Reason.IMAGE_CORRUPT,
                             f"completion marker {os.path.join(image_dir, MARKER_NAME)} is unreadable: {detail}",
                             evidence={"image": image_dir}) from None
    return expected


def _read_manifest(dir_fd: int, image_dir: str) -> Manifest:
    expected = _read_marker(dir_fd, image_dir)
    manifest_path = os.path.join(image_dir, MANIFEST_NAME)
    try:
        data = read_member(dir_fd, MANIFEST_NAME, MAX_MANIFEST_BYTES, image_dir, Reason.MANIFEST_INVALID)
    except FileNotFoundError:
        raise invalid(f"{manifest_path} is missing", image_dir) from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"{MANIFEST_NAME} does not match the completion marker",
                             evidence={"image": image_dir, "path": manifest_path})
    try:
        manifest = json.loads(data, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:
        detail = " ".join(str(e).split())[:MAX_DETAIL] or type(e).__name__
        raise invalid(f"{manifest_path} is not JSON: {detail}", image_dir) from None
    return Manifest.from_json(manifest, image_dir)


def _check_files(dir_fd: int, image_dir: str, files: dict[str, FileEntry]
                 ) -> dict[str, tuple[int, tuple[int, int]]]:
    """Each listed file: a regular file of root's with the recorded size. {name: (size, ident)}."""
    checked = {}
    for name, entry in files.items():
        evidence = {"image": image_dir, "path": os.path.join(image_dir, name)}
        try:
            fd, st = open_regular(dir_fd, name)
        except NotRegular as e:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {show(name)} is {e.kind}, not a regular file",
                                 evidence=evidence) from None
        except FileNotFoundError:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {show(name)} is missing",
                                 evidence=evidence) from None
        except (OSError, ValueError) as e:  # ValueError: a name the file system cannot encode
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {show(name)} cannot be opened: "
                                 f"{getattr(e, 'strerror', None) or type(e).__name__}", evidence=evidence) from None
        os.close(fd)
        why = untrusted(st)
        if why:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"image file {show(name)} {why}", evidence=evidence)
        if st.st_size != entry.size:
            raise SnapguardError(Reason.IMAGE_CORRUPT,
                                 f"image file {show(name)} has size {st.st_size}, manifest says {entry.size}",
                                 evidence=evidence)
        checked[name] = (st.st_size, (st.st_dev, st.st_ino))
    return checked


def _check_unlisted(dir_fd: int, image_dir: str, files: dict[str, FileEntry]) -> None:
    """Nothing the manifest does not list, but for snapguard's own and temporary names; those must
    be regular files of root's too (CRIU and snapguard write restore.log and the like in place)."""
    try:
        names = sorted(os.listdir(dir_fd))
    except OSError as e:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"cannot list image directory {image_dir}: {e.strerror}",
                             evidence={"image": image_dir}) from None
    for name in names:
        if name in files:
            continue
        evidence = {"image": image_dir, "path": os.path.join(image_dir, name)}
        if not not_image(name):
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image directory holds {show(name)}, which the manifest "
                                 "does not list: CRIU would read it", evidence=evidence)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"{show(name)} in the image: {e.strerror}",
                                 evidence=evidence) from None
        if not stat.S_ISREG(st.st_mode):
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"{show(name)} in the image is {kind(st.st_mode)}, not "
                                 "a regular file: a restore would write through it", evidence=evidence)
        why = untrusted(st)
        if why:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"{show(name)} in the image {why}", evidence=evidence)


class Inspected:
    """An image whose marker, manifest, file types, owners and sizes were checked, its digests not
    yet (`check_digests`): a restore of a workload held at its take point hashes the image while
    CRIU reads it and ends the restored copy before releasing it when a digest differs."""

    def __init__(self, image_dir: str, manifest: Manifest, pending: dict[str, tuple[int, tuple[int, int]]],
                 known: dict[str, str]) -> None:
        self.image_dir, self.manifest, self.pending, self.known = image_dir, manifest, pending, known

    def read_ahead(self, max_file_bytes: int) -> tuple[int, int]:
        """Every image file of at most `max_file_bytes` (CRIU's small files: its process tree,
        cores, memory maps, file tables) read into memory ahead of whoever reads the image next;
        (files, bytes). Nothing followed as a link; never raises."""
        names = self.manifest.file_names_up_to(max_file_bytes)
        try:
            dir_fd, _ = open_image_dir(self.image_dir)
        except (OSError, SnapguardError):
            return 0, 0
        try:
            return prefetch.willneed_at(dir_fd, names, wait=True)
        finally:
            os.close(dir_fd)

    def check_digests(self) -> None:
        """IMAGE_CORRUPT unless every file not yet verified has its manifest digest and is still
        the inode that was checked."""
        files = self.manifest.files
        if not self.pending:
            return
        dir_fd, _ = open_image_dir(self.image_dir)
        try:
            digests = hash_all(dir_fd, self.pending)
        except Changed as e:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {show(e.name)} was replaced while it was "
                                 "being verified", evidence={"image": self.image_dir,
                                                             "path": os.path.join(self.image_dir, e.name)}) from None
        except OSError as e:
            name = e.filename if isinstance(e.filename, str) else "?"
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {show(name)} cannot be read: {e.strerror}",
                                 evidence={"image": self.image_dir,
                                           "path": os.path.join(self.image_dir, name)}) from None
        finally:
            os.close(dir_fd)
        for name, digest in digests.items():
            if digest != files[name].sha256:
                raise SnapguardError(Reason.IMAGE_CORRUPT,
                                     f"image file {show(name)} has sha256 {digest[:16]}..., manifest says "
                                     f"{files[name].sha256[:16]}...",
                                     evidence={"image": self.image_dir, "path": os.path.join(self.image_dir, name),
                                               "expected": files[name].sha256, "actual": digest})


def inspect(image_dir: str, verified: Verified | None = None) -> Inspected:
    """Every check of `verify` but the digests of files not in `verified` (see verify)."""
    dir_fd, _ = open_image_dir(image_dir)
    try:
        manifest = _read_manifest(dir_fd, image_dir)
        files = manifest.files
        checked = _check_files(dir_fd, image_dir, files)
        _check_unlisted(dir_fd, image_dir, files)
    finally:
        os.close(dir_fd)
    known = {name: digest for name, (digest, ident) in (verified or {}).items()
             if name in checked and checked[name][1] == ident and digest == files[name].sha256}
    return Inspected(image_dir, manifest, {n: v for n, v in checked.items() if n not in known}, known)


def verify(image_dir: str, verified: Verified | None = None) -> Manifest:
    """Refuse an untrusted, incomplete, corrupt or invalid image; return its validated manifest.

    `verified`: {name: (digest, (st_dev, st_ino))} that this process computed while it wrote the
    file into a directory it made root-only (a store's pull checks every span as it arrives). Such a
    file, while it is the same inode and its digest is the manifest's, is not read a second time;
    its type, owner, size, the unlisted files and the manifest against the marker still are."""
    found = inspect(image_dir, verified)
    found.check_digests()
    return found.manifest
