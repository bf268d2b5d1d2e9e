"""The host memory the optimizer's bytes move through: `Arena`, one mapping that holds them while
the trainer is held, and `Ring`, the few pinned buffers every copy passes through on its way
between the device and the arena."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ALIGN", "Arena", "Ring", "as_bytes", "memmove"]

ALIGN = 4096  # each storage's bytes start on a page of the arena


def as_bytes(torch: Any, storage: Any, n: int) -> Any:
    """A uint8 tensor over the first n bytes of an untyped storage (on its device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


class Arena:
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


def memmove(dst: int, src: int, n: int) -> None:
    import ctypes

    ctypes.memmove(dst, src, n)  # a foreign call: the GIL is released while it copies


class Ring:
    """The few pinned host buffers every copy of the move passes through, out and back.

    Why: a copy between the device and pageable memory runs at 3.4-3.7 GB/s on the H200 (the
    driver stages it through pinned buffers of its own, one piece at a time); pinning the whole
    arena first (cudaHostRegister) costs about as much as it saves, the faulting and pinning of
    every page. Through a ring of SLOTS pinned buffers of SLOT_BYTES, the device copies into one
    while SLOTS threads copy the ones before it into the arena (memmove). 16 of 16 MiB: 19.2 GB
    out in 0.80 s (24 GB/s), against 2.9-6.7 s with 4 of 64 MiB and 5.6-7.0 s pageable, 1.37 GB in
    0.11 s against 0.29 s; back in 0.8 s against 2.3 s pageable (bench/gpu/copyout.py, ways "take"
    and "take-16x16"). Tensor.copy_ in those threads copies out at 17-19 GB/s, but leaves an
    OpenMP team per thread in the trainer; with a stream of our own as well, the image is 0.08 GB
    larger.
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
        self.map = Arena(torch, self.pinned_bytes())
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
        memmove(host.data_ptr(), self.slots[k].data_ptr(), host.numel())

    def out(self, device_bytes: Any, host: Any, prepare: Any = None) -> None:
        """Start copying a uint8 tensor on the device into `host` (uint8, as long). `prepare(view)`
        runs in the draining thread before each piece of `host` is written (SpillArena.populate)."""
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


