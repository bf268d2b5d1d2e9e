"""The workload side of the take point (runs inside the trainer).

A global optimizer step post-hook is registered the moment `torch.optim.optimizer` is imported, so
every rank of a job counts the same optimizer steps from its first. A daemon thread listens on a
unix socket for one request per connection:
  status            -> {"step": steps completed, "spill": whether it can spill, "spill_dir": where, ...}
  take <seconds> [spill]
                    -> hold at the end of the next step
  take-at <S> <s> [spill]
                    -> hold at the end of step S (a step every rank of a job reaches: no rank is
                       left inside a collective that waits for a held one)
  release           -> go on (a descriptor sent with it: the spilled bytes' file to reload from)
While held, the trainer's own thread has synchronised, moved its tensors' bytes from the GPU into
host memory (`_Offload`: the driver's checkpoint then copies little; back on the release; off with
SNAPGUARD_TAKE_OFFLOAD=0), freed cuBLAS's workspaces (where the move ran: no CUDA graph), emptied
PyTorch's device and pinned host caches and trimmed the C heap,
and makes no CUDA call; it goes on by itself after SNAPGUARD_TAKE_HOLD_S, so a lost executor cannot
hold it forever. Asked with `spill`, the bytes go into a tmpfs file of its own (`_SpillArena`,
SNAPGUARD_TAKE_SPILL_DIR; else the node's huge-page tmpfs /run/snapguard-spill where there is one,
/dev/shm where not; SNAPGUARD_TAKE_SPILL=0 refuses), whose descriptor
the take's answer carries (SCM_RIGHTS), none of it mapped or open here while the snapshot is taken.

It also resolves the two things that put GPU handles outside a CUDA context into a trainer's tree
(CRIU cannot dump them), on by default, off with SNAPGUARD_RESOLVE_BLOCKERS=0:
  forked children   a child forked (os.fork: multiprocessing's fork start method, DataLoader
                    workers) from a process with a CUDA context cannot use CUDA (PyTorch raises its
                    "Cannot re-initialize CUDA in forked subprocess"), yet inherits the parent's
                    /dev/nvidia* descriptors and mappings: right after the fork, in the child, each
                    such descriptor is pointed at /dev/null (its number stays taken, so nothing the
                    parent's libraries remember lands on another file) and each such mapping becomes
                    an inaccessible anonymous reservation (a stray access faults, it cannot read
                    another mapping). Nothing else of the child is touched.
  compile pool      torch.compile's worker pool (inductor's SubprocPool sidecar and its workers)
                    holds NVML handles. Once compilation has been idle for SNAPGUARD_COMPILE_IDLE_STEPS
                    optimizer steps, the pool is detached from inductor (its next compile makes a new
                    one, lazily, as after a fork) and shut down in a background thread, outside any
                    snapshot's stall; a take that finds it still up waits for that shutdown, or shuts
                    it down itself, before it answers.
With SNAPGUARD_TAKE_DROP_GRADS=1 the hold also drops the gradients of the optimizer that just
stepped (`p.grad = None`, what `zero_grad(set_to_none=True)` does before the next backward), so
they are neither copied off the GPU nor written into the image: 4 bytes per fp32 parameter. Off
by default: a trainer that reads `.grad` between `optimizer.step()` and its next backward (a
gradient norm logged after the step, accumulation across optimizer steps) must leave it off.
The status answer says both (`gpu_handles_dropped_in_children`, `compile_pool`), which is how the
executor's preflight knows that the hook is there.
"""

from __future__ import annotations

import gc
import heapq
import importlib.abc
import importlib.machinery
import json
import os
import re
import socket
import sys
import threading
import time
from typing import Any, Sequence

__all__ = ["drop_inherited", "resolving", "start"]

_HOLD_S = float(os.environ.get("SNAPGUARD_TAKE_HOLD_S", "300"))
_OPTIMIZER_MODULE = "torch.optim.optimizer"
_ASYNC_COMPILE = "torch._inductor.async_compile"
_IDLE_STEPS = int(os.environ.get("SNAPGUARD_COMPILE_IDLE_STEPS", "5"))


def _env_switch(name: str, default: bool) -> bool:
    """An on/off switch from the trainer's environment: a switch on by default is off only for
    0/false/no/off, one off by default is on only for 1/true/yes/on."""
    value = os.environ.get(name, "").strip().lower()
    return value not in ("0", "false", "no", "off") if default else value in ("1", "true", "yes", "on")


_DROP_GRADS = _env_switch("SNAPGUARD_TAKE_DROP_GRADS", False)
_RELOAD_PATIENCE_S = 60.0  # how long the release waits for device memory another process took
_POOL_SHUTDOWN_S = 120.0  # the longest a take waits for the pool to go (5.2 s seen on the H200)


def resolving() -> bool:
    """Whether the hook resolves the blockers (the default); SNAPGUARD_RESOLVE_BLOCKERS=0 turns it off."""
    from . import RESOLVE_ENV

    return _env_switch(RESOLVE_ENV, True)


# --- forked children: drop the GPU handles they inherited --------------------------------------

# Linux's values (x86_64 and aarch64 alike)
_PROT_NONE, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x0, 0x02, 0x10, 0x20, 0x4000


class _Libc:
    """mmap, munmap and madvise through ctypes, bound in the parent so the child only calls them."""

    def __init__(self) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise = libc.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.failed = ctypes.c_void_p(-1).value


_libc: _Libc | None = None


def _bound_libc() -> _Libc:
    """The libc calls, bound once (before a fork: the child only calls them)."""
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


def _nvidia_pattern() -> re.Pattern[str]:
    from ..procfs import NVIDIA_DEV  # the pattern the preflight matches with

    return NVIDIA_DEV


def drop_inherited(pattern: re.Pattern[str], proc_self: str = "/proc/self") -> dict[str, list[Any]]:
    """Drop this process's handles on the paths `pattern` matches (procfs.NVIDIA_DEV in a trainer's
    forked child): each descriptor whose target matches now refers to /dev/null, with the same
    number (close-on-exec); each mapping of such a path is replaced in place by an anonymous
    PROT_NONE reservation. Returns {"fds": [numbers], "maps": [[start, end, path], ...]}."""
    libc = _bound_libc()
    fds: list[int] = []
    null = -1
    try:
        for name in os.listdir(f"{proc_self}/fd"):
            try:
                target = os.readlink(f"{proc_self}/fd/{name}")
            except OSError:
                continue  # the listing's own descriptor, gone by now
            if name.isdigit() and pattern.match(target):
                if null < 0:
                    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
                os.dup2(null, int(name), inheritable=False)
                fds.append(int(name))
    finally:
        if null >= 0:
            os.close(null)
    # the whole list first: the mappings change under the reader of /proc/self/maps otherwise
    with open(f"{proc_self}/maps") as f:
        lines = f.read().splitlines()
    maps: list[list[Any]] = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and pattern.match(parts[5].strip()):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            maps.append([lo, hi, parts[5].strip()])
    for lo, hi, _ in maps:
        got = libc.mmap(lo, hi - lo, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, 0)
        if got is None or got == libc.failed:
            libc.munmap(lo, hi - lo)  # cannot reserve it: at least it no longer maps the device
    return {"fds": fds, "maps": maps}


