"""Fencing epochs: a restore of a job takes the next one, with a create-only put, as the last step
before CRIU restores it; a restore that then fails rolls its epoch back.

`<job>/epochs/<n>` exists once epoch n was taken (an attempt); `<job>/epochs/<n>-aborted` once
that attempt failed. The job's current epoch is the largest n taken and not aborted (0 when none:
the job's first run); a new attempt takes the largest n ever taken plus one, so an aborted number
is never reused. The rule:

- an attempt's epoch is taken only by a restore that passed every check (verification,
  preflight, host checks, device map) and is about to run CRIU; from then on it fences the old
  node (its pushes are refused FENCED);
- a restore that fails after taking it writes the abort record (create-only) before it returns:
  the live job's epoch is current again and its pushes go through; a restore killed before it
  could write it leaves the job fenced (the safe side), which an operator clears with `--force`;
- an image pushed under an epoch older than the current one was restored since: a restore of it
  is refused ALREADY_RESTORED (a second copy of a running job is never started) unless forced;
- of two restores racing, both list the epochs once and ask for the same number: a create-only
  put (O_EXCL link in a directory, S3 `If-None-Match: *`) has one winner, the loser is FENCED and
  starts nothing.

A writer (a snapshot push) holding epoch e is refused with FENCED when a newer epoch exists.
"""

from __future__ import annotations

# `store`: a snapguard.store Store (its primitives _put_new and _list); typed Any so that this module
# does not import the one that imports it

import json
import socket
import time
from typing import Any

from ..reasons import Reason, SnapguardError

__all__ = ["abort_epoch", "attempt_epoch", "check_epoch", "current_epoch", "epoch_key", "take_epoch"]

_TRIES = 64
_ABORTED = "-aborted"


def epoch_key(job: str, n: int) -> str:
    return f"{job}/epochs/{n:012d}"


def _epochs(store: Any, job: str) -> tuple[int, int]:
    """(current, taken) from one listing: the largest epoch not aborted, the largest ever taken."""
    prefix = f"{job}/epochs/"
    taken, aborted = set(), set()
    for k in store._list(prefix):
        rest = k[len(prefix):]
        if rest.isdigit():
            taken.add(int(rest))
        elif rest.endswith(_ABORTED) and rest[:-len(_ABORTED)].isdigit():
            aborted.add(int(rest[:-len(_ABORTED)]))
    return max(taken - aborted, default=0), max(taken, default=0)


def current_epoch(store: Any, job: str) -> int:
    return _epochs(store, job)[0]


def _note(note: dict[str, Any] | None) -> bytes:
    return json.dumps({"host": socket.gethostname(), "time": time.time(), **(note or {})}, sort_keys=True).encode()


def take_epoch(store: Any, job: str, expect: int | None = None, note: dict[str, Any] | None = None) -> int:
    """The next epoch of the job, created atomically. With `expect` (the current epoch this
    restore saw when it started) one number is tried, and only while the job is still at
    `expect`: otherwise another restore won, FENCED. Without, the next free number is taken,
    retrying past concurrent winners."""
    data = _note(note)
    if expect is not None:
        current, taken = _epochs(store, job)
        n = taken + 1
        if current == expect and store._put_new(epoch_key(job, n), data):
            return n
        raise SnapguardError(Reason.FENCED, f"job {job}: epoch {n} was taken by another restore since this one "
                             f"saw epoch {expect}; this node changes nothing",
                             evidence={"job": job, "wanted": n, "current": current_epoch(store, job),
                                       "store": store.url})
    for _ in range(_TRIES):
        n = _epochs(store, job)[1] + 1
        if store._put_new(epoch_key(job, n), data):
            return n
    raise SnapguardError(Reason.FENCED, f"job {job}: lost the race for a new epoch {_TRIES} times",
                         evidence={"job": job, "store": store.url})


def attempt_epoch(store: Any, job: str, image_epoch: int, *, force: bool = False,
                  note: dict[str, Any] | None = None) -> int:
    """A restore's attempt, about to run an image pushed under `image_epoch`: ALREADY_RESTORED
    when the job's current epoch is newer (unless `force`), else the next number, create-only
    from one listing (a racing restore that created it first: FENCED)."""
    current, taken = _epochs(store, job)
    if current > image_epoch and not force:
        raise SnapguardError(Reason.ALREADY_RESTORED, f"job {job} was restored under epoch {current} since this "
                             f"image's epoch {image_epoch}: a copy of it may be running; nothing was started "
                             "(restore --force starts one anyway, fencing that copy)",
                             evidence={"job": job, "image_epoch": image_epoch, "current": current,
                                       "store": store.url})
    n = taken + 1
    if store._put_new(epoch_key(job, n), _note({**(note or {}), "image_epoch": image_epoch, "force": force})):
        return n
    raise SnapguardError(Reason.FENCED, f"job {job}: another restore took epoch {n} first; this node started nothing",
                         evidence={"job": job, "wanted": n, "current": current_epoch(store, job),
                                   "store": store.url})


def abort_epoch(store: Any, job: str, n: int, why: str) -> bool:
    """Roll back attempt n (its restore failed): the job's current epoch is the one before it
    again. True when this call wrote the abort record."""
    return bool(store._put_new(epoch_key(job, n) + _ABORTED, _note({"why": why})))


def check_epoch(store: Any, job: str, epoch: int) -> None:
    current = current_epoch(store, job)
    if current > epoch:
        raise SnapguardError(Reason.FENCED, f"job {job} was restored under epoch {current} since this node's epoch "
                             f"{epoch}: its writes are refused", evidence={"job": job, "epoch": epoch,
                                                                           "current": current, "store": store.url})
