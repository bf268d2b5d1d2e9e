"""Which checkpoint image, if any, a replacement pod of a job restores from: the webhook's one
question to the image store, behind a small interface (`SnapshotSource`).

A job's pod restores from its snapshot only when all of these hold, else it starts as written,
from the job's file checkpoint:
  - the job has a snapshot published as a checkpoint image (the kubelet path's record in the
    store, put only once the image is whole in the registry and served by its digest: a
    registry reference by digest and the epoch it was taken under, `CheckpointImage`),
  - it is newer than the job's newest file checkpoint (a file checkpoint written after the
    snapshot holds later state),
  - and it is not yet restored: the job's current epoch is still the image's (a restore takes the
    next one; an image restored under a newer epoch would start a second copy of a running job).
The pod's restore attempt then runs under the next epoch (`Restorable.attempt_epoch`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..reasons import Reason, SnapguardError

__all__ = ["DIGEST", "CheckpointImage", "Restorable", "SnapshotSource", "StoreSnapshots"]

DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
# registry[:port]/path@sha256:<hex>, as a pod's image field takes it
_BY_DIGEST = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?(/[a-z0-9]+([._-]+[a-z0-9]+)*)+@sha256:[0-9a-f]{64}\Z")


@dataclass(frozen=True)
class CheckpointImage:
    """One snapshot of a job published as a checkpoint image: `reference` the image by digest
    (registry/repository@sha256:...), `epoch` the fencing epoch it was taken under, `snapshot` the
    store's name of the image, `container` the pod's container it was taken from (None: the
    pod's first), `time` when it was taken (seconds since the epoch; None: unknown)."""

    reference: str
    digest: str
    epoch: int
    snapshot: str = ""
    container: str | None = None
    time: float | None = None

    def check(self) -> CheckpointImage:
        """Itself, or STORE_RECORD_INVALID: the record comes from the store, untrusted."""
        if not DIGEST.match(self.digest or "") or not _BY_DIGEST.match(self.reference or "") \
                or not self.reference.endswith("@" + self.digest):
            raise SnapguardError(Reason.STORE_RECORD_INVALID, f"checkpoint image {str(self.reference)[:160]!r} is "
                                 "not a registry reference by its sha256 digest")
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 0:
            raise SnapguardError(Reason.STORE_RECORD_INVALID, f"checkpoint image epoch {self.epoch!r} is not a count")
        return self


@dataclass(frozen=True)
class Restorable:
    """The answer for one job: `image` to restore from and the attempt's epoch, or None and why not."""

    image: CheckpointImage | None
    attempt_epoch: int | None = None
    why_not: str = ""


class SnapshotSource(Protocol):
    """What the webhook asks: the job's restorable snapshot (raises SnapguardError when it cannot tell)."""

    def restorable(self, job: str) -> Restorable: ...


# (store, job) -> the job's newest published checkpoint image, or None
PublishedLookup = Callable[[Any, str], "CheckpointImage | None"]
# (store, job) -> when the job's newest file checkpoint was written (None: it has none)
FileCheckpointTime = Callable[[Any, str], "float | None"]


def file_checkpoint_time(store: Any, job: str) -> float | None:
    """When the job's newest file checkpoint was registered (snapguard.store's
    newest_file_checkpoint_time)."""
    from ..store import newest_file_checkpoint_time

    return newest_file_checkpoint_time(store, job)


class StoreSnapshots:
    """SnapshotSource over a snapguard.store Store. `published(store, job)` reads the job's newest
    published checkpoint image (default: the kubelet path's record, snapguard.store's
    newest_published); `file_time(store, job)` the newest file checkpoint's time."""

    def __init__(self, store: Any, published: PublishedLookup | None = None,
                 file_time: FileCheckpointTime = file_checkpoint_time) -> None:
        self.store, self.published, self.file_time = store, published or published_in_store, file_time

    def restorable(self, job: str) -> Restorable:
        found = self.published(self.store, job)
        if found is None:
            return Restorable(None, why_not=f"job {job} has no snapshot published as a checkpoint image in "
                              f"{self.store.url}")
        image = found.check()
        file_time = self.file_time(self.store, job)
        if file_time is not None and (image.time is None or file_time >= image.time):
            return Restorable(None, why_not=f"job {job}'s file checkpoint is newer than its snapshot {image.snapshot}")
        current = self.store.current_epoch(job)
        if current != image.epoch:
            return Restorable(None, why_not=f"snapshot {image.snapshot} of job {job} (epoch {image.epoch}) is "
                              f"superseded: the job is at epoch {current}, restored since")
        return Restorable(image, attempt_epoch=current + 1)


def published_in_store(store: Any, job: str) -> CheckpointImage | None:
    """The job's newest checkpoint image the agent's kubelet path recorded in the store
    (snapguard.store.newest_published: its records are schema-checked there, a bad one skipped)."""
    from ..store import newest_published

    found = newest_published(store, job)
    if found is None:
        return None
    return CheckpointImage(reference=found.reference, digest=found.digest, epoch=found.epoch,
                           snapshot=f"{found.digest[7:19]} of epoch {found.epoch}", container=found.container or None,
                           time=found.time or None)