class _ForkHandler:
    """os.register_at_fork: `before` notes whether the parent has a CUDA context; in the child,
    the inherited GPU handles are dropped when it did (PyTorch's CUDA initialised, or any inherited
    /dev/nvidia-uvm descriptor: only a CUDA context opens it, NVML does not). A child of a process
    that only used NVML keeps its handles: it may still use CUDA itself."""

    def __init__(self) -> None:
        self.pattern: re.Pattern[str] | None = None
        self.parent_cuda = False
        self.dropped: dict[str, list[Any]] | None = None  # in a child: what it dropped

    def before(self) -> None:
        try:
            if self.pattern is None:
                self.pattern = _nvidia_pattern()
            _bound_libc()
            cuda = sys.modules.get("torch.cuda")
            self.parent_cuda = bool(cuda is not None and cuda.is_initialized())
        except Exception:  # never in the way of a fork
            self.parent_cuda = False

    def _uvm_inherited(self) -> bool:
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}").startswith("/dev/nvidia-uvm"):
                    return True
            except OSError:
                continue
        return False

    def after_in_child(self) -> None:
        try:
            if self.pattern is not None and (self.parent_cuda or self._uvm_inherited()):
                self.dropped = drop_inherited(self.pattern)
        except Exception as e:  # the preflight still names a child that kept them
            print(f"snapguard take point: GPU handles not dropped in forked child {os.getpid()}: {e}",
                  file=sys.stderr)


_fork_handler: _ForkHandler | None = None


def _install_fork_handler() -> _ForkHandler:
    global _fork_handler
    if _fork_handler is None:
        _fork_handler = _ForkHandler()
        os.register_at_fork(before=_fork_handler.before, after_in_child=_fork_handler.after_in_child)
    return _fork_handler


# --- torch.compile's worker pool --------------------------------------------------------------


def _pool_pids(pools: list[Any]) -> list[int]:
    """The processes of inductor's pools: a SubprocPool's sidecar (its workers are the sidecar's
    children), a ProcessPoolExecutor's workers."""
    pids: list[int] = []
    for pool in pools:
        process = getattr(pool, "process", None)
        if process is not None and getattr(process, "pid", None):
            pids.append(int(process.pid))
        pids += [int(p) for p in (getattr(pool, "_processes", None) or {})]
    return sorted(set(pids))


class _CompilePool:
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
        return sys.modules.get(_ASYNC_COMPILE)

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
        if self.quiet >= _IDLE_STEPS:
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
            self.last = {"why": why, "pids": self.shutting, "s": time.monotonic() - t0, "error": error}
            self.shutdowns += 1
            self.shutting = []

    def _start_shutdown(self, why: str) -> None:
        with self.lock:
            pools = self._pools()
            if not pools:
                return
            self.shutting = _pool_pids(pools)
            detached = getattr(self._module(), "after_fork", None) is not None
            if detached:
                self._detach()
            self.thread = threading.Thread(target=self._shutdown, args=(pools, detached, why),
                                           name="snapguard-compile-pool-shutdown", daemon=True)
            self.thread.start()

    def settle(self, timeout: float = _POOL_SHUTDOWN_S) -> dict[str, Any]:
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
            return {"state": "shutting-down", "how": "; ".join(how), "waited_s": time.monotonic() - t0,
                    "pids": self.shutting, "error": f"the pool did not shut down within {timeout:g} s"}
        if not how:
            return {"state": "none"}
        return {"state": "shut-down", "how": "; ".join(how), "waited_s": time.monotonic() - t0, **self.last}

    def status(self) -> dict[str, Any]:
        with self.lock:
            live = _pool_pids(self._pools())
            state = "shutting-down" if self.thread is not None and self.thread.is_alive() else \
                ("running" if live else ("shut-down" if self.shutdowns else "none"))
            return {"state": state, "pids": sorted(set(live) | set(self.shutting)), "shutdowns": self.shutdowns,
                    "shutdown_at_take": True, "idle_steps": _IDLE_STEPS, "last": self.last}


def _host_anon_bytes() -> int:
    """Resident anonymous memory (RssAnon) of this process, 0 where procfs does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _clear_cublas_workspaces(torch: Any) -> bool:
    """Free the workspaces PyTorch keeps per cuBLAS handle and stream (allocated from the caching
    allocator and held, so emptying the cache alone keeps them; on the H200 the reserve left after
    the take fell from 75 to 6-8 MB without them): the driver's checkpoint would copy them into
    the image. The next matmul allocates one again, of the same size, so cuBLAS picks the same
    algorithms. Whether they were freed (PyTorch without the call: not)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    try:
        clear()
        return True
    except Exception:
        return False


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): return free heap pages to the kernel. Nothing elsewhere (musl)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


