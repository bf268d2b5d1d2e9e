"""Records of a job's snapshots published as OCI checkpoint images (the kubelet's path).

    <job>/published/<epoch, 12 digits>-<name>.json   reference HOST/REPO@DIGEST, digest, epoch, ...

A record is put create-only, after the image is in the registry (pushed and served by digest)
and after the job's fencing epoch is checked: a node whose epoch is stale (the job was restored
elsewhere since) is refused with FENCED and records nothing. Records are read back as the
untrusted input they are (snapguard.store._json: size cap, nesting bound, a JSON Schema); a bad
one is skipped, logged, and the next older one is used.

    record_published(store, PublishedImage(...))
    newest_published(store, job) -> PublishedImage | None
    newest_file_checkpoint_time(store, job) -> float | None   when its newest file checkpoint was registered
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from ..reasons import Reason, SnapguardError
from . import _fencing, _json
from ._records import check_name

__all__ = ["PUBLISHED", "PublishedImage", "newest_file_checkpoint_time", "newest_published", "record_published"]

_DIGEST = "^sha256:[0-9a-f]{64}$"
PUBLISHED: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "a published checkpoint image's record",
    "type": "object",
    "required": ["job", "epoch", "reference", "digest"],
    "properties": {
        "job": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
        "epoch": {"type": "integer", "minimum": 0},
        "reference": {"type": "string", "maxLength": 1024, "pattern": "^[^\\x00-\\x20@]+@sha256:[0-9a-f]{64}$"},
        "digest": {"type": "string", "pattern": _DIGEST},
        "container": {"type": "string", "maxLength": 253},
        "pod": {"type": "string", "maxLength": 253},
        "namespace": {"type": "string", "maxLength": 253},
        "size": {"type": "integer", "minimum": 0},
        "host": {"type": "string", "maxLength": 255},
        "time": {"type": "number", "minimum": 0},
    },
    "maxProperties": 32,
}


@dataclass(frozen=True)
class PublishedImage:
    """A job's snapshot as an OCI checkpoint image: `reference` (HOST/REPO@DIGEST) is what the
    replacement pod's container names as its image."""

    job: str
    epoch: int
    reference: str
    digest: str
    container: str = ""
    pod: str = ""
    namespace: str = ""
    size: int = 0
    host: str = ""
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _key(job: str, epoch: int, digest: str) -> str:
    return f"{check_name('job', job)}/published/{epoch:012d}-{digest.split(':', 1)[1][:16]}.json"


def record_published(store: Any, published: PublishedImage) -> str:
    """Put the record (create-only) after checking the job's epoch; its key. FENCED when a newer
    epoch exists; STORE_UNREACHABLE when the same record exists already."""
    if not re.match(_DIGEST, published.digest) or not published.reference.endswith("@" + published.digest):
        raise SnapguardError(Reason.USAGE_ERROR, f"reference {published.reference[:200]} does not name digest "
                             f"{published.digest[:80]}")
    _fencing.check_epoch(store, published.job, published.epoch)
    key = _key(published.job, published.epoch, published.digest)
    _json.load_record(json.dumps(published.to_json()).encode(), PUBLISHED, key)  # what we write, we could read
    if not store._put_new(key, json.dumps(published.to_json(), sort_keys=True).encode()):
        raise SnapguardError(Reason.STORE_UNREACHABLE, f"{store.url}: {key} exists already",
                             evidence={"store": store.url, "key": key})
    return key


def newest_published(store: Any, job: str) -> PublishedImage | None:
    """The published image of the job's highest epoch whose record is good (None: none is)."""
    prefix = f"{check_name('job', job)}/published/"
    keys = sorted(k for k in store._list(prefix) if k.endswith(".json"))
    for key in reversed(keys):
        try:
            record = _json.read_record(store, key, PUBLISHED)
        except SnapguardError as e:
            if e.reason is not Reason.STORE_RECORD_INVALID:
                raise
            _json.log.warning("%s: published image record skipped: %s", store.url, e)
            continue
        if record is None:
            continue
        if record["job"] != job or not record["reference"].endswith("@" + record["digest"]):
            _json.log.warning("%s: published image record %s skipped: not this job's or digest not in the reference",
                              store.url, key)
            continue
        return PublishedImage(**{k: record[k] for k in record if k in PublishedImage.__dataclass_fields__})
    return None


def _name_time(name: str) -> float | None:
    """The time in a record's name (snapguard.store._records.new_image_name: %Y%m%dT%H%M%S.uuuuuuZ)."""
    import calendar
    import time

    m = re.match(r"(\d{8}T\d{6})\.(\d{6})Z", name)
    if not m:
        return None
    try:
        return calendar.timegm(time.strptime(m.group(1), "%Y%m%dT%H%M%S")) + int(m.group(2)) / 1e6
    except ValueError:
        return None


def newest_file_checkpoint_time(store: Any, job: str) -> float | None:
    """When the job's newest file checkpoint was registered (epoch seconds), None when it has
    none that the store's own check of the records accepts: a record's name is the time it was
    registered (the store names records so that they sort by time)."""
    prefix = f"{check_name('job', job)}/file-checkpoints/"
    if store.newest_file_checkpoint(job) is None:
        return None
    known = [t for t in (_name_time(k[len(prefix):]) for k in store._list(prefix) if k.endswith(".json"))
             if t is not None]
    return max(known) if known else None
