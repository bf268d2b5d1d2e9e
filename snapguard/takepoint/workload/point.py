"""The take point's state in the trainer (`TakePoint`): the optimizer steps counted, a take armed
for a step, the hold at that step's end (the compile pool settled, the optimizer's bytes moved,
the caches emptied, the process groups released: `groups`), the wait for the release, and the
reload and the groups' rebuild after it."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from typing import Any

from ..protocol import (COMPILE_POOL, ERROR, GPU_HANDLES_DROPPED, GROUPS, HOLD_S_ENV, OFFLOAD, PID,
                        POOL_SHUTDOWN_AT_TAKE, POOL_STATE, RESOLVE, RESOLVE_ERROR, SPILL, SPILL_BUSY, SPILL_DIR, STEP)
from . import env, forks
from .agent import AGENT
from .compile_pool import POOL_SHUTDOWN_S, CompilePool
from .groups import AGENT_FIELD
from .groups import GROUPS as PROCESS_GROUPS
from .cudalimits import StackLimit
from .offload import Offload, clear_cublas_workspaces, drop_grads, host_anon_bytes, malloc_trim, optimizer_tensors

__all__ = ["RELOAD_PATIENCE_S", "TakePoint"]

RELOAD_PATIENCE_S = 60.0  # how long the release waits for device memory another process took


class TakePoint:
    def __init__(self, resolve: bool = False) -> None:
        self.step = 0
        self._trainer = False  # the step hook is registered: this process imported torch's optimizers
        self.resolve = resolve  # forked children drop GPU handles; the compile pool goes when idle
        self.pool = CompilePool()
        self.hold_at: int | None = None
        self.reached = threading.Event()
        self.released = threading.Event()
        self.figures: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.requested_at = 0.0
        self.armed_at = 0.0  # time.monotonic() of the take's arrival
        self.wait_s = 10.0  # how long the executor waits for this take
        self.spill = False  # the executor takes the moved bytes' file (`SpillArena`)
        self.handover_fd: int | None = None  # that file's descriptor, until the take's answer carries it
        self.release_fd: int | None = None  # the file the release passed back, to reload from
        self.holding = False  # between the hold's figures and its end: a release's file is for it
        # from the spill's file made to the reload's end: the file is mapped or open, and a dump
        # then (the executor's wait ran out: it snapshots without the hold) would need it
        self.spill_busy = False
        self.rendezvous: str | None = None  # where the release moved the groups' store (HOST:PORT)
        # the full collection run ahead, while the step that ends in the hold still ran: (the step
        # it began in, objects collected, seconds); `_ahead_done` is clear while one runs
        self.ahead: tuple[int, int, float] | None = None
        self._ahead_done = threading.Event()
        self._ahead_done.set()

    @property
    def trainer(self) -> bool:
        """The step hook is registered, and this is no torchrun agent (it imports torch's
        optimizers, never steps: its workers are the trainers)."""
        return self._trainer and not AGENT.active

    @trainer.setter
    def trainer(self, value: bool) -> None:
        self._trainer = value

    def arm(self, at_step: int | None, wait_s: float = 10.0, spill: bool = False) -> None:
        with self.lock:
            self._drop_release_fd()
            self.wait_s = wait_s
            self.spill = spill
            self.reached.clear()
            self.released.clear()
            self.hold_at = self.step + 1 if at_step is None else at_step
            self.requested_at = time.time()
            self.armed_at = time.monotonic()

    def collect_ahead(self) -> None:
        """Python's full collection, run by the take's own thread as soon as it is armed for the
        next step boundary, beside the step that still runs (whose kernels the GPU works through
        meanwhile), rather than at the hold, inside the snapshot's stall: it walks every object
        the process has (0.13 s after `import torch` on a 2-core VM) and in a training loop finds
        next to nothing. The hold then collects the young generations only. Not for a take at a
        later step (a job's common step): the hold collects in full then."""
        with self.lock:
            if not env.GC_AHEAD or self.hold_at != self.step + 1:
                return
            step = self.step
            self._ahead_done.clear()
        t = time.monotonic()
        collected = 0
        try:
            collected = gc.collect()
        finally:
            with self.lock:
                self.ahead = (step, collected, time.monotonic() - t)
            self._ahead_done.set()

    def _collect_at_hold(self) -> dict[str, Any]:
        """The hold's collection: the young generations where the full one ran during the step just
        ended (waited for if it still runs), else a full one; its figures."""
        self._ahead_done.wait(5.0)
        with self.lock:
            ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == self.step - 1:
            return {"gc_collected": gc.collect(1), "gc_ahead": {"collected": ahead[1], "s": round(ahead[2], 6)}}
        return {"gc_collected": gc.collect()}

    def pop_handover(self) -> int | None:
        with self.lock:
            fd, self.handover_fd = self.handover_fd, None
        return fd

    def _drop_release_fd(self) -> None:
        if self.release_fd is not None:
            os.close(self.release_fd)
            self.release_fd = None

    def release(self, fds: list[int], rendezvous: str | None = None) -> None:
        """Go on; the first of `fds`, if any, is the spilled bytes' file to reload from: kept only
        while a hold is under way (a release that comes after its hold ended by itself must not
        be read by a later one: that would bring back older bytes)."""
        with self.lock:
            self._drop_release_fd()
            if self.holding and fds:
                self.release_fd, fds = fds[0], fds[1:]
            for extra in fds:
                os.close(extra)
            if rendezvous:
                self.rendezvous = rendezvous
        self.released.set()

    def disarm(self) -> None:
        """The executor stopped waiting (and snapshots without the hold, or not at all): a hold that
        begins or is under way now does not wait for a release that will not come."""
        with self.lock:
            self.hold_at = None
            self.released.set()

    def at_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self.lock:
            self.step += 1
            holding = self.hold_at is not None and self.step >= self.hold_at
            if holding:
                self.hold_at = None
        if holding:
            try:
                self._hold(optimizer)
            finally:
                with self.lock:
                    self.spill_busy = False
        elif self.resolve:
            try:
                self.pool.on_step()
            except Exception as e:  # inductor's internals moved: the take shuts the pool down
                self.resolve_error = f"{type(e).__name__}: {e}"

    resolve_error: str | None = None

    def status(self) -> dict[str, Any]:
        spill_dir = env.spill_dir()
        out: dict[str, Any] = {RESOLVE: self.resolve,
                               GPU_HANDLES_DROPPED: self.resolve and forks.installed(),
                               SPILL: spill_dir is not None, SPILL_DIR: spill_dir, SPILL_BUSY: self.spill_busy}
        if self.resolve:
            try:
                out[COMPILE_POOL] = self.pool.status()
            except Exception as e:
                out[COMPILE_POOL] = {POOL_STATE: "unknown", ERROR: f"{type(e).__name__}: {e}",
                                 POOL_SHUTDOWN_AT_TAKE: False}
        if self.resolve_error:
            out[RESOLVE_ERROR] = self.resolve_error
        if "torch.distributed" in sys.modules:
            out[GROUPS] = PROCESS_GROUPS.status()
        if AGENT.active:
            out[AGENT_FIELD] = AGENT.status()
        return out

    def _hold(self, optimizer: Any = None) -> None:
        import torch

        # First the compile pool (its processes hold NVML handles): gone before the figures.
        pool = self._settle_pool()
        # then the process groups: every rank drains, its communicators and store connections go
        groups = PROCESS_GROUPS.release(max(1.0, self.wait_s - (time.monotonic() - self.armed_at)), self.step)
        cuda = torch.cuda.is_initialized()  # not is_available(): that initialises the driver in a CPU rank
        reserved_before = torch.cuda.memory_reserved() if cuda else 0
        host_before = host_anon_bytes()
        t0 = time.monotonic()
        parts: dict[str, float] = {}  # the trim's seconds by part: what of it the stall holds
        marks = [t0]

        def lap(name: str) -> None:
            marks.append(time.monotonic())
            parts[name] = marks[-1] - marks[-2]

        grads_dropped = drop_grads(optimizer) if env.DROP_GRADS else None
        allocated = 0
        if cuda:
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated()
        lap("sync")
        # Every resident anonymous page is written into the image, and what nothing refers to any
        # more is neither to be moved nor kept: collected (in full ahead, see collect_ahead) before
        # the move and the cache's emptying (which then returns its device memory too), and the
        # freed heap given back below.
        collection = self._collect_at_hold()
        lap("gc")
        offload = self._move(torch, optimizer, cuda)
        lap("move")
        workspaces = self._empty_caches(torch, cuda, offload)
        lap("caches")
        stack = StackLimit()
        if cuda and offload is not None and offload.figures.get("state") in ("moved", "partial"):
            stack.lower()  # no kernel runs until the release: the runtime's stack reservation goes
        lap("stack")
        self.figures = {
            PID: os.getpid(),
            STEP: self.step,
            "reserved_before": reserved_before,
            "reserved_after": torch.cuda.memory_reserved() if cuda else 0,
            "allocated": allocated,
            "host_anon_before": host_before,
            "host_anon_after": host_anon_bytes(),
            "trim_s": time.monotonic() - t0,
            "trim_parts_s": {k: round(v, 6) for k, v in parts.items()},
            **collection,  # gc_collected: unreachable objects the hold's collection found
            **({"grads_dropped_bytes": grads_dropped} if grads_dropped is not None else {}),
            **({"cublas_workspaces_cleared": workspaces} if workspaces is not None else {}),
            **({"cuda_stack": stack.figures} if stack.figures else {}),
            "device_used_after": _device_used(torch) if cuda else 0,
            "requested_at": self.requested_at,  # when the take arrived (unix time)
            "held_at": time.time(),
        }
        if pool is not None:
            self.figures[COMPILE_POOL] = pool
        if groups is not None:
            self.figures[GROUPS] = {**PROCESS_GROUPS.status(), **groups}
        if offload is not None:
            self.figures[OFFLOAD] = offload.figures
        with self.lock:
            self.holding = True
        self.reached.set()
        # Hold at the boundary: the snapshot is taken while this thread waits here.
        self._wait_for_release(offload)
        try:
            stack.restore()  # before the trainer's next kernel
        except Exception as e:
            raise RuntimeError(f"snapguard take point: the CUDA stack size limit lowered for the snapshot "
                               f"cannot be set back: {type(e).__name__}: {e}") from e
        self._end_hold(torch, offload)
        self._rebuild_groups()

    def _rebuild_groups(self) -> None:
        """The groups released at the hold made again, their store at the release's rendezvous
        (a restored job's new address) or where it was; the trainer cannot go on without them."""
        with self.lock:
            rendezvous, self.rendezvous = self.rendezvous, None
        try:
            PROCESS_GROUPS.rebuild(rendezvous)
        except Exception as e:
            raise RuntimeError(f"snapguard take point: the process groups released for the snapshot cannot be "
                               f"rebuilt (rendezvous {rendezvous or 'as at the start'}): {type(e).__name__}: {e}") from e

    def _settle_pool(self) -> dict[str, Any] | None:
        """The compile pool shut down (resolving), within the executor's wait: past it, the
        executor finds the pool still there and refuses. Its figures; None when not resolving."""
        if not self.resolve:
            return None
        try:
            return self.pool.settle(max(1.0, min(POOL_SHUTDOWN_S, self.wait_s - 0.5)))
        except Exception as e:
            return {POOL_STATE: "unknown", ERROR: f"{type(e).__name__}: {e}"}

    def _move(self, torch: Any, optimizer: Any, cuda: bool) -> Offload | None:
        """The optimizer's tensors moved off the device (into a spill's file when asked), unless
        the executor stopped waiting; the move, or None when nothing was to move."""
        device = env.offload_device()
        wanted_dir = env.spill_dir() if self.spill else None  # a statfs: not under the lock the socket's thread takes
        with self.lock:
            # the executor stopped waiting (disarm) or let go already: the snapshot goes on without
            # the hold, and a move now would only put a second copy into it, or, spilled, leave the
            # process with a file outside the image open. Decided under the lock disarm takes, so
            # that a spill begun is one the executor's status asks find busy.
            move = not self.released.is_set() and env.offload_on() and (cuda or device == "cpu")
            spill_dir = wanted_dir if move else None
            self.spill_busy = spill_dir is not None
        if not move:
            return None
        offload = Offload(device)
        # what is not moved by then stays for the driver's checkpoint: the executor's wait
        # (which the step before the hold already used part of) also covers the trim after it
        offload.take(torch, optimizer_tensors(torch, optimizer), gc.get_objects(),
                     deadline=self.armed_at + 0.7 * self.wait_s, spill_dir=spill_dir)
        with self.lock:
            self.handover_fd, offload.spill_fd = offload.spill_fd, None
        return offload

    @staticmethod
    def _empty_caches(torch: Any, cuda: bool, offload: Offload | None) -> bool | None:
        """cuBLAS's workspaces freed where the move ran, PyTorch's device and pinned host caches
        emptied, the C heap trimmed; whether the workspaces were freed (None: not tried)."""
        workspaces = None
        if cuda:
            if offload is not None and offload.figures.get("state") in ("moved", "partial"):
                # the move found no CUDA graph and no private pool (a graph's kernels would keep
                # using the workspace they were captured with): cuBLAS's workspaces go too
                workspaces = clear_cublas_workspaces(torch)
            torch.cuda.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)  # pinned staging buffers
            if host_empty is not None:
                host_empty()
        malloc_trim()
        return workspaces

    def _end_hold(self, torch: Any, offload: Offload | None) -> None:
        """After the release: the moved bytes back onto the device, from the file the release
        passed when there is one."""
        unsent = self.pop_handover()  # the take's answer never went (the executor stopped waiting)
        if unsent is not None:
            os.close(unsent)
        with self.lock:
            self.holding = False
            source, self.release_fd = self.release_fd, None
        if offload is None:
            if source is not None:
                os.close(source)
            return
        t1 = time.monotonic()
        try:
            offload.reload(torch, patience_s=RELOAD_PATIENCE_S, source_fd=source)
        except Exception as e:  # no device memory for it: the trainer cannot go on without its state
            offload.discard()  # nor can its spill's bytes be of use to anything: not left in memory
            raise RuntimeError(f"snapguard take point: the tensors moved to host memory for the snapshot "
                               f"cannot come back onto the GPU: {type(e).__name__}: {e}") from e
        finally:
            if source is not None:
                os.close(source)
        offload.figures["reload_s"] = time.monotonic() - t1

    def _wait_for_release(self, offload: Offload | None) -> None:
        """Until the release, or env.HOLD_S (a lost executor does not hold the trainer
        for ever). But a spilled hold whose file's name is gone can only go on with the file a
        release brings: it waits on. That is a trainer restored from a stop snapshot (the executor
        removed the name) or on another node: its wait's deadline was set on the clock of the
        node and boot it was dumped on, and may be long past once it is restored."""
        warned, wait = False, env.HOLD_S
        while not self.released.wait(wait):
            if offload is None or not offload.spilled() or offload.spill_reachable():
                return
            wait = max(env.HOLD_S, 1.0)  # not a spin, whatever the limit
            if not warned:
                warned = True
                try:
                    sys.stderr.write(f"snapguard take point: held past {HOLD_S_ENV}; the optimizer's "
                                     "bytes are in a file only the executor's release can bring back: waiting\n")
                except Exception:  # no stderr to tell (closed, or gone with the restore): wait all the same
                    pass


def _device_used(torch: Any) -> int | None:
    """The device memory in use on the current device (total - free: the context's own
    reservations too, what the CUDA plugin's checkpoint copies), or None."""
    try:
        free, total = torch.cuda.mem_get_info()
    except Exception:
        return None
    return int(total - free)
