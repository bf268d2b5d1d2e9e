"""Sealing an image at checkpoint: every file tightened to root alone (0600) and hashed, the
manifest written, and last the completion marker holding the manifest's sha256.

Nothing is followed as a link: the directory is opened once (O_NOFOLLOW) and every file through
it; a symlink, FIFO, device, socket, subdirectory or another user's file refuses the seal.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from typing import Any

from .. import __version__, files
from ..names import MANIFEST_NAME, MARKER_NAME
from ..reasons import Reason, SnapguardError
from ._io import MAX_FILES, O_DIR, Changed, NotRegular, not_image, open_regular, show, untrusted
from .hashing import SpanDigests, hash_all
from .manifest import SCHEMA

__all__ = ["seal"]


def _refused(image_dir: str, detail: str, name: str | None = None) -> SnapguardError:
    evidence = {"image": image_dir}
    if name is not None:
        evidence["path"] = os.path.join(image_dir, name)
    return SnapguardError(Reason.IMAGE_WRITE_FAILED, detail, evidence=evidence)


def _open_dir(image_dir: str) -> int:
    try:
        dir_fd = os.open(image_dir, O_DIR)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP) and os.path.islink(image_dir):
            raise _refused(image_dir, f"image directory {image_dir} is a symlink: snapguard never "
                           "follows one") from None
        raise
    try:
        why = untrusted(os.fstat(dir_fd))
        if why:
            raise _refused(image_dir, f"image directory {image_dir} {why}: others could have "
                           "planted or could change what is sealed")
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def _files(dir_fd: int, image_dir: str) -> dict[str, tuple[int, tuple[int, int]]]:
    """{name: (size, (st_dev, st_ino))} of the image's files, each tightened to 0600 through its
    own descriptor. Every entry must be a regular file of root's with one link, or sealing is
    refused: chmod-ing or hashing through a planted link would act on a file outside the image."""
    found: dict[str, tuple[int, tuple[int, int]]] = {}
    for name in sorted(os.listdir(dir_fd)):
        try:
            fd, st = open_regular(dir_fd, name)
        except NotRegular as e:
            raise _refused(image_dir, f"{show(name)} in image {image_dir} is {e.kind}: an image holds "
                           "regular files only, refusing to seal it", name) from None
        try:
            if st.st_uid not in (0, os.geteuid()):
                raise _refused(image_dir, f"image file {show(name)} in {image_dir} is owned by uid "
                               f"{st.st_uid}, not root", name)
            if st.st_nlink != 1:
                raise _refused(image_dir, f"image file {show(name)} in {image_dir} has {st.st_nlink} hard "
                               "links: it may be a file outside the image", name)
            if not_image(name):
                continue
            # CRIU writes its images 0644; they hold process memory.
            os.fchmod(fd, 0o600)
            found[name] = (st.st_size, (st.st_dev, st.st_ino))
        finally:
            os.close(fd)
    if len(found) > MAX_FILES:
        raise _refused(image_dir, f"image {image_dir} has {len(found)} files, more than {MAX_FILES}")
    return found


def _write(dir_fd: int, name: str, data: bytes) -> None:
    """`data` to `name` in the image, 0600, atomically (a new temporary file, never an existing
    one or a link; a rename replaces a symlink, never writes through it)."""
    files.write_atomic(name, data, dir_fd=dir_fd, exclusive_tmp=True)


def seal(image_dir: str, fields: dict[str, Any], known: SpanDigests | None = None) -> dict[str, Any]:
    """Tighten the image to root alone, hash it, write the manifest, then the completion marker;
    the manifest's JSON as written. `known`: spans hashed while the image was written
    (PageFileHasher.finish()).

    An OSError propagates as such; an image that must not be sealed (a symlink, FIFO, device,
    socket or directory in it, a file of another user's) raises SnapguardError(IMAGE_WRITE_FAILED).
    """
    dir_fd = _open_dir(image_dir)
    try:
        found = _files(dir_fd, image_dir)
        try:
            # a marker left from an earlier seal must not vouch for a seal that fails half way
            os.unlink(MARKER_NAME, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        try:
            digests = hash_all(dir_fd, found, known)
        except Changed as e:
            raise _refused(image_dir, f"image file {show(e.name)} in {image_dir} was replaced while it "
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
        _write(dir_fd, MANIFEST_NAME, data)
        marker = {"manifest_sha256": hashlib.sha256(data).hexdigest(), "schema": SCHEMA}
        _write(dir_fd, MARKER_NAME, (json.dumps(marker, indent=2, sort_keys=True) + "\n").encode())
    finally:
        os.close(dir_fd)
    return manifest
