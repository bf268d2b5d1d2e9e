"""Operations tallies: what snapshots, restores and notices did, kept across processes.

The executor (`snapguard-runc checkpoint/restore`, `snapguard checkpoint/restore`) and the agent
are short-lived or many: each adds what it did to one small JSON file under the state directory,
`<state_dir>/metrics/operations.json` (root's, 0600, written with files.write_atomic under an
flock of `operations.lock` beside it, so concurrent runs merge), and snapguard.metrics exports it
in Prometheus' conventions (the agent's `--metrics-port`, `snapguard metrics`' textfile).

What it holds, each bounded (a bad or oversized file is started afresh, never trusted):
    counts   {kind: {"outcome reason": n}}        kind snapshot or restore; outcome ok or failed
    seconds  {kind: [n per bucket of SECONDS_BUCKETS, sum]}
    bytes    {kind: [n per bucket of BYTES_BUCKETS, sum]}
    notices  {source: n}                          at most MAX_SOURCES
    whole    {job: unix time of its last whole snapshot}   the MAX_JOBS newest

Recording never raises and never blocks an operation for long (the lock is tried for a second).
"""

from __future__ import annotations

import fcntl
import functools
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .files import write_atomic
from .reasons import Reason, SnapguardError

__all__ = ["BYTES_BUCKETS", "KINDS", "SECONDS_BUCKETS", "counted", "load", "note", "path_for"]

KINDS = ("snapshot", "restore")
SECONDS_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, math.inf)
BYTES_BUCKETS = (float(1 << 20), float(16 << 20), float(128 << 20), float(1 << 30), float(8 << 30),
                 float(64 << 30), float(512 << 30), math.inf)
MAX_SOURCES = 32
MAX_JOBS = 256
MAX_LABEL = 128
MAX_FILE_BYTES = 256 << 10
_DEFAULT_STATE_DIR = "/run/snapguard"

F = TypeVar("F", bound=Callable[..., Any])


def path_for(state_dir: str) -> str:
    return os.path.join(state_dir, "metrics", "operations.json")


def _empty() -> dict[str, Any]:
    return {"counts": {}, "seconds": {}, "bytes": {}, "notices": {}, "whole": {}}


def _valid(doc: Any) -> bool:
    if not isinstance(doc, dict) or set(doc) != set(_empty()) or not all(isinstance(v, dict) for v in doc.values()):
        return False
    number = (int, float)
    for kind, by in doc["counts"].items():
        if kind not in KINDS or not isinstance(by, dict) or not all(
                isinstance(k, str) and len(k) <= MAX_LABEL and isinstance(n, int) and n >= 0 for k, n in by.items()):
            return False
    for part, buckets in (("seconds", SECONDS_BUCKETS), ("bytes", BYTES_BUCKETS)):
        for kind, h in doc[part].items():
            if kind not in KINDS or not isinstance(h, list) or len(h) != len(buckets) + 1 or not all(
                    isinstance(n, int) and n >= 0 for n in h[:-1]) or not isinstance(h[-1], number):
                return False
    return (len(doc["notices"]) <= MAX_SOURCES and len(doc["whole"]) <= MAX_JOBS
            and all(isinstance(k, str) and len(k) <= MAX_LABEL and isinstance(n, int) and n >= 0
                    for k, n in doc["notices"].items())
            and all(isinstance(k, str) and len(k) <= MAX_LABEL and isinstance(t, number)
                    for k, t in doc["whole"].items()))


