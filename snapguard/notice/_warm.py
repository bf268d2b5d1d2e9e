"""The snapshot's host checks kept warm while the agent runs, so that a notice's snapshot reuses
those that passed instead of running them inside the notice's lead time."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..config import Config
from ..reasons import failure_from

if TYPE_CHECKING:
    from ..preflight import HostChecks

__all__ = ["HOST_CHECKS_EVERY_S", "WarmHostChecks", "warm_run"]

HOST_CHECKS_EVERY_S = 60.0


def warm_run(config: Config) -> HostChecks:
    """The host checks a snapshot may reuse, less NVML's inventory (it never reuses that one: the
    agent does not call NVML between notices); libcuda's checkpoint symbols, which the snapshot's
    NVML check reads, are read here once (remembered per file identity in this process)."""
    from .. import pipeline, preflight
    from ..cuda import find_libcuda, libcuda_checkpoint_symbols

    value = preflight.host_checks_ahead(config, leave=pipeline.FRESH_HOST_CHECKS)
    libcuda = find_libcuda()
    if libcuda is not None:
        with contextlib.suppress(OSError, ValueError):  # the snapshot's own check says what is wrong
            libcuda_checkpoint_symbols(libcuda)
    return value


class WarmHostChecks:
    """The snapshot's host checks (`preflight.host_checks_ahead`) kept warm for a notice: run in a
    daemon thread at `start()`, then every `every_s`; `latest()` hands the newest result no older
    than `max_age_s` (default twice `every_s`; age from when the checks began), else None, and
    never waits for a run under way (a lock held only to read or swap the result). A run that
    raises leaves the previous result to age out. No run starts while `acting()` (a snapshot
    under way); each child a run starts keeps its own deadline, so `stop()` waits at most
    `wait_s` for one under way, and the thread (a daemon) ends with the agent in any case."""

    THREAD = "snapguard warm host-checks"

    def __init__(self, config: Config, every_s: float = HOST_CHECKS_EVERY_S, max_age_s: float | None = None, *,
                 run: Callable[[Config], HostChecks] | None = None,
                 said: Callable[[HostChecks | None, str | None], None] | None = None) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, not {every_s}")
        self.config = config
        self.every_s = every_s
        self.max_age_s = 2 * every_s if max_age_s is None else max_age_s
        self._run = run
        self._said = said  # after each run: (its result, None) or (None, why it did not run)
        self._lock = threading.Lock()
        self._value: HostChecks | None = None
        self._stop = threading.Event()
        self._acting = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.THREAD, daemon=True)
        self._thread.start()

    def stop(self, wait_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @contextlib.contextmanager
    def acting(self) -> Iterator[None]:
        """While a notice is acted on: no new run starts (one under way finishes)."""
        self._acting.set()
        try:
            yield
        finally:
            self._acting.clear()

    def latest(self) -> HostChecks | None:
        with self._lock:
            value = self._value
        return value if value is not None and value.age_s() <= self.max_age_s else None

    def refresh(self) -> HostChecks | None:
        """One run, now, in the caller's thread; its result (None when it raised)."""
        try:
            value = (self._run or warm_run)(self.config)
        except Exception as e:  # noqa: BLE001 - the snapshot then runs the checks itself, typed as ever
            self.runs += 1
            if self._said is not None:
                self._said(None, failure_from(e).message)
            return None
        with self._lock:
            self._value = value
        self.runs += 1
        if self._said is not None:
            self._said(value, None)
        return value

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._acting.is_set():
                self._stop.wait(0.2)
                continue
            self.refresh()
            self._stop.wait(self.every_s)
