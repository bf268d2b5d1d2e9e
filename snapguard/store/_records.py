"""The store's records and names: image and job names it accepts, ImageRef (one image in a store),
Pulled (an image fetched into a local directory), and Progress (one transfer's bytes, rate, ETA)."""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable

from ..reasons import Reason, SnapguardError
from . import _exchange

__all__ = ["ImageRef", "Progress", "Pulled", "check_name", "new_image_name", "terminal_progress"]

log = logging.getLogger("snapguard.store")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise SnapguardError(Reason.USAGE_ERROR, f"{kind} name {name!r} is not one a store accepts "
                             "(letters, digits, '.', '_', '-'; at most 128)")
    return name


def new_image_name() -> str:
    """Sortable by time: the newest whole image is the last name."""
    t = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


class Progress:
    """Bytes moved, rate and ETA of one transfer: logged (logger snapguard.store, for the agent's
    log) and, given a stream (`--progress` on a terminal), drawn on one line. `deadline_s`: past it
    the next update raises STORE_TOO_SLOW; a push or pull given this Progress is bound by it as a
    whole (snapguard.store._exchange). `callback(dict)` is called on every report."""

    def __init__(self, total: int = 0, *, label: str = "", stream: IO[str] | None = None,
                 interval_s: float = 1.0, deadline_s: float | None = None,
                 callback: Callable[[dict[str, Any]], None] | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.total, self.label, self.stream = total, label, stream
        self.interval_s, self.deadline_s, self.callback, self.on_bytes = interval_s, deadline_s, callback, on_bytes
        self.done = 0
        self.t0 = time.monotonic()
        self._last = 0.0
        self._lock = threading.Lock()

    def start(self, total: int, label: str) -> None:
        with self._lock:
            self.total, self.label, self.done, self.t0, self._last = total, label, 0, time.monotonic(), 0.0

    def state(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 and self.total >= self.done else None
        return {"label": self.label, "bytes": self.done, "total": self.total, "elapsed_s": round(elapsed, 3),
                "rate_bps": rate, "eta_s": eta}

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            report = now - self._last >= self.interval_s or self.done >= self.total
            if report:
                self._last = now
        if self.on_bytes is not None:
            self.on_bytes(self.done)
        _exchange.check()  # the push or pull under way is past its deadline
        if self.deadline_s is not None and time.monotonic() - self.t0 > self.deadline_s:
            s = self.state()
            raise SnapguardError(Reason.STORE_TOO_SLOW, f"{self.label}: {s['bytes']} of {s['total']} bytes in "
                                 f"{s['elapsed_s']:.1f} s, past the {self.deadline_s:g} s deadline",
                                 evidence={"progress": s})
        if report:
            self.report()

    def report(self, final: bool = False) -> None:
        s = self.state()
        eta = f"{s['eta_s']:.0f} s" if s["eta_s"] is not None else "?"
        line = (f"{s['label']}: {s['bytes'] >> 20}/{s['total'] >> 20} MiB, {s['rate_bps'] / 2**20:.1f} MiB/s, "
                f"ETA {eta}")
        log.info("%s", line)
        if self.callback is not None:
            self.callback(s)
        if self.stream is not None:
            self.stream.write("\r" + line + ("\n" if final else ""))
            self.stream.flush()


@dataclass(frozen=True)
class ImageRef:
    """One image of a job in a store; `complete`: its marker is there."""

    store_url: str
    job: str
    name: str
    complete: bool
    epoch: int | None = None  # the fencing epoch it was pushed under (from its store record)
    invalid: str | None = None  # why a marked image does not count (its store record is not one snapguard writes)

    @property
    def url(self) -> str:
        return f"{self.store_url.rstrip('/')}/{self.job}/images/{self.name}"


@dataclass
class Pulled:
    """An image fetched into a local directory, every file verified as it was read."""

    ref: ImageRef
    image_dir: str
    manifest: dict[str, Any]
    digests: dict[str, str]  # name -> manifest digest, computed from the bytes written
    record: dict[str, Any] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0



def terminal_progress(enabled: bool) -> IO[str] | None:
    """stderr when asked for and a terminal; else None (the log still gets the lines)."""
    return sys.stderr if enabled and sys.stderr.isatty() else None
