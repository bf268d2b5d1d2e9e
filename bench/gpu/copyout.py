"""How fast the take point's move can copy an optimizer's tensors off the GPU into one host mapping,
and back, by each of several ways: measured on the same tensors in one run, each way on a fresh
mapping (as every take gets one), the bytes checked after each round trip.

    python3 bench/gpu/copyout.py OUT.json [--sizes-gb 1.37,19.2] [--repeat 2]

Ways, out (device -> the mapping) and back (the mapping -> device):
  pageable   each storage copied by copy_() into the mapping's pages (run 10's take); the
             driver stages pageable copies through its own pinned buffers.
  register   the mapping registered with the driver (cudaHostRegister: pinned), the copies issued
             without a wait, then unregistered; the register call faults and pins every page.
  populate   as register, but the pages faulted first by MADV_POPULATE_WRITE from 8 threads.
  staging    a ring of 4 pinned 64 MiB buffers: the GPU copies into one while CPU threads copy the
             one before into the mapping (and the reverse back).
  take       as staging, the way the take point does it: the CPU threads copy by memmove (ctypes;
             Tensor.copy_ starts an OpenMP team in each thread) and the device copies run on the
             current stream (no stream pool created).
  take-8x32, take-8x64, take-16x16
             the take's way with more slots and draining threads (slots x MiB each).
The table gives seconds and GB/s per way and direction, the first and the best of --repeat runs.
Page cache plays no part (anonymous memory only)."""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MIB = 1 << 20
SLOT = 64 * MIB
SLOTS = 4
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def tensors_of(total: int) -> list[torch.Tensor]:
    """fp32 tensors shaped as a GPT's parameters, gradients and Adam state: a few large, many mid."""
    sizes, left = [], total
    pattern = [154 * MIB, 64 * MIB, 48 * MIB, 16 * MIB, 9 * MIB, 2 * MIB, 12 * 1024]
    i = 0
    while left > 0:
        n = min(pattern[i % len(pattern)], left)
        sizes.append(n)
        left -= n
        i += 1
    g = torch.Generator(device="cuda").manual_seed(7)
    return [torch.rand(n // 4, device="cuda", generator=g) for n in sizes]


class Mapping:
    def __init__(self, size: int) -> None:
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.size = size

    @property
    def ptr(self) -> int:
        return self.bytes.data_ptr()

    def populate(self, threads: int = 8) -> None:
        step = -(-self.size // threads // (2 * MIB)) * 2 * MIB

        def one(lo: int) -> None:
            n = min(step, self.size - lo)
            if _libc.madvise(ctypes.c_void_p(self.ptr + lo), n, MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, self.size, step)))

    def register(self) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.ptr, self.size, 0))

    def unregister(self) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.ptr))

    def close(self) -> None:
        self.bytes = None  # type: ignore[assignment]
        self.map.close()


