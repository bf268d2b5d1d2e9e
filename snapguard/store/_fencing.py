"""Fencing epochs: each restore of a job takes the next one with a create-only put.

`<job>/epochs/<n>` exists once epoch n is taken; the job's current epoch is the largest n (0 when
none was ever taken: the job's first run). A create-only put (O_EXCL link in a directory, S3
`If-None-Match: *`) has one winner, so two restores that both saw epoch c and both ask for c + 1
cannot both get it: the loser is FENCED and changes nothing. A writer (a snapshot push) holding
epoch e is refused with FENCED when a newer epoch exists: the job was restored elsewhere since.
"""

from __future__ import annotations

# `store`: a snapguard.store Store (its primitives _put_new and _list); typed Any so that this module
# does not import the one that imports it

import json
import socket
import time
from typing import Any

from ..reasons import Reason, SnapguardError

__all__ = ["check_epoch", "current_epoch", "epoch_key", "take_epoch"]

_TRIES = 64


def epoch_key(job: str, n: int) -> str:
    return f"{job}/epochs/{n:012d}"


def current_epoch(store: Any, job: str) -> int:
    prefix = f"{job}/epochs/"
    found = [int(k[len(prefix):]) for k in store._list(prefix) if k[len(prefix):].isdigit()]
    return max(found, default=0)


def take_epoch(store: Any, job: str, expect: int | None = None, note: dict[str, Any] | None = None) -> int:
    """The next epoch of the job, created atomically. With `expect` (the epoch this restore saw
    when it started) only expect + 1 is tried: taken already means another restore won, FENCED.
    Without, the next free number is taken, retrying past concurrent winners."""
    data = json.dumps({"host": socket.gethostname(), "time": time.time(), **(note or {})}, sort_keys=True).encode()
    if expect is not None:
        n = expect + 1
        if store._put_new(epoch_key(job, n), data):
            return n
        raise SnapguardError(Reason.FENCED, f"job {job}: epoch {n} was taken by another restore since this one "
                             f"saw epoch {expect}; this node changes nothing",
                             evidence={"job": job, "wanted": n, "current": current_epoch(store, job),
                                       "store": store.url})
    for _ in range(_TRIES):
        n = current_epoch(store, job) + 1
        if store._put_new(epoch_key(job, n), data):
            return n
    raise SnapguardError(Reason.FENCED, f"job {job}: lost the race for a new epoch {_TRIES} times",
                         evidence={"job": job, "store": store.url})


def check_epoch(store: Any, job: str, epoch: int) -> None:
    current = current_epoch(store, job)
    if current > epoch:
        raise SnapguardError(Reason.FENCED, f"job {job} was restored under epoch {current} since this node's epoch "
                             f"{epoch}: its writes are refused", evidence={"job": job, "epoch": epoch,
                                                                           "current": current, "store": store.url})