class _Offload:
    """The hold's move of the stepped optimizer's tensors off the device, and back on the release.

    Why: the driver's checkpoint copies every byte of device memory a process holds to the host at
    about 2 GB/s on the H200, and its restore copies it back; PyTorch copies its own tensors at
    several times that, and leaves none of the allocator's unused reserve. So at the hold the
    storages of the optimizer's parameters, gradients and state are copied into one host mapping
    (`_Arena`) and their device memory freed: the storage object stays, emptied, so every view and
    every Python reference to it stays valid (FSDP's resize_(0)). The driver's checkpoint then holds
    what is left (the CUDA context, other tensors). On the release each storage gets fresh device
    memory and its bytes back, before the trainer's next step: the same bytes at another address.

    Only the optimizer's tensors move: what the trainer's step owns. Nothing moves while something
    may replay kernels at fixed addresses (a CUDA graph, memory in a private pool: torch.compile's
    reduce-overhead mode); a storage the allocator does not own stays, and so does one whose memory
    another storage also covers (a DLPack export, from_blob): that one would go on reading the old
    address. What no Python object shows (a raw pointer kept by an extension, a CUDA IPC export
    read by another process) cannot be seen here: such a trainer, or one whose own threads touch
    the optimizer's tensors while it is held, sets SNAPGUARD_TAKE_OFFLOAD=0."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.moved: list[tuple[Any, int, int]] = []  # (the storage, its bytes' offset in the arena, their count)
        self.arena: _Arena | None = None
        self.spill_fd: int | None = None  # a _SpillArena's descriptor, for the executor
        self.figures: dict[str, Any] = {"state": "none"}

    @staticmethod
    def _graphs(torch: Any) -> tuple[type, ...]:
        graph = getattr(getattr(torch, "cuda", None), "CUDAGraph", None)
        return (graph,) if isinstance(graph, type) else ()

    def _storage(self, tensor: Any) -> tuple[Any, tuple[int, int]] | None:
        """The tensor's storage and the range of its memory when it is on this device and holds
        bytes, else None: sparse tensors have no storage, and a wrapper subclass's (DTensor's,
        torchao's) has a size but no memory, whose address raises."""
        try:
            storage = tensor.untyped_storage()
            if storage.device.type == self.device_type and storage.nbytes() > 0:
                return storage, (storage.data_ptr(), storage.data_ptr() + storage.nbytes())
        except Exception:
            pass
        return None

    def _candidates(self, torch: Any, tensors: list[Any],
                    objects: Sequence[Any]) -> tuple[list[Any], int, str | None]:
        """The distinct storages of `tensors` that may move, the bytes of those that must stay (not
        the allocator's, or their memory aliased by another storage among `objects`' tensors), or
        why nothing may move."""
        graphs = self._graphs(torch)
        others: dict[int, tuple[int, int]] = {}  # every storage on the device: its memory's range
        for o in objects:
            kind = type(o)  # not isinstance: some of torch's own objects warn when asked for __class__
            if graphs and issubclass(kind, graphs):
                return [], 0, "a CUDA graph exists (it replays kernels at fixed addresses)"
            if issubclass(kind, torch.Tensor):
                found_here = self._storage(o)
                if found_here is not None:
                    others[found_here[0]._cdata] = found_here[1]
        if self.device_type == "cuda":
            try:
                # a pool whose graph or MemPool is gone keeps its segments until the cache is emptied:
                # emptied first, what is left in a private pool belongs to a live one
                torch.cuda.empty_cache()
                try:
                    segments = torch.cuda.memory_snapshot(include_traces=False)  # no stack traces to build
                except TypeError:  # an older PyTorch: no such parameter
                    segments = torch.cuda.memory_snapshot()
                pools = {tuple(seg.get("segment_pool_id") or (0, 0)) for seg in segments}
            except Exception as e:
                return [], 0, f"the allocator's segments cannot be read: {type(e).__name__}: {e}"
            if pools - {(0, 0)}:
                return [], 0, "device memory in a private pool (CUDA graphs or a torch.cuda.MemPool)"
        found: dict[int, Any] = {}
        for t in tensors:
            found_here = self._storage(t)
            if found_here is not None:
                storage, memory = found_here
                found.setdefault(storage._cdata, storage)
                others.setdefault(storage._cdata, memory)
        # a sweep over the ranges by start: each range still open where another starts shares memory
        aliased: set[int] = set()
        open_ranges: list[tuple[int, int]] = []  # a heap of (end, key)
        for lo, hi, key in sorted((lo, hi, key) for key, (lo, hi) in others.items()):
            while open_ranges and open_ranges[0][0] <= lo:
                heapq.heappop(open_ranges)
            if open_ranges:
                aliased.add(key)
                aliased.update(k for _, k in open_ranges)
            heapq.heappush(open_ranges, (hi, key))
        movable, kept = [], 0
        for key, storage in found.items():
            if key in aliased or not storage.resizable():
                kept += storage.nbytes()
            else:
                movable.append(storage)
        return movable, kept, None

    def take(self, torch: Any, tensors: list[Any], objects: Sequence[Any] = (), deadline: float | None = None,
             room: int | None = None, spill_dir: str | None = None) -> dict[str, Any]:
        """Move the storages of `tensors` out, the largest first; the figures. `objects`: the rest
        of what the process holds (gc.get_objects()), to find graphs and aliases. What does not fit
        in `room` bytes (default: 80% of the host memory this process may still take), or would not
        be copied by `deadline` (time.monotonic(), at the rate so far: the executor's wait for the
        take is not outrun), stays on the device ("partial"). The copies go through `_Ring` (whose
        pinned buffers count against `room`); no storage is emptied before every copy is done, so a
        copy that fails leaves them all in place ("failed"). With `spill_dir` the arena is a file
        there (`_SpillArena`, else anonymous memory when that cannot be made: `spill_error`), handed
        over as `spill_fd` and named in the figures' `spill`. Never raises."""
        t0 = time.monotonic()
        try:
            movable, kept, blocker = self._candidates(torch, tensors, objects)
        except Exception as e:
            blocker = f"{type(e).__name__}: {e}"[:300]
        if blocker is not None:
            self.figures = {"state": "skipped", "why": blocker}
            return self.figures
        movable.sort(key=lambda st: st.nbytes(), reverse=True)
        # host memory the copies may take: a trainer the kernel or its cgroup would kill for it is
        # worse off than one whose bytes the driver copies (which fails with an error when short)
        room = int(_host_room() * 0.8) - _Ring.pinned_bytes() if room is None else room
        offsets, total, fits, left = [], 0, [], 0  # left: bytes that stay, here those with no room
        for storage in movable:
            size = -(-storage.nbytes() // _ALIGN) * _ALIGN
            if total + size > room:
                left += storage.nbytes()
                continue
            fits.append(storage)
            offsets.append(total)
            total += size
        fitting = sum(st.nbytes() for st in fits)
        error, issued, pinned, spill_error = None, [], None, None
        ring: _Ring | None = None
        prepare = None
        try:
            if self.device_type == "cuda":  # every device the copies read from, not only the current one
                for index in sorted({st.device.index for st in fits if st.device.index is not None}):
                    torch.cuda.synchronize(index)
            if fits:
                if spill_dir is not None:
                    try:
                        st = os.statvfs(spill_dir)
                        if st.f_bavail * st.f_frsize < total:  # kept in memory rather than not moved
                            raise OSError(f"{spill_dir} has {st.f_bavail * st.f_frsize} bytes free, the move "
                                          f"needs {total}")
                        self.arena = _SpillArena(torch, total, spill_dir)
                        prepare = self.arena.populate
                    except OSError as e:  # no such directory, no MADV_POPULATE_WRITE: kept in memory
                        spill_error = f"{type(e).__name__}: {e}"[:300]
                if self.arena is None:
                    self.arena = _Arena(torch, total)
                ring = _Ring(torch, self.device_type == "cuda")
                pinned = ring.pinned
            rate, copied, t1 = 2e9, 0, time.monotonic()  # bytes/s until the first copies say
            for storage, offset in zip(fits, offsets):
                n = storage.nbytes()
                # what is issued but not yet drained (a ring's worth at most) counts against the deadline too
                if deadline is not None and time.monotonic() + (n + _Ring.pinned_bytes()) / rate > deadline:
                    if prepare is not None:  # a spill's moved bytes stay one run from its start: no holes
                        break
                    continue
                assert ring is not None and self.arena is not None
                ring.out(_as_bytes(torch, storage, n), self.arena.view(offset, n), prepare)
                issued.append((storage, offset, n))
                copied += n
                rate = max(copied / max(time.monotonic() - t1, 1e-6), 1e8)
            if ring is not None:
                ring.finish()  # every byte in the arena: only now may the device memory go
            for entry in issued:
                entry[0].resize_(0)
                self.moved.append(entry)
        except Exception as e:  # what is not emptied stays as it was; what is comes back with the reload
            error = f"{type(e).__name__}: {e}"[:300]
        finally:
            if ring is not None:
                ring.close()
        spill: dict[str, Any] | None = None
        if not self.moved:
            self.discard()
        elif isinstance(self.arena, _SpillArena):
            # unmapped and handed over before the hold is reported: CRIU never sees these bytes
            self.spill_fd = self.arena.handover(max(offset + n for _, offset, n in self.moved))
            spill = {"path": self.arena.path, "bytes": self.arena.size}
        left += fitting - sum(n for _, _, n in self.moved)  # past the deadline, or failed
        state = "moved" if not left and error is None else ("failed" if error and not self.moved else "partial")
        self.figures = {"state": state, "storages": len(self.moved), "bytes": sum(n for _, _, n in self.moved),
                        "kept_bytes": kept, **({"left_bytes": left} if left else {}),
                        **({"error": error} if error else {}),
                        **({"pinned": pinned} if pinned is not None and self.device_type == "cuda" else {}),
                        **({"spill": spill} if spill else {}), **({"spill_error": spill_error} if spill_error else {}),
                        "s": time.monotonic() - t0}
        return self.figures

    def reload(self, torch: Any, patience_s: float = 0.0, source_fd: int | None = None) -> None:
        """Every moved storage back on its device, with its bytes; the host copies unmapped. Device
        memory for every storage comes first: when the device has none for one (another process
        took what the hold freed), the allocator's cache is emptied and it is tried again for up to
        `patience_s` seconds before the error is raised, with every byte still in the arena (a
        later reload starts over). A spilled arena's bytes are read from `source_fd` (the release
        passes the executor's: the image's file after a restore), else from its own file by name;
        the file's name is gone once they are back. The caller keeps `source_fd` and closes it."""
        give_up = time.monotonic() + patience_s
        oom = getattr(torch, "OutOfMemoryError", RuntimeError)
        for storage, offset, n in self.moved:  # device memory for all first: a failure copies nothing
            while True:
                try:
                    if storage.nbytes() != n:  # resize_ to its own size would allocate and copy again
                        storage.resize_(n)
                    break
                except oom:
                    if time.monotonic() >= give_up:
                        raise
                    if self.device_type == "cuda":
                        torch.cuda.empty_cache()
                    time.sleep(0.5)
        if self.moved and isinstance(self.arena, _SpillArena):
            self._reload_spilled(torch, self.arena, source_fd)
        elif self.moved:
            arena = self.arena
            assert arena is not None
            try:
                ring: _Ring | None = _Ring(torch, self.device_type == "cuda")
            except Exception:  # no thread or mapping to spare for it: the plain copies, slower
                ring = None
            if ring is None:
                for storage, offset, n in self.moved:
                    _as_bytes(torch, storage, n).copy_(arena.view(offset, n))
            else:
                try:
                    for storage, offset, n in self.moved:
                        ring.back(arena.view(offset, n), _as_bytes(torch, storage, n))
                    ring.finish()
                finally:
                    ring.close()
        self.discard()

    def spilled(self) -> bool:
        return bool(self.moved) and isinstance(self.arena, _SpillArena)

    def spill_reachable(self) -> bool:
        """The spill's bytes can be read back through its own name (it is still the file made)."""
        if not isinstance(self.arena, _SpillArena):
            return False
        try:
            os.close(self.arena.reopen())
            return True
        except OSError:
            return False

    def discard(self) -> None:
        """The host copy dropped, unmapped, its file's name removed: once the bytes are back, or
        when the trainer stops (no use for them then)."""
        self.moved.clear()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def _reload_spilled(self, torch: Any, arena: _SpillArena, source_fd: int | None) -> None:
        """The moved bytes back from the spill file: the one `source_fd` names when it is a regular
        file long enough, else the arena's own by name; read into the ring's pinned slots."""
        import mmap
        import stat

        fd, own = source_fd, False
        try:
            try:
                st = os.fstat(fd) if fd is not None else None
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != arena.size:
                fd, own = arena.reopen(), True
            assert fd is not None
            parts = [(offset, _as_bytes(torch, storage, n)) for storage, offset, n in self.moved]
            try:
                ring: _Ring | None = _Ring(torch, self.device_type == "cuda")
            except Exception:  # no thread or mapping to spare for it: plain copies from a private mapping
                ring = None
            if ring is None:
                with mmap.mmap(fd, arena.size, flags=mmap.MAP_PRIVATE) as view:  # never written: the image's file
                    host = torch.frombuffer(view, dtype=torch.uint8)
                    for offset, dev in parts:
                        dev.copy_(host[offset:offset + dev.numel()])
                    del host
            else:
                try:
                    ring.back_from_file(fd, parts)
                finally:
                    ring.close()
        finally:
            if own and fd is not None:
                os.close(fd)


def _optimizer_tensors(torch: Any, optimizer: Any) -> list[Any]:
    """The optimizer's parameters, their gradients and its state's tensors (a DTensor's local
    shard: the wrapper itself has no memory); none when the optimizer is not shaped as torch's are."""
    out: list[Any] = []
    try:
        for group in getattr(optimizer, "param_groups", None) or []:
            for p in group.get("params", []):
                out.append(p)
                if getattr(p, "grad", None) is not None:
                    out.append(p.grad)
        for state in (getattr(optimizer, "state", None) or {}).values():
            if isinstance(state, dict):
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    except Exception:  # a hook never stops the trainer: nothing moves
        return []
    return [local if (local := getattr(t, "_local_tensor", None)) is not None else t for t in out]


_ALIGN = 4096  # each storage's bytes start on a page of the arena


def _host_room(proc_self: str = "/proc/self", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Bytes of memory this process may still take: the kernel's MemAvailable, and below it what
    its cgroup (v2) leaves under memory.max; 0 when the kernel does not say."""
    room = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return 0
    try:
        with open(f"{proc_self}/cgroup") as f:
            path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        if path is not None:
            base = os.path.join(cgroup_root, path.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as f:
                limit = f.read().strip()
            if limit != "max":
                with open(os.path.join(base, "memory.current")) as f:
                    room = min(room, max(0, int(limit) - int(f.read().strip())))
    except (OSError, ValueError):
        pass  # no cgroup v2 here, or no memory controller: the kernel's figure alone
    return room


def _as_bytes(torch: Any, storage: Any, n: int) -> Any:
    """A uint8 tensor over the first n bytes of an untyped storage (on its device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


class _Arena:
    """One anonymous mapping for the moved bytes, asked for transparent huge pages: a page fault per
    2 MiB instead of per 4 KiB while the copies fill it. On the H200 the first take moved 1.37 GB at
    1.4 GB/s into malloc's fresh pages and later ones at 8 GB/s into heap pages faulted before. It is
    unmapped as a whole by the reload, so nothing of it stays resident between snapshots."""

    def __init__(self, torch: Any, size: int) -> None:
        import mmap

        self.size = size
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            try:
                self.map.madvise(advice)
            except OSError:  # transparent huge pages are off in this kernel: 4 KiB pages then
                pass
        self.bytes: Any = torch.frombuffer(self.map, dtype=torch.uint8)

    def view(self, offset: int, n: int) -> Any:
        return self.bytes[offset:offset + n]

    def close(self) -> None:
        self.bytes = None
        # unmapped even while a tensor view of it lives (torch.frombuffer keeps no buffer export):
        # every copy into or out of it is waited for before this
        try:
            self.map.close()
        except BufferError:  # a Python buffer export of it is still open: unmapped when that goes
            pass


_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, an error instead of SIGBUS


class _SpillArena(_Arena):
    """The arena as a file of its own on a tmpfs (`_spill_dir`), when the executor asks for it (a
    process in its executor's mount namespace, outside a container).

    Why: CRIU writes every page of the frozen process through one thread, after the driver's
    checkpoint, inside the stall: 20.9 GB in 7.9-15.7 s for the 1.2 B trainer on the H200, 19.2 GB
    of it the moved bytes. This file is handed to the executor over the take socket (its
    descriptor), then unmapped and closed here before the hold is reported: CRIU never sees it, and
    the executor writes it into the image beside CRIU's run, or, for a leave-running snapshot, after
    the release. Its name stays until the reload, so a hold that ends without the executor (it gave
    up, or is gone) still finds its bytes. The pages are faulted in by MADV_POPULATE_WRITE just
    before the copies into them: a tmpfs that is full then fails the take with an error ("failed",
    nothing moved) instead of a SIGBUS in the trainer."""

    def __init__(self, torch: Any, size: int, directory: str) -> None:
        import mmap

        from ..names import take_spill_source_name

        self.size = size
        self.map: Any = None
        self.fd: int | None = None
        self.identity: tuple[int, int] | None = None
        self.path = os.path.join(directory, take_spill_source_name(os.getpid()))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino)
            from ..files import TMPFS_MAGIC, fs_type

            if fs_type(fd) != TMPFS_MAGIC:  # the executor takes only a file in memory (nor would a disk's be quick)
                raise OSError(f"{directory} is not a tmpfs")
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            # Huge pages where the tmpfs was mounted to give them: huge=within_size (as a node
            # mounts names.SPILL_TMPFS) gives them whatever is asked, huge=advise only where
            # asked, as here; a tmpfs mounted without huge= (/dev/shm as distributions mount
            # it) gives 4 KiB pages unless the node's shmem_enabled is "force" ("advise" there
            # made none, run 12c)
            advice = getattr(mmap, "MADV_HUGEPAGE", None)
            if advice is not None:
                try:
                    self.map.madvise(advice)
                except OSError:  # transparent huge pages are off in this kernel
                    pass
            self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
            self.populate(self.bytes, 1)  # a kernel without MADV_POPULATE_WRITE: no spill (OSError)
        except BaseException:
            os.close(fd)
            self.discard()
            raise
        self.fd = fd

    def populate(self, host: Any, n: int | None = None) -> None:
        """Fault in the pages under `host` (a uint8 view of this arena, page-aligned) writable."""
        length = host.numel() if n is None else n
        if _bound_libc().madvise(host.data_ptr(), length, _MADV_POPULATE_WRITE) != 0:
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, f"spill file {self.path}: {os.strerror(err)}")

    def _unmap(self) -> None:
        if self.map is not None:
            _Arena.close(self)
            self.map = None

    def handover(self, end: int) -> int | None:
        """Unmapped and cut to `end` (a partial take's last moved byte: the executor copies no
        hole); the descriptor, for the executor (the caller closes it once it is sent)."""
        self._unmap()
        fd, self.fd = self.fd, None
        if fd is not None and end < self.size:
            try:
                os.ftruncate(fd, end)
                self.size = end
            except OSError:
                pass  # handed over whole: the hole is copied too
        return fd

    def reopen(self) -> int:
        """A descriptor of this file through its name, when it is still the file made here."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            raise OSError(f"spill file {self.path} is another file now")
        return fd

    def discard(self) -> None:
        """Its name gone (when it is still this file's) and the mapping unmapped; never raises."""
        self._unmap()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            st = os.lstat(self.path)
            if self.identity is None or (st.st_dev, st.st_ino) == self.identity:
                os.unlink(self.path)  # None: failed before its identity was read, made by us all the same
        except OSError:
            pass  # gone already (another node's restore has no such name)

    def close(self) -> None:
        self.discard()


def _memmove(dst: int, src: int, n: int) -> None:
    import ctypes

    ctypes.memmove(dst, src, n)  # a foreign call: the GIL is released while it copies


class _Ring:
    """The few pinned host buffers every copy of the move passes through, out and back.

    Why: a copy between the device and pageable memory runs at 3.4-3.7 GB/s on the H200 (the
    driver stages it through pinned buffers of its own, one piece at a time); pinning the whole
    arena first (cudaHostRegister) costs about as much as it saves, the faulting and pinning of
    every page. Through a ring of SLOTS pinned buffers of SLOT_BYTES, the device copies into one
    while SLOTS threads copy the ones before it into the arena (memmove). 16 of 16 MiB: 19.2 GB
    out in 0.80 s (24 GB/s), against 2.9-6.7 s with 4 of 64 MiB and 5.6-7.0 s pageable, 1.37 GB in
    0.11 s against 0.29 s; back in 0.8 s against 2.3 s pageable (bench/gpu/copyout.py, runs 11a,
    11e and 12a, ways "take" and "take-16x16"). Tensor.copy_ in those threads copied out at 17-19
    GB/s, but left an OpenMP team per thread in the trainer; with a stream of our own as well, the
    image was 0.08 GB larger.
    The ring is unpinned and unmapped by close(), before the driver's checkpoint sees the process.
    On the CPU (the test suite's device) the same pieces go through the same slots and threads; the
    copy into a slot is then synchronous."""

    SLOTS = 16
    SLOT_BYTES = 16 << 20

    @classmethod
    def pinned_bytes(cls) -> int:
        """The host memory a ring takes, pinned; also the most its copies have in flight."""
        return cls.SLOTS * cls.SLOT_BYTES

    def __init__(self, torch: Any, cuda: bool) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.torch, self.cuda = torch, cuda
        self.device = torch.cuda.current_device() if cuda else None
        # every thread of the pool on the trainer's device: a CUDA call from a thread with none set
        # (an event's wait) would create a context on device 0 for the rest of the process
        self.pool = ThreadPoolExecutor(self.SLOTS, thread_name_prefix="snapguard-take-copy",
                                       **({"initializer": torch.cuda.set_device, "initargs": (self.device,)}
                                          if cuda else {}))
        self.map = _Arena(torch, self.pinned_bytes())
        self.pinned = False
        if cuda:
            self.pinned = self.pool.submit(self._pin, True).result()
        self.slots = [self.map.view(k * self.SLOT_BYTES, self.SLOT_BYTES) for k in range(self.SLOTS)]
        self.done: list[Any] = [None] * self.SLOTS  # per slot: the event after its last device copy
        self.draining: list[Any] = [None] * self.SLOTS  # per slot: the future of its copy into the arena
        self.used: set[Any] = set()  # the devices whose streams have copies of ours
        self.turn = 0

    def _pin(self, on: bool) -> bool:
        """Pin (portable: for every device's context) or unpin the ring; whether that worked. Run
        in a thread of the pool: a failure sets the CUDA runtime's last error of the calling
        thread, which PyTorch would read after the trainer's next kernel launch as that kernel's.
        Unpinned, the copies work all the same, at the pageable rate."""
        try:
            cudart = self.torch.cuda.cudart()
            if on:
                return int(cudart.cudaHostRegister(self.map.bytes.data_ptr(), self.map.size, 1)) == 0
            return int(cudart.cudaHostUnregister(self.map.bytes.data_ptr())) == 0
        except Exception:  # no runtime binding in this PyTorch: pageable then
            return False

    def _slot(self) -> int:
        """The next slot, once what used it before is done: its copy into the arena (whose error
        is raised here) and the device's copy into or out of it."""
        k, self.turn = self.turn, (self.turn + 1) % self.SLOTS
        pending, self.draining[k] = self.draining[k], None
        event, self.done[k] = self.done[k], None
        try:
            if pending is not None:
                pending.result()
        finally:
            if event is not None:
                event.synchronize()
        return k

    def _to_slot_and_mark(self, k: int, dst: Any, src: Any, device: Any) -> None:
        """dst.copy_(src) without waiting, on the device's current stream (no stream of our own:
        PyTorch's first one creates its pool of streams, kept by the driver's checkpoint after),
        and the slot's event after it."""
        if not self.cuda:
            dst.copy_(src)
            return
        torch = self.torch
        stream = torch.cuda.current_stream(device)
        self.used.add(device)
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event(blocking=True)  # its waiters sleep, not spin beside the memmoves
        event.record(stream)
        self.done[k] = event

    def _drain(self, event: Any, k: int, host: Any, prepare: Any = None) -> None:
        if prepare is not None:  # the destination's pages faulted in while the device copies
            prepare(host)
        if event is not None:
            event.synchronize()
        # a plain memcpy, not Tensor.copy_: PyTorch would start an OpenMP team (a thread per core)
        # for each of these threads, which would stay in the trainer, and in every image, for good
        _memmove(host.data_ptr(), self.slots[k].data_ptr(), host.numel())

    def out(self, device_bytes: Any, host: Any, prepare: Any = None) -> None:
        """Start copying a uint8 tensor on the device into `host` (uint8, as long). `prepare(view)`
        runs in the draining thread before each piece of `host` is written (_SpillArena.populate)."""
        for lo in range(0, device_bytes.numel(), self.SLOT_BYTES):
            piece = device_bytes[lo:lo + self.SLOT_BYTES]
            k = self._slot()
            self._to_slot_and_mark(k, self.slots[k][:piece.numel()], piece, device_bytes.device)
            self.draining[k] = self.pool.submit(self._drain, self.done[k], k, host[lo:lo + piece.numel()],
                                                *((prepare,) if prepare is not None else ()))

    def _read(self, event: Any, k: int, fd: int, offset: int, n: int) -> None:
        """Slot k filled with n bytes of the file at offset, once the device has read it before."""
        import ctypes

        if event is not None:
            event.synchronize()
        # a buffer over the slot's address, not a memoryview of the mapping: an open export would
        # keep the mapping from being unmapped
        view = memoryview((ctypes.c_char * n).from_address(self.slots[k].data_ptr())).cast("B")
        got = 0
        while got < n:
            read = os.preadv(fd, [view[got:]], offset + got)
            if read <= 0:
                raise OSError(f"the moved bytes end {offset + got} bytes into their file, {n - got} short")
            got += read

    def back_from_file(self, fd: int, parts: list[tuple[int, Any]]) -> None:
        """Copy, for each (offset, device uint8 tensor) of `parts`, the file's bytes at offset into
        the tensor; every copy done when it returns. The slots' reads run in the pool's threads,
        a ring's worth ahead of the device's copies: the reads of a cold file overlap."""
        pieces = [(offset + lo, dev[lo:lo + self.SLOT_BYTES])
                  for offset, dev in parts for lo in range(0, dev.numel(), self.SLOT_BYTES)]
        for i, (offset, dev) in enumerate(pieces[:self.SLOTS]):
            self.draining[i] = self.pool.submit(self._read, None, i, fd, offset, dev.numel())
        for i, (offset, dev) in enumerate(pieces):
            k = i % self.SLOTS
            pending, self.draining[k] = self.draining[k], None
            if pending is not None:
                pending.result()
            self._to_slot_and_mark(k, dev, self.slots[k][:dev.numel()], dev.device)
            if i + self.SLOTS < len(pieces):
                offset, dev = pieces[i + self.SLOTS]
                self.draining[k] = self.pool.submit(self._read, self.done[k], k, fd, offset, dev.numel())
        self.turn = len(pieces) % self.SLOTS
        self.finish()

    def back(self, host: Any, device_bytes: Any) -> None:
        """Start copying `host` (uint8) into a uint8 tensor on the device, as long."""
        for lo in range(0, device_bytes.numel(), self.SLOT_BYTES):
            piece = device_bytes[lo:lo + self.SLOT_BYTES]
            k = self._slot()  # the device is done reading this slot
            self.slots[k][:piece.numel()].copy_(host[lo:lo + piece.numel()])
            self._to_slot_and_mark(k, piece, self.slots[k][:piece.numel()], device_bytes.device)

    def finish(self) -> None:
        """Wait for every copy started; the first error of one is raised here."""
        for _ in range(self.SLOTS):
            self._slot()

    def close(self) -> None:
        """Unpinned and unmapped; copies still under way (after an error) are waited for first, so
        no thread or device copy writes into memory that is gone. Never raises: the take and the
        reload have their bytes, or their error, already."""
        for _ in range(self.SLOTS):
            try:
                self._slot()
            except Exception:
                pass  # the caller has its error already
        for device in self.used:
            try:
                self.torch.cuda.current_stream(device).synchronize()
            except Exception:
                pass
        try:
            if self.pinned:
                self.pinned = not self.pool.submit(self._pin, False).result()
        except Exception:  # the pool is broken: still registered, so left mapped below
            pass
        self.pool.shutdown(wait=True)
        self.slots = []
        if not self.pinned:  # still registered with the driver: left mapped rather than unmapped under it
            self.map.close()


def _offload_on() -> bool:
    return _env_switch("SNAPGUARD_TAKE_OFFLOAD", True)


def _spill_dir() -> str | None:
    """Where a spilled arena's file goes: SNAPGUARD_TAKE_SPILL_DIR; else names.SPILL_TMPFS when a
    tmpfs is mounted there that this process may write (a node that mounted one, huge=within_size:
    see `snapguard preflight --node`); else /dev/shm. None when SNAPGUARD_TAKE_SPILL=0: the moved bytes then stay in the process,
    and CRIU writes them."""
    if not _env_switch("SNAPGUARD_TAKE_SPILL", True):
        return None
    chosen = os.environ.get("SNAPGUARD_TAKE_SPILL_DIR", "").strip()
    if chosen:
        # as the executor looks it up: absolute, no link on the way, no trailing slash
        return os.path.realpath(chosen)
    from ..files import spill_tmpfs_usable
    from ..names import SPILL_TMPFS

    return SPILL_TMPFS if spill_tmpfs_usable(SPILL_TMPFS) else "/dev/shm"


def _offload_device() -> str:
    """The device whose tensors move: "cuda". SNAPGUARD_TAKE_OFFLOAD_DEVICE=cpu moves a CPU
    trainer's optimizer tensors instead, which gains nothing (they are host memory already) but runs
    the same copy, mapping, snapshot and reload where there is no GPU: the test suite's way to check
    them through CRIU."""
    return "cpu" if os.environ.get("SNAPGUARD_TAKE_OFFLOAD_DEVICE", "").strip().lower() == "cpu" else "cuda"


def _drop_grads(optimizer: Any) -> int:
    """Set the gradients of the optimizer's parameters to None; the bytes they held."""
    dropped = 0
    for group in getattr(optimizer, "param_groups", None) or []:
        for p in group.get("params", []):
            g = getattr(p, "grad", None)
            if g is not None:
                dropped += g.numel() * g.element_size()
                p.grad = None
    return dropped


class _TakePoint:
    def __init__(self, resolve: bool = False) -> None:
        self.step = 0
        self.trainer = False  # the step hook is registered: this process imported torch's optimizers
        self.resolve = resolve  # forked children drop GPU handles; the compile pool goes when idle
        self.pool = _CompilePool()
        self.hold_at: int | None = None
        self.reached = threading.Event()
        self.released = threading.Event()
        self.figures: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.requested_at = 0.0
        self.armed_at = 0.0  # time.monotonic() of the take's arrival
        self.wait_s = 10.0  # how long the executor waits for this take
        self.spill = False  # the executor takes the moved bytes' file (`_SpillArena`)
        self.handover_fd: int | None = None  # that file's descriptor, until the take's answer carries it
        self.release_fd: int | None = None  # the file the release passed back, to reload from
        self.holding = False  # between the hold's figures and its end: a release's file is for it
        # from the spill's file made to the reload's end: the file is mapped or open, and a dump
        # then (the executor's wait ran out: it snapshots without the hold) would need it
        self.spill_busy = False

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

    def pop_handover(self) -> int | None:
        with self.lock:
            fd, self.handover_fd = self.handover_fd, None
        return fd

    def _drop_release_fd(self) -> None:
        if self.release_fd is not None:
            os.close(self.release_fd)
            self.release_fd = None

    def release(self, fds: list[int]) -> None:
        """Go on; the first of `fds`, if any, is the spilled bytes' file to reload from: kept only
        while a hold is under way (a release that comes after its hold ended by itself must not
        be read by a later one: that would bring back older bytes)."""
        with self.lock:
            self._drop_release_fd()
            if self.holding and fds:
                self.release_fd, fds = fds[0], fds[1:]
            for extra in fds:
                os.close(extra)
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
        spill_dir = _spill_dir()
        out: dict[str, Any] = {"resolve": self.resolve,
                               "gpu_handles_dropped_in_children": self.resolve and _fork_handler is not None,
                               "spill": spill_dir is not None, "spill_dir": spill_dir, "spill_busy": self.spill_busy}
        if self.resolve:
            try:
                out["compile_pool"] = self.pool.status()
            except Exception as e:
                out["compile_pool"] = {"state": "unknown", "error": f"{type(e).__name__}: {e}",
                                       "shutdown_at_take": False}
        if self.resolve_error:
            out["resolve_error"] = self.resolve_error
        return out

    def _hold(self, optimizer: Any = None) -> None:
        import torch

        # First the compile pool (its processes hold NVML handles): gone before the figures.
        pool: dict[str, Any] | None = None
        if self.resolve:
            try:
                # within the executor's wait: past it, the executor finds the pool still there and refuses
                pool = self.pool.settle(max(1.0, min(_POOL_SHUTDOWN_S, self.wait_s - 0.5)))
            except Exception as e:
                pool = {"state": "unknown", "error": f"{type(e).__name__}: {e}"}
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        reserved_before = torch.cuda.memory_reserved() if cuda else 0
        host_before = _host_anon_bytes()
        t0 = time.monotonic()
        grads_dropped = _drop_grads(optimizer) if _DROP_GRADS else None
        offload: _Offload | None = None
        allocated = 0
        device = _offload_device()
        if cuda:
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated()
        # Every resident anonymous page is written into the image, and what nothing refers to any
        # more is neither to be moved nor kept: collected once, before the move and the cache's
        # emptying (which then returns its device memory too), and the freed heap given back below.
        gc.collect()
        wanted_dir = _spill_dir() if self.spill else None  # a statfs: not under the lock the socket's thread takes
        with self.lock:
            # the executor stopped waiting (disarm) or let go already: the snapshot goes on without
            # the hold, and a move now would only put a second copy into it, or, spilled, leave the
            # process with a file outside the image open. Decided under the lock disarm takes, so
            # that a spill begun is one the executor's status asks find busy.
            move = not self.released.is_set() and _offload_on() and (cuda or device == "cpu")
            spill_dir = wanted_dir if move else None
            self.spill_busy = spill_dir is not None
        if move:
            offload = _Offload(device)
            # what is not moved by then stays for the driver's checkpoint: the executor's wait
            # (which the step before the hold already used part of) also covers the trim below
            offload.take(torch, _optimizer_tensors(torch, optimizer), gc.get_objects(),
                         deadline=self.armed_at + 0.7 * self.wait_s, spill_dir=spill_dir)
            with self.lock:
                self.handover_fd, offload.spill_fd = offload.spill_fd, None
        workspaces = None
        if cuda:
            if offload is not None and offload.figures.get("state") in ("moved", "partial"):
                # the move found no CUDA graph and no private pool (a graph's kernels would keep
                # using the workspace they were captured with): cuBLAS's workspaces go too
                workspaces = _clear_cublas_workspaces(torch)
            torch.cuda.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)  # pinned staging buffers
            if host_empty is not None:
                host_empty()
        _malloc_trim()
        self.figures = {
            "pid": os.getpid(),
            "step": self.step,
            "reserved_before": reserved_before,
            "reserved_after": torch.cuda.memory_reserved() if cuda else 0,
            "allocated": allocated,
            "host_anon_before": host_before,
            "host_anon_after": _host_anon_bytes(),
            "trim_s": time.monotonic() - t0,
            **({"grads_dropped_bytes": grads_dropped} if grads_dropped is not None else {}),
            **({"cublas_workspaces_cleared": workspaces} if workspaces is not None else {}),
            "requested_at": self.requested_at,  # when the take arrived (unix time)
            "held_at": time.time(),
        }
        if pool is not None:
            self.figures["compile_pool"] = pool
        if offload is not None:
            self.figures["offload"] = offload.figures
        with self.lock:
            self.holding = True
        self.reached.set()
        # Hold at the boundary: the snapshot is taken while this thread waits here.
        self._wait_for_release(offload)
        unsent = self.pop_handover()  # the take's answer never went (the executor stopped waiting)
        if unsent is not None:
            os.close(unsent)
        with self.lock:
            self.holding = False
            source, self.release_fd = self.release_fd, None
        if offload is not None:
            t1 = time.monotonic()
            try:
                offload.reload(torch, patience_s=_RELOAD_PATIENCE_S, source_fd=source)
            except Exception as e:  # no device memory for it: the trainer cannot go on without its state
                offload.discard()  # nor can its spill's bytes be of use to anything: not left in memory
                raise RuntimeError(f"snapguard take point: the tensors moved to host memory for the snapshot "
                                   f"cannot come back onto the GPU: {type(e).__name__}: {e}") from e
            finally:
                if source is not None:
                    os.close(source)
            offload.figures["reload_s"] = time.monotonic() - t1
        elif source is not None:
            os.close(source)

    def _wait_for_release(self, offload: _Offload | None) -> None:
        """Until the release, or SNAPGUARD_TAKE_HOLD_S (a lost executor does not hold the trainer
        for ever). But a spilled hold whose file's name is gone can only go on with the file a
        release brings: it waits on. That is a trainer restored from a stop snapshot (the executor
        removed the name) or on another node: its wait's deadline was set on the clock of the
        node and boot it was dumped on, and may be long past once it is restored."""
        warned, wait = False, _HOLD_S
        while not self.released.wait(wait):
            if offload is None or not offload.spilled() or offload.spill_reachable():
                return
            wait = max(_HOLD_S, 1.0)  # not a spin, whatever the limit
            if not warned:
                warned = True
                try:
                    sys.stderr.write("snapguard take point: held past SNAPGUARD_TAKE_HOLD_S; the optimizer's "
                                     "bytes are in a file only the executor's release can bring back: waiting\n")
                except Exception:  # no stderr to tell (closed, or gone with the restore): wait all the same
                    pass


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the step hook as soon as torch's optimizer module has executed."""

    def __init__(self, point: _TakePoint) -> None:
        self.point = point

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _OPTIMIZER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, point = spec.loader, self.point

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                module.register_optimizer_step_post_hook(point.at_step_end)
                point.trainer = True

        spec.loader = _Loader()
        return spec


def _nccl_groups() -> bool:
    """Whether this process has an NCCL process group (cuda-checkpoint cannot checkpoint NCCL
    communicators, and procfs does not always show them)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    try:
        from torch.distributed.distributed_c10d import _world

        return any("nccl" in str(entry[0]).lower() for entry in _world.pg_map.values())
    except Exception:  # private API moved: ask the default group
        return "nccl" in str(dist.get_backend()).lower()


def _compile_worker() -> bool:
    """This interpreter is inductor's compile worker sidecar (`python -m torch._inductor.compile_worker`,
    started by the trainer with its environment, so with the hook): it imports torch's optimizers
    but never steps, and is no trainer to hold."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and str(getattr(spec, "name", "")).startswith("torch._inductor.compile_worker"):
        return True  # python -m
    path = os.path.normpath(str(getattr(main, "__file__", "") or ""))  # python <path>/__main__.py, as SubprocPool runs it
    return path.endswith(os.path.join("torch", "_inductor", "compile_worker", "__main__.py"))


