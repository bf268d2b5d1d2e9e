"""A pull: an image fetched from a store into a new private directory, every byte verified
against the manifest as it arrives, the local completion marker written last."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Any, Callable, Protocol

from .. import image, trust
from ..files import write_private_bytes
from ..names import MANIFEST_NAME, MARKER_NAME
from ..reasons import Reason, SnapguardError
from . import _exchange, _json
from ._digest import combine
from ._members import check_member
from ._records import ImageRef, Progress, Pulled, check_name

__all__ = ["pull"]

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Store(Protocol):
    """What a pull needs of snapguard.store's Store: its URL and its read primitives."""

    url: str

    def _get(self, key: str, cap: int = ...) -> bytes | None: ...

    def _list(self, prefix: str) -> list[str]: ...

    def _download(self, key: str, size: int, out_fd: int, progress: Progress) -> list[bytes]: ...

    def _record(self, job: str, name: str) -> dict[str, Any]: ...


def _make_dest(dest: str) -> str:
    """A new or empty directory of root's alone for a pulled image."""
    try:
        path = trust.make_private_dir(os.path.abspath(dest))
    except trust.UntrustedPathError as e:
        raise SnapguardError(Reason.UNTRUSTED_PATH, str(e), evidence={"path": e.path}) from None
    if os.listdir(path):
        raise SnapguardError(Reason.USAGE_ERROR, f"{path} is not empty: an image is pulled into a new or empty "
                             "directory", evidence={"path": path})
    return path


def _sealed(store: Store, ref: ImageRef, prefix: str) -> tuple[bytes, bytes, dict[str, Any]]:
    """The image's marker, its manifest's bytes, and the manifest, checked against each other."""
    marker = store._get(prefix + MARKER_NAME, _json.MAX_MARKER_BYTES)
    if marker is None:
        what = "is incomplete (its upload was interrupted or failed)" if store._list(prefix) else "does not exist"
        raise SnapguardError(Reason.UPLOAD_INCOMPLETE if store._list(prefix) else Reason.IMAGE_INCOMPLETE,
                             f"image {ref.name} of job {ref.job} in {store.url} {what}: it has no "
                             f"{MARKER_NAME}", evidence={"store": store.url, "image": ref.url})
    expected = _json.load_record(marker, _json.MARKER, prefix + MARKER_NAME, cap=_json.MAX_MARKER_BYTES,
                                 evidence={"store": store.url, "image": ref.url})["manifest_sha256"]
    manifest_bytes = store._get(prefix + MANIFEST_NAME, image.MAX_MANIFEST_BYTES)
    if manifest_bytes is None or hashlib.sha256(manifest_bytes).hexdigest() != expected:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"the manifest of {ref.url} is missing or does not match "
                             "its completion marker", evidence={"image": ref.url})
    try:
        manifest = json.loads(manifest_bytes, parse_constant=_json.no_constant)
    except (ValueError, RecursionError):
        raise SnapguardError(Reason.MANIFEST_INVALID, f"the manifest of {ref.url} is not JSON",
                             evidence={"image": ref.url}) from None
    manifest = image.validate_manifest(manifest, ref.url)
    for fname in manifest["files"]:
        check_member(fname)
    return marker, manifest_bytes, manifest


def _fetch(store: Store, ref: ImageRef, prefix: str, fname: str, entry: dict[str, Any], dir_fd: int,
           progress: Progress, durable: bool) -> str:
    """One image file into `dir_fd`, verified; its digest."""
    # read and write: a store may copy into a mapping of it (FileStore)
    fd = os.open(fname, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        digest = combine(store._download(prefix + fname, entry["size"], fd, progress))
        if os.fstat(fd).st_size != entry["size"]:
            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {fname} of {ref.url} has "
                                 f"{os.fstat(fd).st_size} bytes, manifest says {entry['size']}",
                                 evidence={"image": ref.url, "path": fname})
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    if digest != entry["sha256"]:
        raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {fname} of {ref.url} has sha256 "
                             f"{digest[:16]}..., manifest says {entry['sha256'][:16]}...",
                             evidence={"image": ref.url, "path": fname, "expected": entry["sha256"],
                                       "actual": digest})
    return digest


def pull(store: Store, ref: ImageRef, dest: str, progress: Progress,
         check_manifest: Callable[[dict[str, Any]], None] | None, durable: bool) -> Pulled:
    """Store.pull's work (its docstring says what it does)."""
    prefix = f"{check_name('job', ref.job)}/images/{check_name('image', ref.name)}/"
    t0 = time.monotonic()
    marker, manifest_bytes, manifest = _sealed(store, ref, prefix)
    files: dict[str, dict[str, Any]] = manifest["files"]
    if check_manifest is not None:
        check_manifest(manifest)
    record = store._record(ref.job, ref.name)
    dest = _make_dest(dest)
    dir_fd = os.open(dest, _O_DIR)
    digests: dict[str, str] = {}
    total = sum(int(e["size"]) for e in files.values())
    progress.start(total, f"pull {ref.job}/{ref.name}")
    _exchange.by_size(total, f"pull {ref.job}/{ref.name}")
    try:
        for fname, entry in sorted(files.items()):
            digests[fname] = _fetch(store, ref, prefix, fname, entry, dir_fd, progress, durable)
        write_private_bytes(os.path.join(dest, MANIFEST_NAME), manifest_bytes)
        write_private_bytes(os.path.join(dest, MARKER_NAME), marker)  # last: the local copy is whole
    except BaseException:
        os.close(dir_fd)
        shutil.rmtree(dest, ignore_errors=True)
        raise
    os.close(dir_fd)
    progress.report(final=True)
    epoch = record.get("epoch")
    ref = ImageRef(store.url, ref.job, ref.name, True, epoch if isinstance(epoch, int) else None)
    return Pulled(ref, dest, manifest, digests, record, total, time.monotonic() - t0)
