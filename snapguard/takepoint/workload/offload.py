"""The hold's move of the stepped optimizer's tensors off the device into host memory, and back on
the release (`Offload`); with the helpers the hold uses around it (the host's room and the C heap's
trim, from hostmem; cuBLAS's workspaces; the gradients dropped)."""

from __future__ import annotations

import heapq
import os
import time
from typing import Any, Sequence

from ..protocol import ERROR, MOVED_BYTES, MOVED_STORAGES, SPILL, SPILL_BYTES, SPILL_PATH
from . import halves
from .hostmem import host_anon_bytes, host_room, malloc_trim
from .ring import ALIGN, Arena, Ring, as_bytes
from .spill import SpillArena

__all__ = ["Offload", "clear_cublas_workspaces", "drop_grads", "host_anon_bytes", "host_room", "malloc_trim",
           "optimizer_tensors"]


def clear_cublas_workspaces(torch: Any) -> bool:
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


class Offload:
    """The hold's move of the stepped optimizer's tensors off the device, and back on the release.

    Why: the driver's checkpoint copies every byte of device memory a process holds to the host at
    about 2 GB/s on the H200, and its restore copies it back; PyTorch copies its own tensors at
    several times that, and leaves none of the allocator's unused reserve. So at the hold the
    storages of the optimizer's parameters, gradients and state are copied into one host mapping
    (`Arena`) and their device memory freed: the storage object stays, emptied, so every view and
    every Python reference to it stays valid (FSDP's resize_(0)). The driver's checkpoint then holds
    what is left (the CUDA context, other tensors). On the release each storage gets fresh device
    memory and its bytes back, before the trainer's next step: the same bytes at another address.
    A storage whose every 4-byte word has zero low 16 bits (bfloat16 values held as float32: the
    gradients under bf16 autocast) keeps only its high halves in the arena (halves.py).

    Only the optimizer's tensors move: what the trainer's step owns. Nothing moves while something
    may replay kernels at fixed addresses (a CUDA graph, memory in a private pool: torch.compile's
    reduce-overhead mode); a storage the allocator does not own stays, and so does one whose memory
    another storage also covers (a DLPack export, from_blob): that one would go on reading the old
    address. What no Python object shows (a raw pointer kept by an extension, a CUDA IPC export
    read by another process) cannot be seen here: such a trainer, or one whose own threads touch
    the optimizer's tensors while it is held, sets SNAPGUARD_TAKE_OFFLOAD=0."""

    def __init__(self, device_type: str, halve: bool | None = None) -> None:
        self.device_type = device_type
        # storages kept at half their size where lossless (halves.py); on by default on a GPU, where
        # the check is a reduction per storage at the device's rate (on a CPU it reads every byte)
        self.halve = device_type == "cuda" if halve is None else halve
        self.moved: list[tuple[Any, int, int]] = []  # (the storage, its bytes' offset in the arena, their count)
        self.halved: set[int] = set()  # arena offsets of the storages kept as their high halves (halves.py)
        self.give_up = 0.0  # the reload's deadline for device memory (time.monotonic())
        self.arena: Arena | None = None
        self.spill_fd: int | None = None  # a SpillArena's descriptor, for the executor
        self.figures: dict[str, Any] = {"state": "none"}
        self.spill_error: str | None = None  # why the take's spill file could not be made

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
        take is not outrun), stays on the device ("partial"). The copies go through `Ring` (whose
        pinned buffers count against `room`); no storage is emptied before every copy is done, so a
        copy that fails leaves them all in place ("failed"). With `spill_dir` the arena is a file
        there (`SpillArena`, else anonymous memory when that cannot be made: `spill_error`), handed
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
        error, pinned, halved = None, None, set()
        try:
            if self.device_type == "cuda":  # every device the copies read from, not only the current one
                for index in sorted({st.device.index for st in movable if st.device.index is not None}):
                    torch.cuda.synchronize(index)
            if self.halve:
                halved = {st._cdata for st, ok in zip(movable, halves.exact(torch, movable)) if ok}
        except Exception as e:  # nothing is copied: every storage stays as it was
            error, movable = f"{type(e).__name__}: {e}"[:300], []
        # host memory the copies may take: a trainer the kernel or its cgroup would kill for it is
        # worse off than one whose bytes the driver copies (which fails with an error when short)
        room = int(host_room() * 0.8) - Ring.pinned_bytes() if room is None else room
        fits, offsets, total, left = _fit(movable, room, halved)  # left: bytes that stay, here those with no room
        self.halved = {offset for st, offset in zip(fits, offsets) if st._cdata in halved}
        fitting = sum(st.nbytes() for st in fits)
        self.spill_error = None
        ring: Ring | None = None
        try:
            prepare = None
            if fits:
                prepare = self._open_arena(torch, total, spill_dir)
                ring = Ring(torch, self.device_type == "cuda")
                pinned = ring.pinned
            issued = self._copy_out(torch, ring, fits, offsets, deadline, prepare)
            for entry in issued:  # every byte in the arena: only now may the device memory go
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
        elif isinstance(self.arena, SpillArena):
            # unmapped and handed over before the hold is reported: CRIU never sees these bytes
            self.spill_fd = self.arena.handover(max(offset + self.kept(offset, n) for _, offset, n in self.moved))
            spill = {SPILL_PATH: self.arena.path, SPILL_BYTES: self.arena.size}
        left += fitting - sum(n for _, _, n in self.moved)  # past the deadline, or failed
        state = "moved" if not left and error is None else ("failed" if error and not self.moved else "partial")
        self.figures = {"state": state, MOVED_STORAGES: len(self.moved),
                        MOVED_BYTES: sum(self.kept(offset, n) for _, offset, n in self.moved), "kept_bytes": kept,
                        **({"halved": {"storages": len(self.halved), "saved_bytes": sum(
                            n - self.kept(o, n) for _, o, n in self.moved)}} if self.halved else {}),
                        **({"left_bytes": left} if left else {}),
                        **({ERROR: error} if error else {}),
                        **({"pinned": pinned} if pinned is not None and self.device_type == "cuda" else {}),
                        **({SPILL: spill} if spill else {}),
                        **({"spill_error": self.spill_error} if self.spill_error else {}),
                        "s": time.monotonic() - t0}
        return self.figures

    def _open_arena(self, torch: Any, total: int, spill_dir: str | None) -> Any:
        """The arena for `total` bytes: a file of its own in `spill_dir` when one can be made there
        (its `populate` returned, to fault its pages in as the copies fill them), else anonymous
        memory (None returned; why the file could not be made in `spill_error`)."""
        prepare = None
        if spill_dir is not None:
            try:
                st = os.statvfs(spill_dir)
                if st.f_bavail * st.f_frsize < total:  # kept in memory rather than not moved
                    raise OSError(f"{spill_dir} has {st.f_bavail * st.f_frsize} bytes free, the move "
                                  f"needs {total}")
                self.arena = SpillArena(torch, total, spill_dir)
                prepare = self.arena.populate
            except OSError as e:  # no such directory, no MADV_POPULATE_WRITE: kept in memory
                self.spill_error = f"{type(e).__name__}: {e}"[:300]
        if self.arena is None:
            self.arena = Arena(torch, total)
        return prepare

    def _copy_out(self, torch: Any, ring: Ring | None, fits: list[Any], offsets: list[int], deadline: float | None,
                  prepare: Any) -> list[tuple[Any, int, int]]:
        """Each storage of `fits` copied into the arena at its offset, through `ring`, while the
        rate so far says it is done by `deadline`; (storage, offset, bytes) of those copied, every
        copy finished."""
        issued: list[tuple[Any, int, int]] = []
        rate, copied, t1 = 2e9, 0, time.monotonic()  # bytes/s until the first copies say
        for storage, offset in zip(fits, offsets):
            n = storage.nbytes()
            # what is issued but not yet drained (a ring's worth at most) counts against the deadline too
            if deadline is not None and time.monotonic() + (n + Ring.pinned_bytes()) / rate > deadline:
                if prepare is not None:  # a spill's moved bytes stay one run from its start: no holes
                    break
                continue
            assert ring is not None and self.arena is not None
            # a halved storage's high halves: a copy of its own, freed in the stream's order
            src = halves.high_halves(torch, storage, n) if offset in self.halved else as_bytes(torch, storage, n)
            ring.out(src, self.arena.view(offset, src.numel()), prepare)
            issued.append((storage, offset, n))
            copied += n
            rate = max(copied / max(time.monotonic() - t1, 1e-6), 1e8)
        if ring is not None:
            ring.finish()
        return issued

    def kept(self, offset: int, n: int) -> int:
        """The bytes the arena holds of the storage of n bytes at `offset`."""
        return n // 2 if offset in self.halved else n

    def _back(self, torch: Any, storage: Any, offset: int, n: int) -> Any:
        """Where the arena's bytes of a storage go on the device: the storage's own bytes, or for a
        halved one a buffer of their size, widened into it by `_widen` after the copy."""
        if offset not in self.halved:
            return as_bytes(torch, storage, n)
        return self._patiently(torch, lambda: torch.empty(n // 2, dtype=torch.uint8, device=storage.device))

    def _widen(self, torch: Any, back: list[tuple[Any, int, int, Any]]) -> None:
        for storage, offset, n, dev in back:
            if offset in self.halved:
                halves.widen(torch, storage, n, dev)

    def reload(self, torch: Any, patience_s: float = 0.0, source_fd: int | None = None) -> None:
        """Every moved storage back on its device, with its bytes; the host copies unmapped. Device
        memory for every storage comes first: when the device has none for one (another process
        took what the hold freed), the allocator's cache is emptied and it is tried again for up to
        `patience_s` seconds before the error is raised, with every byte still in the arena (a
        later reload starts over). A spilled arena's bytes are read from `source_fd` (the release
        passes the executor's: the image's file after a restore), else from its own file by name;
        the file's name is gone once they are back. The caller keeps `source_fd` and closes it."""
        self.give_up = time.monotonic() + patience_s
        for storage, offset, n in self.moved:  # device memory for all first: a failure copies nothing
            if storage.nbytes() != n:  # resize_ to its own size would allocate and copy again
                self._patiently(torch, lambda: storage.resize_(n))
        if self.moved and isinstance(self.arena, SpillArena):
            self._reload_spilled(torch, self.arena, source_fd)
        elif self.moved:
            arena = self.arena
            assert arena is not None
            try:
                ring: Ring | None = Ring(torch, self.device_type == "cuda")
            except Exception:  # no thread or mapping to spare for it: the plain copies, slower
                ring = None
            try:
                for batch in _batches(self.moved, self.halved):  # the halved ones' buffers, a batch at a time
                    back = [(st, offset, n, self._back(torch, st, offset, n)) for st, offset, n in batch]
                    for _, offset, _, dev in back:
                        if ring is None:
                            dev.copy_(arena.view(offset, dev.numel()))
                        else:
                            ring.back(arena.view(offset, dev.numel()), dev)
                    if ring is not None:
                        ring.finish()
                    self._widen(torch, back)
            finally:
                if ring is not None:
                    ring.close()
        self.discard()

    def _patiently(self, torch: Any, allocate: Any) -> Any:
        """allocate(), tried again while the device has no memory for it, the allocator's cache
        emptied in between, until `give_up` (time.monotonic()); then its error is raised."""
        oom = getattr(torch, "OutOfMemoryError", RuntimeError)
        while True:
            try:
                return allocate()
            except oom:
                if time.monotonic() >= self.give_up:
                    raise
                if self.device_type == "cuda":
                    torch.cuda.empty_cache()
                time.sleep(0.5)

    def spilled(self) -> bool:
        return bool(self.moved) and isinstance(self.arena, SpillArena)

    def spill_reachable(self) -> bool:
        """The spill's bytes can be read back through its own name (it is still the file made)."""
        if not isinstance(self.arena, SpillArena):
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

    def _reload_spilled(self, torch: Any, arena: SpillArena, source_fd: int | None) -> None:
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
            try:
                ring: Ring | None = Ring(torch, self.device_type == "cuda")
            except Exception:  # no thread or mapping to spare for it: plain copies from a private mapping
                ring = None
            try:
                for batch in _batches(self.moved, self.halved):  # the halved ones' buffers, a batch at a time
                    back = [(st, offset, n, self._back(torch, st, offset, n)) for st, offset, n in batch]
                    if ring is None:
                        with mmap.mmap(fd, arena.size, flags=mmap.MAP_PRIVATE) as view:  # never written
                            host = torch.frombuffer(view, dtype=torch.uint8)
                            for _, offset, _, dev in back:
                                dev.copy_(host[offset:offset + dev.numel()])
                            del host
                    else:
                        ring.back_from_file(fd, [(offset, dev) for _, offset, _, dev in back])
                    self._widen(torch, back)
            finally:
                if ring is not None:
                    ring.close()
        finally:
            if own and fd is not None:
                os.close(fd)


def _batches(moved: list[tuple[Any, int, int]], halved: set[int],
             most: int = 256 << 20) -> list[list[tuple[Any, int, int]]]:
    """`moved` in order, cut so that the halved storages of a batch need at most `most` bytes of
    device buffers on the reload (a batch holds one storage at least)."""
    out: list[list[tuple[Any, int, int]]] = [[]]
    used = 0
    for entry in moved:
        need = entry[2] // 2 if entry[1] in halved else 0
        if need and used + need > most and out[-1]:
            out.append([])
            used = 0
        out[-1].append(entry)
        used += need
    return out if out[0] else []


def _fit(movable: list[Any], room: int, halved: set[int]) -> tuple[list[Any], list[int], int, int]:
    """The storages of `movable` that fit in `room` bytes, in order, each from a page of the arena
    (a storage whose key is in `halved` takes half its bytes): (those, their offsets, the arena's
    size, the bytes of those left out)."""
    fits, offsets, total, left = [], [], 0, 0
    for storage in movable:
        size = -(-(storage.nbytes() // (2 if storage._cdata in halved else 1)) // ALIGN) * ALIGN
        if total + size > room:
            left += storage.nbytes()
            continue
        fits.append(storage)
        offsets.append(total)
        total += size
    return fits, offsets, total, left


def optimizer_tensors(torch: Any, optimizer: Any) -> list[Any]:
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


def drop_grads(optimizer: Any) -> int:
    """Set the gradients of the optimizer's parameters to None; the bytes they held."""
    dropped = 0
    for group in getattr(optimizer, "param_groups", None) or []:
        for p in group.get("params", []):
            g = getattr(p, "grad", None)
            if g is not None:
                dropped += g.numel() * g.element_size()
                p.grad = None
    return dropped