def _answer(point: _TakePoint, words: list[str], fds: list[int]) -> tuple[dict[str, Any], int | None]:
    """The reply to one request, and a descriptor to send with it (a take's spilled bytes). `fds`
    came with the request: a release's is the file to reload from; any other request's are closed."""
    if words[0] == "release":
        point.release(fds)
        return {"ok": True}, None
    for fd in fds:
        os.close(fd)
    if words[0] == "status":
        return {"ok": True, "step": point.step, "trainer": point.trainer and not _compile_worker(),
                "nccl": _nccl_groups(), "pid": os.getpid(), **point.status()}, None
    if words[0] in ("take", "take-at"):
        spill = "spill" in words  # an option word after the numbers: the executor takes the file
        numbers = [w for w in words[1:] if w != "spill"]
        at = int(numbers[0]) if words[0] == "take-at" else None
        wait = float(numbers[-1]) if len(numbers) > (1 if at is not None else 0) else 10.0
        if at is not None and point.step >= at:
            return {"ok": False, "error": f"step {at} already passed (at {point.step})", "step": point.step}, None
        point.arm(at, wait, spill)
        if point.reached.wait(wait):
            return {"ok": True, **point.figures}, point.pop_handover()
        point.disarm()
        return {"ok": False, "error": "no step boundary in time", "step": point.step}, None
    return {"ok": False, "error": f"unknown request {words[0]!r}"}, None


