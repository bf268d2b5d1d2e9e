"""The files of a sealed image, as the stores read them: every name from a manifest checked as one
plain component, every file opened without following links and checked against its entry."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Any

from .. import image
from ..names import MANIFEST_NAME, MARKER_NAME, NOT_IMAGE_FILES
from ..reasons import Reason, SnapguardError
from ._digest import combine
from ._json import no_constant

__all__ = ["STORE_RECORD", "check_member", "confirm_members", "open_member", "read_sealed", "read_span",
           "upload_member"]

STORE_RECORD = "snapguard-store.json"
_SMALL_CAP = image.MAX_MANIFEST_BYTES  # the largest manifest an image may hold
_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def upload_member(store: Any, dir_fd: int, image_dir: str, prefix: str, fname: str, entry: dict[str, Any],
                   progress: Any) -> None:
    """Upload one sealed image file, verified against its manifest entry as it is read."""
    fd = open_member(dir_fd, image_dir, fname, entry["size"])
    try:
        digest = combine(store._upload(prefix + fname, fd, entry["size"], progress))
    finally:
        os.close(fd)
    if digest != entry["sha256"]:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {fname} in {image_dir} has sha256 {digest[:16]}..., "
                             f"manifest says {entry['sha256'][:16]}...: not uploaded",
                             evidence={"image": image_dir, "path": fname})


def confirm_members(store: Any, prefix: str, manifest_bytes: bytes, record_size: int) -> None:
    """Before an image's marker: every file the manifest lists, the manifest and the store record
    are in the store under `prefix`, each of the size put where the store lists sizes
    (`store._stored`). A store that answered a put without keeping it is STORE_WRITE_UNCONFIRMED,
    and the image is never marked."""
    files = json.loads(manifest_bytes)["files"]  # this node's own sealed manifest, validated already
    want = {prefix + f: int(e["size"]) for f, e in files.items()}
    want[prefix + MANIFEST_NAME] = len(manifest_bytes)
    want[prefix + STORE_RECORD] = record_size
    stored = store._stored(prefix)
    for key, size in sorted(want.items()):
        if key not in stored:
            raise SnapguardError(Reason.STORE_WRITE_UNCONFIRMED, f"{store.url}: {key} is not in the store although "
                                 "its upload was answered as done", evidence={"store": store.url, "key": key})
        got = stored[key]
        if got is not None and got != size:
            raise SnapguardError(Reason.STORE_WRITE_UNCONFIRMED, f"{store.url}: {key} is in the store with {got} "
                                 f"bytes, {size} were put", evidence={"store": store.url, "key": key})


def check_member(name: Any) -> None:
    """A file name from a manifest that may come from anywhere: one plain component."""
    if (not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", "..")
            or name in NOT_IMAGE_FILES or name == STORE_RECORD or name.startswith(".tmp-")):
        raise SnapguardError(Reason.MANIFEST_INVALID, f"manifest lists {name!r}, which is not an image file name")


def read_small(dir_fd: int, name: str, cap: int) -> bytes | None:
    try:
        fd = os.open(name, _O_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"{name} is not a regular file of at most {cap} bytes")
        return os.read(fd, cap + 1)
    finally:
        os.close(fd)


def read_sealed(dir_fd: int, image_dir: str) -> tuple[bytes, bytes, dict[str, Any]]:
    """(marker, manifest bytes, validated manifest) of a local image, which must be whole."""
    marker = read_small(dir_fd, MARKER_NAME, 4096)
    if marker is None:
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"{image_dir} has no {MARKER_NAME}: not a whole image, "
                             "nothing pushed", evidence={"image": image_dir})
    manifest_bytes = read_small(dir_fd, MANIFEST_NAME, _SMALL_CAP) or b""
    try:
        expected = json.loads(marker, parse_constant=no_constant)["manifest_sha256"]
        manifest = json.loads(manifest_bytes, parse_constant=no_constant)
    except (ValueError, KeyError, TypeError, RecursionError):
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"marker or manifest of {image_dir} is unreadable",
                             evidence={"image": image_dir}) from None
    if hashlib.sha256(manifest_bytes).hexdigest() != expected:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"{MANIFEST_NAME} of {image_dir} does not match its marker",
                             evidence={"image": image_dir})
    return marker, manifest_bytes, image.validate_manifest(manifest, image_dir)


def read_span(fd: int, offset: int, length: int) -> bytes:
    """`length` bytes of fd at `offset` (one pread may return fewer); fewer only where the file
    ends, never an error: the span's digest then differs from the manifest's, which decides."""
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def open_member(dir_fd: int, image_dir: str, name: str, size: int) -> int:
    try:
        fd = os.open(name, _O_FILE, dir_fd=dir_fd)
    except OSError as e:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {name} in {image_dir}: {e.strerror}",
                             evidence={"image": image_dir, "path": name}) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {name} in {image_dir} is not a regular file of "
                             f"{size} bytes", evidence={"image": image_dir, "path": name})
    return fd
