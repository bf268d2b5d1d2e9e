"""torch.compile's worker pool (inductor's SubprocPool sidecar and its workers) holds NVML handles,
which keep CRIU from dumping the trainer's tree. Once compilation has been idle for IDLE_STEPS
optimizer steps the pool is detached from inductor (its next compile makes a new one, lazily, as
after a fork) and shut down in a background thread, outside any snapshot's stall; a take that
finds it still up waits for that shutdown, or shuts it down itself, before it answers."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from ..protocol import ERROR, POOL_PIDS, POOL_SHUTDOWN_AT_TAKE, POOL_STATE
from . import env

__all__ = ["ASYNC_COMPILE", "POOL_SHUTDOWN_S", "CompilePool", "pool_pids"]

ASYNC_COMPILE = "torch._inductor.async_compile"
POOL_SHUTDOWN_S = 120.0  # the longest a take waits for the pool to go (5.2 s seen on the H200)


def pool_pids(pools: list[Any]) -> list[int]:
    """The processes of inductor's pools: a SubprocPool's sidecar (its workers are the sidecar's
    children), a ProcessPoolExecutor's workers."""
    pids: list[int] = []
    for pool in pools:
        process = getattr(pool, "process", None)
        if process is not None and getattr(process, "pid", None):
            pids.append(int(process.pid))
        pids += [int(p) for p in (getattr(pool, "_processes", None) or {})]
    return sorted(set(pids))


class CompilePool:
    """Shuts inductor's compile pool down once compilation is idle, off the trainer's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.quiet = 0
        self.marker: tuple[Any, ...] | None = None
        self.thread: threading.Thread | None = None
        self.shutting: list[int] = []  # pids of the pools being shut down
        self.shutdowns = 0
        self.last: dict[str, Any] = {}

    @staticmethod
    def _module() -> Any:
        return sys.modules.get(ASYNC_COMPILE)

    def _pools(self) -> list[Any]:
        mod = self._module()
        return list(getattr(mod, "_pool_set", None) or []) if mod is not None else []

    @staticmethod
    def _activity(mod: Any) -> tuple[Any, ...]:
        """What changes while inductor compiles: dynamo's graph count, and a compile under way
        (inductor's `_t0`, set from the first async kernel compile until it waits for them all). A
        pool still warming up (its readiness probe pending) is idle: nothing waits for it."""
        utils = sys.modules.get("torch._dynamo.utils")
        graphs = utils.counters["stats"]["unique_graphs"] if utils is not None else 0
        return graphs, getattr(mod, "_t0", None) is not None

    def on_step(self) -> None:
        """At every optimizer step's end (the trainer's thread; cheap when there is no pool)."""
        if self.thread is not None and not self.thread.is_alive():
            self.thread = None  # the last shutdown is over; a pool made since may go idle in turn
        mod = self._module()
        if mod is None or not getattr(mod, "_pool_set", None) or self.thread is not None:
            self.quiet = 0
            return
        marker = self._activity(mod)
        self.quiet = 0 if marker[1] or marker != self.marker else self.quiet + 1
        self.marker = marker
        if self.quiet >= env.IDLE_STEPS:
            self.quiet = 0
            self._start_shutdown("idle")

    def _detach(self) -> list[Any]:
        """Take the pools away from inductor: its next compile creates a new pool (lazily)."""
        mod = self._module()
        pools = self._pools()
        reset = getattr(mod, "after_fork", None)  # "reset pools to initial state without shutting them down"
        if reset is None:
            return pools  # an older inductor: shut down through its own function instead
        reset()
        return pools

    def _shutdown(self, pools: list[Any], detached: bool, why: str) -> None:
        t0 = time.monotonic()
        error = None
        try:
            if detached:
                for pool in pools:
                    pool.shutdown()
            else:
                self._module().shutdown_compile_workers()
        except Exception as e:  # the executor finds the processes still there and refuses
            error = f"{type(e).__name__}: {e}"
        with self.lock:
            self.last = {"why": why, POOL_PIDS: self.shutting, "s": time.monotonic() - t0, ERROR: error}
            self.shutdowns += 1
            self.shutting = []

    def _start_shutdown(self, why: str) -> None:
        with self.lock:
            pools = self._pools()
            if not pools:
                return
            self.shutting = pool_pids(pools)
            detached = getattr(self._module(), "after_fork", None) is not None
            if detached:
                self._detach()
            self.thread = threading.Thread(target=self._shutdown, args=(pools, detached, why),
                                           name="snapguard-compile-pool-shutdown", daemon=True)
            self.thread.start()

    def settle(self, timeout: float = POOL_SHUTDOWN_S) -> dict[str, Any]:
        """At the take (the trainer's thread, at a step boundary, nothing compiling): no pool
        left. Waits for a shutdown under way, or shuts the pool down now."""
        t0 = time.monotonic()
        how: list[str] = []

        def joined(thread: threading.Thread | None) -> bool:
            if thread is not None:
                thread.join(max(0.0, timeout - (time.monotonic() - t0)))
            return thread is None or not thread.is_alive()

        if self.thread is not None and self.thread.is_alive():
            how.append("waited for the idle shutdown")
        if joined(self.thread):
            self.thread = None
            if self._pools():
                how.append("shut down at the take")
                self._start_shutdown("take")
                if joined(self.thread):
                    self.thread = None
        if self.thread is not None:
            return {POOL_STATE: "shutting-down", "how": "; ".join(how), "waited_s": time.monotonic() - t0,
                    POOL_PIDS: self.shutting, ERROR: f"the pool did not shut down within {timeout:g} s"}
        if not how:
            return {POOL_STATE: "none"}
        return {POOL_STATE: "shut-down", "how": "; ".join(how), "waited_s": time.monotonic() - t0, **self.last}

    def status(self) -> dict[str, Any]:
        with self.lock:
            live = pool_pids(self._pools())
            state = "shutting-down" if self.thread is not None and self.thread.is_alive() else \
                ("running" if live else ("shut-down" if self.shutdowns else "none"))
            return {POOL_STATE: state, POOL_PIDS: sorted(set(live) | set(self.shutting)), "shutdowns": self.shutdowns,
                    POOL_SHUTDOWN_AT_TAKE: True, "idle_steps": env.IDLE_STEPS, "last": self.last}