def _request(conn: socket.socket) -> tuple[list[str], list[int]]:
    """One request line and the descriptors sent with it (SCM_RIGHTS, with its first bytes)."""
    from ..wire import recv_fds

    data, fds = recv_fds(conn, 4096, 4)
    while data and b"\n" not in data and len(data) < 4096:
        more = conn.recv(4096)
        if not more:
            break
        data += more
    return data.decode(errors="replace").split("\n", 1)[0].split(), fds


def _serve(path: str, point: _TakePoint) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                words, fds = _request(conn)
            except OSError:
                continue
            if not words:
                for fd in fds:
                    os.close(fd)
                continue
            reply, handover = _answer(point, words, fds)
            data = (json.dumps(reply) + "\n").encode()
            try:
                sent = socket.send_fds(conn, [data], [handover]) if handover is not None else 0
                conn.sendall(data[sent:])
            except OSError:
                pass  # the executor is gone: a hold goes on by itself after its limit
            finally:
                if handover is not None:
                    os.close(handover)  # ours closed before the executor reads the end of the reply


def start(take_dir: str) -> None:
    from . import socket_path

    os.makedirs(take_dir, mode=0o700, exist_ok=True)
    point = _TakePoint(resolve=resolving())
    if point.resolve:
        _install_fork_handler()
    if _OPTIMIZER_MODULE in sys.modules:
        sys.modules[_OPTIMIZER_MODULE].register_optimizer_step_post_hook(point.at_step_end)
        point.trainer = True
    else:
        sys.meta_path.insert(0, _RegisterOnImport(point))
    threading.Thread(target=_serve, args=(socket_path(take_dir, os.getpid()), point),
                     name="snapguard-take-point", daemon=True).start()
