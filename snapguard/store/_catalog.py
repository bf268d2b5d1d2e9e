"""What a store holds, image by image, for `snapguard images` and `snapguard inspect URL`.

Everything here is read from the store and so untrusted: the store record through its schema
(snapguard.store._json), the manifest through the image's own (image.Manifest.from_json). A
record or manifest that fails is reported on the image (`invalid`), never raised, so one bad
image never hides the others. An image is `superseded` when the job's current fencing epoch is
newer than the one it was pushed under: the job was restored since, and restoring this image
again is ALREADY_RESTORED unless forced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import image
from ..names import MANIFEST_NAME
from ..reasons import Reason, SnapguardError
from . import _json
from ._base import _SMALL_CAP, Store
from ._records import ImageRef, check_name

__all__ = ["StoredImage", "catalog", "split_image_url", "stored_image"]

_MANIFEST_JSON = {"title": "a manifest", "type": "object"}  # the image schema checks the rest


@dataclass(frozen=True)
class StoredImage:
    """One image in a store: its ref, its store record ({} when it has none), its manifest (None
    when it is absent or invalid: `invalid` says why), and whether a newer epoch superseded it."""

    ref: ImageRef
    record: dict[str, Any]
    manifest: image.Manifest | None
    superseded: bool
    current_epoch: int
    invalid: str | None = None

    @property
    def size(self) -> int | None:
        if isinstance(self.record.get("image_bytes"), int):
            return int(self.record["image_bytes"])
        return self.manifest.image_bytes if self.manifest else None

    @property
    def time(self) -> float | None:
        t = self.record.get("time")
        return float(t) if isinstance(t, (int, float)) else (self.manifest.epoch if self.manifest else None)

    @property
    def host(self) -> str | None:
        return self.record.get("host") or (self.manifest.host.hostname if self.manifest else None)


def _describe(store: Store, ref: ImageRef, current: int) -> StoredImage:
    prefix = f"{ref.job}/images/{ref.name}/"
    record: dict[str, Any] = {}
    manifest = None
    invalid = ref.invalid
    try:
        record = store._record(ref.job, ref.name) if ref.complete else {}
        data = store._get(prefix + MANIFEST_NAME, _SMALL_CAP)
        if data is not None:
            doc = _json.load_record(data, _MANIFEST_JSON, prefix + MANIFEST_NAME, cap=_SMALL_CAP)
            manifest = image.Manifest.from_json(doc, ref.url)
        elif ref.complete:
            invalid = invalid or f"{prefix + MANIFEST_NAME}: missing"
    except SnapguardError as e:
        if e.reason not in (Reason.STORE_RECORD_INVALID, Reason.MANIFEST_INVALID, Reason.IMAGE_CORRUPT):
            raise
        invalid = e.failure.message
    epoch = ref.epoch if ref.epoch is not None else record.get("epoch")
    superseded = isinstance(epoch, int) and epoch < current
    return StoredImage(ref, record, manifest, superseded, current, invalid)


def catalog(store: Store, job: str | None = None, *, whole_only: bool = False) -> list[StoredImage]:
    """The store's images (of `job`, or of every job), by job then oldest first; unmarked ones
    too unless `whole_only`."""
    out = []
    for j in [check_name("job", job)] if job else store.jobs():
        current = store.current_epoch(j)
        out += [_describe(store, ref, current) for ref in store.images(j, whole_only=whole_only)]
    return out


def stored_image(store: Store, job: str, name: str) -> StoredImage:
    """One image of the store, IMAGE_INCOMPLETE when the store has no such image."""
    for ref in store.images(check_name("job", job), whole_only=False):
        if ref.name == check_name("image", name):
            return _describe(store, ref, store.current_epoch(job))
    raise SnapguardError(Reason.STORE_JOB_NOT_FOUND, f"store {store.url} has no image {name} of job {job}",
                         evidence={"store": store.url, "job": job, "image": name})


def split_image_url(url: str) -> tuple[str, str, str]:
    """An image's URL (ImageRef.url: STORE/JOB/images/NAME) as (store URL, job, name)."""
    head, sep, name = url.rstrip("/").rpartition("/images/")
    store_url, _, job = head.rpartition("/")
    if not sep or not store_url or "/" in name or not job:
        raise SnapguardError(Reason.USAGE_ERROR, f"{url[:200]}: not an image URL (STORE_URL/JOB/images/NAME, as "
                             "`snapguard images` prints it)")
    return store_url, check_name("job", job), check_name("image", name)