def layout(ts: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in ts:
        offsets.append(total)
        total += -(-t.numel() * 4 // 4096) * 4096
    return offsets, total


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def out_pageable(ts, offsets, m: Mapping, marks: dict) -> None:
    for t, o in zip(ts, offsets):
        n = t.numel() * 4
        m.bytes[o:o + n].copy_(flat(t))


def back_pageable(ts, offsets, m: Mapping, marks: dict) -> None:
    for t, o in zip(ts, offsets):
        n = t.numel() * 4
        flat(t).copy_(m.bytes[o:o + n])


def _registered(direction: str, populate: bool):
    def run(ts, offsets, m: Mapping, marks: dict) -> None:
        t0 = time.monotonic()
        if populate and direction == "out":
            m.populate()
        t1 = time.monotonic()
        m.register()
        t2 = time.monotonic()
        for t, o in zip(ts, offsets):
            n = t.numel() * 4
            if direction == "out":
                m.bytes[o:o + n].copy_(flat(t), non_blocking=True)
            else:
                flat(t).copy_(m.bytes[o:o + n], non_blocking=True)
        torch.cuda.synchronize()
        t3 = time.monotonic()
        m.unregister()
        t4 = time.monotonic()
        marks.update(populate_s=t1 - t0, register_s=t2 - t1, copy_s=t3 - t2, unregister_s=t4 - t3)
    return run


def _pieces(ts, offsets, slot: int = SLOT):
    for t, o in zip(ts, offsets):
        b, n = flat(t), t.numel() * 4
        for lo in range(0, n, slot):
            yield b[lo:lo + slot], o + lo


def _staging(direction: str, memmove: bool = False, side_stream: bool = True, n_slots: int = SLOTS,
             slot: int = SLOT):
    def run(ts, offsets, m: Mapping, marks: dict) -> None:
        t0 = time.monotonic()
        ring = Mapping(slot * n_slots)
        ring.populate(min(n_slots, 8))
        ring.register()
        slots = [ring.bytes[i * slot:(i + 1) * slot] for i in range(n_slots)]
        stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
        events = [torch.cuda.Event() for _ in range(n_slots)]
        busy: list = [None] * n_slots
        t1 = time.monotonic()
        torch.cuda.current_stream().synchronize()
        with ThreadPoolExecutor(n_slots) as pool, torch.cuda.stream(stream):
            for j, (dev, off) in enumerate(_pieces(ts, offsets, slot)):
                k, n = j % n_slots, dev.numel()
                if busy[k] is not None:
                    busy[k].result()
                if direction == "out":
                    slots[k][:n].copy_(dev, non_blocking=True)
                    events[k].record(stream)

                    def drain(k=k, n=n, off=off):
                        events[k].synchronize()
                        if memmove:
                            ctypes.memmove(m.ptr + off, slots[k].data_ptr(), n)
                        else:
                            m.bytes[off:off + n].copy_(slots[k][:n])
                    busy[k] = pool.submit(drain)
                else:
                    events[k].synchronize()  # the GPU is done reading this slot's last piece
                    slots[k][:n].copy_(m.bytes[off:off + n])
                    dev.copy_(slots[k][:n], non_blocking=True)
                    events[k].record(stream)
                    busy[k] = None
            for f in busy:
                if f is not None:
                    f.result()
            stream.synchronize()
        t2 = time.monotonic()
        ring.unregister()
        ring.close()
        marks.update(setup_s=t1 - t0, copy_s=t2 - t1, teardown_s=time.monotonic() - t2)
    return run


WAYS = {
    "pageable": (out_pageable, back_pageable),
    "register": (_registered("out", False), _registered("back", False)),
    "populate": (_registered("out", True), _registered("back", False)),
    "staging": (_staging("out"), _staging("back")),
    "take": (_staging("out", memmove=True, side_stream=False), _staging("back", side_stream=False)),
    # the take's way with more draining threads: 8 x 32 MiB (the same 256 MiB pinned), 8 x 64 MiB, 16 x 16 MiB
    "take-8x32": (_staging("out", memmove=True, side_stream=False, n_slots=8, slot=32 * MIB),
                  _staging("back", side_stream=False, n_slots=8, slot=32 * MIB)),
    "take-8x64": (_staging("out", memmove=True, side_stream=False, n_slots=8, slot=64 * MIB),
                  _staging("back", side_stream=False, n_slots=8, slot=64 * MIB)),
    "take-16x16": (_staging("out", memmove=True, side_stream=False, n_slots=16, slot=16 * MIB),
                   _staging("back", side_stream=False, n_slots=16, slot=16 * MIB)),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--sizes-gb", default="1.37,19.2")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ways", default=",".join(WAYS))
    args = ap.parse_args()
    unknown = [w for w in args.ways.split(",") if w not in WAYS]
    if unknown:
        ap.error(f"unknown ways {unknown}; known: {', '.join(WAYS)}")
    if not torch.cuda.is_available():
        print("copyout.py: needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    rows = []
    for gb in (float(s) for s in args.sizes_gb.split(",")):
        ts = tensors_of(int(gb * 1e9) // 4 * 4)
        ref = [t.clone() for t in ts[:3]] + [ts[-1].clone()]
        offsets, total = layout(ts)
        torch.cuda.synchronize()
        for way in args.ways.split(","):
            out_fn, back_fn = WAYS[way]
            for r in range(args.repeat):
                m = Mapping(total)
                marks_out: dict = {}
                torch.cuda.synchronize()
                t0 = time.monotonic()
                out_fn(ts, offsets, m, marks_out)
                torch.cuda.synchronize()
                out_s = time.monotonic() - t0
                for t in ts:
                    t.zero_()
                torch.cuda.synchronize()
                marks_back: dict = {}
                t0 = time.monotonic()
                back_fn(ts, offsets, m, marks_back)
                torch.cuda.synchronize()
                back_s = time.monotonic() - t0
                exact = all(torch.equal(a, b) for a, b in zip(ts[:3] + [ts[-1]], ref))
                m.close()
                row = {"gb": total / 1e9, "way": way, "run": r, "out_s": out_s, "back_s": back_s,
                       "out_gbps": total / 1e9 / out_s, "back_gbps": total / 1e9 / back_s,
                       "out_marks": marks_out, "back_marks": marks_back, "exact": exact}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if not exact:
                    print(f"copyout.py: {way} did not bring the bytes back", file=sys.stderr)
        del ts, ref
        torch.cuda.empty_cache()
    lines = ["| GB | way | out s (first / best) | out GB/s | back s (first / best) | back GB/s | exact |",
             "|---|---|---|---|---|---|---|"]
    for gb in sorted({r["gb"] for r in rows}):
        for way in args.ways.split(","):
            rs = [r for r in rows if r["gb"] == gb and r["way"] == way]
            if not rs:
                continue
            bo, bb = min(r["out_s"] for r in rs), min(r["back_s"] for r in rs)
            lines.append(f"| {gb:.2f} | {way} | {rs[0]['out_s']:.3f} / {bo:.3f} | {gb / bo:.1f} | "
                         f"{rs[0]['back_s']:.3f} / {bb:.3f} | {gb / bb:.1f} | {all(r['exact'] for r in rs)} |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(json.dumps({"rows": rows, "threads": torch.get_num_threads()}, indent=2) + "\n")
    Path(args.out).with_suffix(".txt").write_text(text + "\n")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
