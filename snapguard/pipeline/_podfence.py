"""A pod's restore through containerd, fenced by the epoch the webhook recorded on the pod.

When containerd creates a pod's container from a checkpoint image it calls `snapguard-runc
restore` with the bundle it wrote; the pod's annotations reach that bundle's config.json through
the runtime's `pod_annotations = ["snapguard.io/*"]` (what `snapguard install` writes). With
`snapguard.io/job` and `snapguard.io/epoch` there (the webhook's attempt epoch E for an image
taken under E - 1), the restore takes the job's next epoch in the image store named by
SNAPGUARD_STORE in containerd's environment (root's, never the pod's) as the last step before
runc's restore, through the store's fencing route (snapguard.store._fencing.attempt_epoch):

  - the job was restored since (its current epoch is E or newer): ALREADY_RESTORED, nothing started;
  - another restore took the next epoch first: FENCED, nothing started;
  - the restore fails after the epoch was taken: the epoch is rolled back (an abort record), so
    the live job stays unfenced, unless a restored tree could not be ended.

A pod with `snapguard.io/epoch` on a node whose containerd has no SNAPGUARD_STORE is refused
(USAGE_ERROR): the fence cannot be checked, and a second copy of a running job must not start.
A bundle without that annotation restores as before, unfenced.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..reasons import Reason, SnapguardError
from ._request import Request
from .restore import restore

__all__ = ["ANNOTATION_EPOCH", "ANNOTATION_JOB", "STORE_ENV", "PodFence", "pod_fence", "run_pod_fenced"]

ANNOTATION_JOB = "snapguard.io/job"
ANNOTATION_EPOCH = "snapguard.io/epoch"
STORE_ENV = "SNAPGUARD_STORE"
_MAX_SPEC = 4 << 20
_JOB = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")


@dataclass(frozen=True)
class PodFence:
    job: str
    epoch: int  # the attempt's, as the webhook recorded it
    store_url: str


def pod_fence(bundle: str | None) -> PodFence | None:
    """The fence a bundle's annotations ask for, None when they ask for none; USAGE_ERROR for an
    annotation that does not check or a node with no store to fence in."""
    path = os.path.join(bundle or os.getcwd(), "config.json")
    try:
        with open(path, "rb") as f:
            spec = json.loads(f.read(_MAX_SPEC + 1))
    except (OSError, ValueError):
        return None  # runc's own restore says what is wrong with its bundle
    ann = spec.get("annotations") if isinstance(spec, dict) else None
    if not isinstance(ann, dict) or ANNOTATION_EPOCH not in ann:
        return None
    job, epoch = ann.get(ANNOTATION_JOB), ann.get(ANNOTATION_EPOCH)
    if not isinstance(job, str) or not _JOB.match(job):
        raise SnapguardError(Reason.USAGE_ERROR, f"restore: {ANNOTATION_EPOCH} without a valid {ANNOTATION_JOB}")
    if not isinstance(epoch, str) or not epoch.isdigit() or len(epoch) > 12 or int(epoch) < 1:
        raise SnapguardError(Reason.USAGE_ERROR, f"restore: {ANNOTATION_EPOCH} {str(epoch)[:40]!r} is not an "
                             "attempt's epoch (1 or more)")
    url = os.environ.get(STORE_ENV, "").strip()
    if not url:
        raise SnapguardError(Reason.USAGE_ERROR, f"restore: the pod's {ANNOTATION_EPOCH} {epoch} cannot be fenced: "
                             f"containerd's environment names no image store ({STORE_ENV}); nothing was started",
                             evidence={"job": job})
    return PodFence(job, int(epoch), url)


class _PodFenced:
    """A runner whose restore first takes the job's epoch: the last step before runc's restore."""

    def __init__(self, inner: Any, store: Any, fence: PodFence) -> None:
        self._inner, self._store, self._fence = inner, store, fence
        self.taken: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def restore(self, req: Any, options: Any, env: dict[str, str]) -> int:
        self.taken = int(self._store.attempt_epoch(self._fence.job, self._fence.epoch - 1,
                                                   note={"pod_epoch": self._fence.epoch}))
        return int(self._inner.restore(req, options, env))


def run_pod_fenced(fence: PodFence, runner: Any, req: Request, config: Config) -> dict[str, Any]:
    """The restore sequence with the pod's epoch taken right before runc's restore and rolled
    back when the restore fails after it (the module's rules)."""
    from ..store import open_store

    store = open_store(fence.store_url)
    fenced = _PodFenced(runner, store, fence)
    try:
        result = restore(fenced, req, config)
    except Exception as e:
        lingers = isinstance(e, SnapguardError) and e.failure.evidence.get("restored_tree_ended") is False
        if fenced.taken is not None and not lingers:
            rolled = store.abort_epoch(fence.job, fenced.taken, why=str(e)[:500])
            if isinstance(e, SnapguardError):
                e.failure.evidence["epoch_rolled_back"] = {"epoch": fenced.taken, "written": rolled}
        raise
    result.update({"job": fence.job, "epoch": fenced.taken, "pod_epoch": fence.epoch})
    return result