def load(state_dir: str) -> dict[str, Any]:
    """The tallies of `state_dir` (empty when there are none, or what is there is not a tally
    file: too large, not JSON, the wrong shape)."""
    try:
        fd = os.open(path_for(state_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return _empty()
    try:
        data = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError:
        return _empty()
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        return _empty()
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return _empty()
    return doc if _valid(doc) else _empty()


def _label(text: str | None, default: str) -> str:
    text = str(text) if text else default
    return "".join(c if c.isalnum() or c in "-_.:/" else "_" for c in text)[:MAX_LABEL]


def _observe(h: list[Any] | None, buckets: tuple[float, ...], value: float) -> list[Any]:
    h = list(h) if h else [0] * len(buckets) + [0.0]
    for i, le in enumerate(buckets):
        if value <= le:
            h[i] += 1
            break
    h[-1] = round(float(h[-1]) + value, 6)
    return h


def _add(doc: dict[str, Any], kind: str | None, outcome: str | None, reason: str | None, seconds: float | None,
         size: float | None, source: str | None, job: str | None) -> None:
    if kind in KINDS:
        key = f"{_label(outcome, 'ok')} {_label(reason, 'none')}"
        by = doc["counts"].setdefault(kind, {})
        by[key] = by.get(key, 0) + 1
        if seconds is not None and seconds >= 0:
            doc["seconds"][kind] = _observe(doc["seconds"].get(kind), SECONDS_BUCKETS, float(seconds))
        if size is not None and size >= 0:
            doc["bytes"][kind] = _observe(doc["bytes"].get(kind), BYTES_BUCKETS, float(size))
    if source is not None:
        name = _label(source, "unknown")
        if name in doc["notices"] or len(doc["notices"]) < MAX_SOURCES:
            doc["notices"][name] = doc["notices"].get(name, 0) + 1
    if job is not None:
        whole = doc["whole"]
        whole[_label(job, "unknown")] = time.time()
        for old in sorted(whole, key=whole.__getitem__)[:max(0, len(whole) - MAX_JOBS)]:
            del whole[old]


def _state_dir(state_dir: str | None) -> str:
    return state_dir or os.environ.get("SNAPGUARD_STATE_DIR") or _DEFAULT_STATE_DIR


def note(*, state_dir: str | None = None, kind: str | None = None, outcome: str | None = None,
         reason: str | None = None, seconds: float | None = None, size: float | None = None,
         source: str | None = None, job: str | None = None) -> None:
    """Add one thing done to the tallies: a snapshot or restore (`kind`, `outcome`, `reason`,
    `seconds`, `size` in bytes), a notice seen from `source`, a whole snapshot of `job` now.
    Never raises: a tally that cannot be written is lost, the operation goes on."""
    try:
        d = os.path.join(_state_dir(state_dir), "metrics")
        os.makedirs(d, mode=0o700, exist_ok=True)
        lock = os.open(os.path.join(d, "operations.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600)
        try:
            deadline = time.monotonic() + 1.0
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.01)
            doc = load(os.path.dirname(d))
            _add(doc, kind, outcome, reason, seconds, size, source, job)
            write_atomic(path_for(os.path.dirname(d)), json.dumps(doc, sort_keys=True).encode())
        finally:
            os.close(lock)
    except Exception:  # noqa: BLE001 - a tally is never worth an operation
        pass


def _config_state_dir(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    for a in (*args, *kwargs.values()):
        d = getattr(a, "state_dir", None)
        if isinstance(d, str) and d:
            return d
    return None


def counted(kind: str) -> Callable[[F], F]:
    """A pipeline operation tallied as `kind`: its outcome (ok, or failed with the typed reason
    it raised), its seconds, and the image's bytes its result record names."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            state_dir = _config_state_dir(args, kwargs)
            try:
                result = fn(*args, **kwargs)
            except SnapguardError as e:
                note(state_dir=state_dir, kind=kind, outcome="failed", reason=e.reason.name,
                     seconds=time.monotonic() - start)
                raise
            except Exception:
                note(state_dir=state_dir, kind=kind, outcome="failed", reason=Reason.INTERNAL_ERROR.name,
                     seconds=time.monotonic() - start)
                raise
            size = result.get("image_bytes") if isinstance(result, dict) else None
            note(state_dir=state_dir, kind=kind, outcome="ok", seconds=time.monotonic() - start,
                 size=size if isinstance(size, (int, float)) else None)
            return result
        return run  # type: ignore[return-value]
    return wrap
