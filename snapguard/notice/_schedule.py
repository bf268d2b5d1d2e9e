"""The agent's snapshot schedule for one notice: a node's workloads snapshotted concurrently
within the notice's lead, the ones that cannot finish in time falling back to their file
checkpoint.

Each workload is a `Target`: its key and job, its kind (`pid`, `container`, `pod` for the CRI
path), an estimate of its snapshot size (RSS of its process tree from procfs, plus the GPU memory
the registry names), the notice's deadline, and `run(seconds_left)`, which takes the snapshot and
returns None or the typed Failure it ended with.

Order: earliest deadline first, then the smallest estimate first (the most workloads fit in a
short lead). Estimate: `size / rate + STARTUP_S`, where `rate` is the per-snapshot rate the
journal last measured (image bytes over seconds of its most recent sealed snapshots), else
`DEFAULT_RATE_BPS`. A workload whose estimate does not fit in what is left of its deadline, less
`MARGIN_S`, when a worker is free for it is never started: it falls back to its file checkpoint
with NOTICE_TOO_SHORT. The check is made when a worker takes it, not once ahead, so a workload
that finished early leaves room for the next.

Pool: `pool_size`: one worker per CPU the agent may run on, at most one per workload and at most
`MAX_WORKERS`. A snapshot is CRIU copying pages (about one core each) and writing them to the
images directory or the store's stream; more snapshots than cores only slow each one, and the rate
the journal measures is per snapshot under the concurrency it ran with, so the estimate already
carries the store's and the disk's share.

The journal, per notice: `schedule` (the order, each estimate, the pool), per workload
`fell_back` (typed reason and the file checkpoint named) when it did not fit or failed, and
`schedule_done` (which fit and which fell back).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..reasons import Failure, Reason, failure_from

__all__ = ["DEFAULT_RATE_BPS", "MARGIN_S", "MAX_WORKERS", "STARTUP_S", "Outcome", "Target", "estimate_s",
           "measured_rate", "pool_size", "schedule"]

DEFAULT_RATE_BPS = 256 << 20  # a snapshot's pages to a local disk with no measurement yet: conservative
STARTUP_S = 0.5  # CRIU's start, the freeze, the seal: paid whatever the size
MARGIN_S = 1.0  # kept back from the deadline
MAX_WORKERS = 8
_RATE_SAMPLES = 5


@dataclass(frozen=True)
class Target:
    """One workload to snapshot for a notice."""

    key: str
    job: str
    kind: str
    size_bytes: int
    deadline: float | None  # wall clock (epoch seconds); None: the notice gives none
    run: Callable[[float | None], Failure | None] = field(repr=False, compare=False)
    fallback: Callable[[], str | None] = field(default=lambda: None, repr=False, compare=False)


@dataclass(frozen=True)
class Outcome:
    """What became of one Target: `snapshotted`, or `fell_back` with its typed reason."""

    key: str
    job: str
    status: str
    estimate_s: float
    reason: str | None = None
    message: str | None = None
    started: float | None = None
    seconds: float | None = None
    file_checkpoint: str | None = None


def estimate_s(size_bytes: int, rate_bps: float) -> float:
    return round(STARTUP_S + max(size_bytes, 0) / max(rate_bps, 1.0), 3)


def measured_rate(events: list[dict[str, Any]]) -> float | None:
    """Bytes per second of the journal's latest sealed snapshots (their median), or None."""
    rates = []
    for ev in reversed(events):
        if ev.get("event") != "snapshot_sealed":
            continue
        size, secs = ev.get("image_bytes"), ev.get("seconds")
        if (isinstance(size, int) and not isinstance(size, bool) and size > 0 and isinstance(secs, (int, float))
                and not isinstance(secs, bool) and math.isfinite(secs) and secs > STARTUP_S):
            rates.append(size / (secs - STARTUP_S))
            if len(rates) == _RATE_SAMPLES:
                break
    return sorted(rates)[len(rates) // 2] if rates else None


def pool_size(n_targets: int, cpus: int | None = None) -> int:
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    return max(1, min(n_targets, cpus, MAX_WORKERS))


def schedule(targets: list[Target], *, notice: str, journal: Callable[..., None], log: Callable[[str], None],
             rate_bps: float | None = None, workers: int | None = None,
             clock: Callable[[], float] = time.time) -> list[Outcome]:
    """Snapshot `targets` on a pool of `workers` (see the module's docstring); their Outcomes in
    the order scheduled."""
    rate = rate_bps or DEFAULT_RATE_BPS
    order = sorted(targets, key=lambda t: (t.deadline if t.deadline is not None else math.inf,
                                           estimate_s(t.size_bytes, rate), t.key))
    n = workers or pool_size(len(order))
    journal("schedule", notice=notice, workers=n, rate_bps=round(rate), measured=rate_bps is not None,
            order=[{"key": t.key, "job": t.job, "kind": t.kind, "size_bytes": t.size_bytes,
                    "estimate_s": estimate_s(t.size_bytes, rate), "deadline": t.deadline} for t in order])
    outcomes: dict[str, Outcome] = {}
    lock = threading.Lock()
    pending = list(order)

    def fell_back(t: Target, est: float, reason: Reason, message: str, **extra: Any) -> Outcome:
        try:
            fc = t.fallback()
        except Exception as e:  # the store's record of it unreadable: said, and no file checkpoint named
            fc = None
            message += f"; its file checkpoint could not be looked up ({failure_from(e).message})"
        journal("fell_back", notice=notice, key=t.key, job=t.job, reason=reason.name, message=message,
                file_checkpoint=fc, estimate_s=est, **extra)
        log(f"{t.key} (job {t.job}) falls back to its file checkpoint {fc or '(none registered)'}: "
            f"snapguard {reason.name}: {message}")
        return Outcome(t.key, t.job, "fell_back", est, reason.name, message, file_checkpoint=fc, **extra)

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                t = pending.pop(0)
            est = estimate_s(t.size_bytes, rate)
            now = clock()
            left = None if t.deadline is None else t.deadline - now
            if left is not None and est > left - MARGIN_S:
                out = fell_back(t, est, Reason.NOTICE_TOO_SHORT,
                                f"an estimated {est:.1f} s snapshot ({t.size_bytes >> 20} MiB at "
                                f"{rate / 2**20:.0f} MiB/s) does not fit the {max(left, 0):.1f} s left of the notice")
            else:
                start = time.monotonic()
                try:
                    failure = t.run(left)
                except Exception as e:  # a run that raised instead of returning its failure
                    failure = failure_from(e)
                took = round(time.monotonic() - start, 3)
                if failure is None:
                    out = Outcome(t.key, t.job, "snapshotted", est, started=now, seconds=took)
                else:
                    out = fell_back(t, est, failure.reason, failure.message, started=now, seconds=took)
            with lock:
                outcomes[t.key] = out

    threads = [threading.Thread(target=work, name=f"snapshot-{i}", daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    result = [outcomes[t.key] for t in order]
    journal("schedule_done", notice=notice, fit=[o.key for o in result if o.status == "snapshotted"],
            fell_back={o.key: o.reason for o in result if o.status == "fell_back"})
    return result
