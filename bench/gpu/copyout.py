"""How fast the take point's move can copy an optimizer's tensors off the GPU into one host mapping,
and back, by each of several ways: measured on the same tensors in one run, each way on a fresh
mapping (as every take gets one), the bytes checked after each round trip.

    python3 bench/gpu/copyout.py OUT.json [--sizes-gb 1.37,19.2] [--repeat 2] [--ways take,...]
                                          [--disk-dir /var/tmp] [--budget-s 0]

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
  take-shm   the take's way, but the mapping is MAP_SHARED of a regular file made fresh in /dev/shm
             (O_EXCL, 0600, a random name, ftruncate to the size; unlinked when the run ends); back
             from the same mapping.
  take-shm-8x32
             take-shm with 8 slots x 32 MiB.
  take-shm-pwrite
             the take's ring, but each draining thread writes its slot into that /dev/shm file by
             os.pwrite (no mapping); back: 4 threads read each piece by os.preadv straight into a
             pinned slot, and the slot is copied to the device.
  back-disk-cold
             out as take-shm-pwrite but into a file in --disk-dir (default /var/tmp), then fsync (out
             s includes it; fsync_s apart in the marks); then sync, drop_caches (3) and the file's
             pages dropped by posix_fadvise(DONTNEED), the share still resident recorded (mincore);
             back as take-shm-pwrite's, 4 reading threads, from the cold file.
  back-disk-cold-8
             the same, a fresh file and a fresh drop, back with 8 reading threads (8 slots x 64 MiB).
The table gives seconds and GB/s per way and direction, the first and the best of --repeat runs.
Page cache plays no part in the first ways (anonymous memory only); the shm ways' pages are shmem
(page cache of tmpfs), the disk ways' go through the disk's page cache and are dropped before back.
A way whose file would not fit in its file system's free space is skipped (a row says why)."""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

MIB = 1 << 20
SLOT = 64 * MIB
SLOTS = 4
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
SHM_DIR = "/dev/shm"


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


class File:
    """A regular file made fresh in a directory (O_EXCL, O_NOFOLLOW, 0600, a random name) and sized by
    ftruncate; close() closes and unlinks it. Refused (OSError ENOSPC) where its file system has
    less free space than its size, so no write into it (nor a fault on a mapping of it) runs out."""

    def __init__(self, directory: str, size: int) -> None:
        st = os.statvfs(directory)
        if st.f_bavail * st.f_frsize < size:
            raise OSError(28, f"{directory} has {st.f_bavail * st.f_frsize / 1e9:.1f} GB free, "
                              f"{size / 1e9:.1f} GB needed")
        self.path = os.path.join(directory, f"copyout-{secrets.token_hex(8)}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(self.path, flags, 0o600)
        self.size = size
        try:
            os.ftruncate(self.fd, size)
        except BaseException:
            self.close()
            raise

    def resident(self) -> float:
        """The share of the file's pages in the page cache (mincore over a mapping of it)."""
        if self.size == 0:
            return 0.0
        pages = -(-self.size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        m = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED)
        try:
            addr = ctypes.c_char.from_buffer(m)
            try:
                if _libc.mincore(ctypes.addressof(addr), self.size, vec) != 0:
                    raise OSError(ctypes.get_errno(), "mincore")
            finally:
                del addr
        finally:
            m.close()
        return (pages - bytes(vec).count(0)) / pages

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


class Mapping:
    """The host mapping the bytes go to: anonymous and private, or (file given) MAP_SHARED over a
    File, which close() then closes and unlinks too."""

    def __init__(self, size: int, file: File | None = None) -> None:
        if file is None:
            self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            self.map = mmap.mmap(file.fd, size, flags=mmap.MAP_SHARED)
        self.map.madvise(mmap.MADV_HUGEPAGE)
        self.file = file
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
        if self.file is not None:
            self.file.close()


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


def _pwrite_all(fd: int, view: memoryview, off: int) -> None:
    while view:
        n = os.pwrite(fd, view, off)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at {off}")
        view, off = view[n:], off + n


def _preadv_all(fd: int, view: memoryview, off: int) -> None:
    while view:
        n = os.preadv(fd, [view], off)
        if n <= 0:
            raise OSError(f"preadv read {n} bytes at {off}: the file is shorter than its pieces")
        view, off = view[n:], off + n


def _staging(direction: str, memmove: bool = False, side_stream: bool = True, n_slots: int = SLOTS,
             slot: int = SLOT, file_io: bool = False):
    """The ring of n_slots pinned slots of slot bytes. Out: the GPU copies a piece into a slot, a
    thread drains the slot into the target (m, a Mapping: by copy_ or memmove; a File when file_io:
    by os.pwrite). Back from a Mapping: the main thread copies each piece into a slot, the GPU from
    it; from a File (file_io): n_slots threads read pieces by os.preadv straight into the slots."""
    def run(ts, offsets, m, marks: dict) -> None:
        t0 = time.monotonic()
        ring = Mapping(slot * n_slots)
        ring.populate(min(n_slots, 8))
        ring.register()
        slots = [ring.bytes[i * slot:(i + 1) * slot] for i in range(n_slots)]
        # the slots as buffers for os.pwrite/preadv (ctypes arrays: no export held on the ring's mmap)
        views = [memoryview((ctypes.c_char * slot).from_address(s.data_ptr())) for s in slots]
        stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
        events = [torch.cuda.Event() for _ in range(n_slots)]
        busy: list = [None] * n_slots
        t1 = time.monotonic()
        torch.cuda.current_stream().synchronize()
        with ThreadPoolExecutor(n_slots) as pool, torch.cuda.stream(stream):
            if direction == "back" and file_io:
                pieces = list(_pieces(ts, offsets, slot))

                def fill(j: int) -> None:  # a reading thread: piece j into its slot, once the GPU is done with it
                    (dev, off), k = pieces[j], j % n_slots
                    events[k].synchronize()
                    _preadv_all(m.fd, views[k][:dev.numel()], off)
                for j in range(min(n_slots, len(pieces))):
                    busy[j] = pool.submit(fill, j)
                for j, (dev, off) in enumerate(pieces):
                    k, n = j % n_slots, dev.numel()
                    busy[k].result()
                    dev.copy_(slots[k][:n], non_blocking=True)
                    events[k].record(stream)
                    busy[k] = pool.submit(fill, j + n_slots) if j + n_slots < len(pieces) else None
            else:
                for j, (dev, off) in enumerate(_pieces(ts, offsets, slot)):
                    k, n = j % n_slots, dev.numel()
                    if busy[k] is not None:
                        busy[k].result()
                    if direction == "out":
                        slots[k][:n].copy_(dev, non_blocking=True)
                        events[k].record(stream)

                        def drain(k=k, n=n, off=off):
                            events[k].synchronize()
                            if file_io:
                                _pwrite_all(m.fd, views[k][:n], off)
                            elif memmove:
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


def _synced(out):
    """out, then the file's bytes written to its disk (fsync), timed apart as fsync_s."""
    def run(ts, offsets, f: File, marks: dict) -> None:
        out(ts, offsets, f, marks)
        t0 = time.monotonic()
        os.fsync(f.fd)
        marks["fsync_s"] = time.monotonic() - t0
    return run


def drop_cache(f: File) -> dict:
    """Makes f cold: everything written back (sync), the machine's page cache dropped (drop_caches:
    needs root and a writable /proc/sys; the way it went is recorded), and f's own pages dropped by
    posix_fadvise(DONTNEED) in any case; the share of f resident before and after (mincore)."""
    t0 = time.monotonic()
    marks: dict = {"resident_before_drop": f.resident()}
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as p:
            p.write("3")
        marks["drop_caches"] = "done"
    except OSError as e:
        marks["drop_caches"] = f"failed: {e}"
    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    marks["resident_after_drop"] = f.resident()
    marks["drop_s"] = time.monotonic() - t0
    return marks


@dataclass(frozen=True)
class Way:
    out: Callable
    back: Callable
    # where the bytes go: "anon" (a private anonymous Mapping), "shm-map" (a Mapping of a File in
    # /dev/shm), "shm-file" (that File itself, written and read by pwrite/preadv), "disk-file" (a File
    # in --disk-dir)
    target: str = "anon"
    cold: bool = False  # the page cache dropped between out and back (drop_cache)


def target_of(way: Way, size: int, disk_dir: str):
    if way.target == "anon":
        return Mapping(size)
    if way.target == "shm-map":
        f = File(SHM_DIR, size)
        try:
            return Mapping(size, f)
        except BaseException:
            f.close()
            raise
    return File(SHM_DIR if way.target == "shm-file" else disk_dir, size)


_TAKE = dict(side_stream=False)  # the take's ring: on the current stream, no stream pool
WAYS = {
    "pageable": Way(out_pageable, back_pageable),
    "register": Way(_registered("out", False), _registered("back", False)),
    "populate": Way(_registered("out", True), _registered("back", False)),
    "staging": Way(_staging("out"), _staging("back")),
    "take": Way(_staging("out", memmove=True, **_TAKE), _staging("back", **_TAKE)),
    # the take's way with more draining threads: 8 x 32 MiB (the same 256 MiB pinned), 8 x 64 MiB, 16 x 16 MiB
    "take-8x32": Way(_staging("out", memmove=True, n_slots=8, slot=32 * MIB, **_TAKE),
                     _staging("back", n_slots=8, slot=32 * MIB, **_TAKE)),
    "take-8x64": Way(_staging("out", memmove=True, n_slots=8, slot=64 * MIB, **_TAKE),
                     _staging("back", n_slots=8, slot=64 * MIB, **_TAKE)),
    "take-16x16": Way(_staging("out", memmove=True, n_slots=16, slot=16 * MIB, **_TAKE),
                      _staging("back", n_slots=16, slot=16 * MIB, **_TAKE)),
    # the take's way into a shared mapping of a /dev/shm file, and into that file by pwrite
    "take-shm": Way(_staging("out", memmove=True, **_TAKE), _staging("back", **_TAKE), "shm-map"),
    "take-shm-8x32": Way(_staging("out", memmove=True, n_slots=8, slot=32 * MIB, **_TAKE),
                         _staging("back", n_slots=8, slot=32 * MIB, **_TAKE), "shm-map"),
    "take-shm-pwrite": Way(_staging("out", file_io=True, **_TAKE), _staging("back", file_io=True, **_TAKE),
                           "shm-file"),
    # a disk file: out by pwrite + fsync; back by preadv from the cold file, 4 and 8 reading threads
    "back-disk-cold": Way(_synced(_staging("out", file_io=True, **_TAKE)),
                          _staging("back", file_io=True, **_TAKE), "disk-file", cold=True),
    "back-disk-cold-8": Way(_synced(_staging("out", file_io=True, **_TAKE)),
                            _staging("back", file_io=True, n_slots=8, **_TAKE), "disk-file", cold=True),
}


def host_of(disk_dir: str) -> dict:
    """What the host's file systems and huge-page settings were, for the record."""
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            return f"unreadable: {e}"

    mounts = [line.split()[1:3] for line in read("/proc/mounts").splitlines() if len(line.split()) > 2]

    def fs(d: str) -> dict:
        try:
            st = os.statvfs(d)
        except OSError as e:
            return {"dir": d, "error": str(e)}
        real = os.path.realpath(d)
        under = [m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")]
        return {"dir": d, "type": max(under, key=lambda m: len(m[0]))[1] if under else "?",
                "total_gb": st.f_blocks * st.f_frsize / 1e9, "free_gb": st.f_bavail * st.f_frsize / 1e9}

    return {"thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "shmem_thp": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            "shm": fs(SHM_DIR), "disk": fs(disk_dir), "uid": os.getuid()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--sizes-gb", default="1.37,19.2")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of: " + ", ".join(WAYS))
    ap.add_argument("--disk-dir", default="/var/tmp", help="where the back-disk-cold ways make their file")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="once the run has taken this long, only the first of --repeat runs (0: no limit)")
    args = ap.parse_args()
    ways = args.ways.split(",")
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        ap.error(f"unknown ways {unknown}; known: {', '.join(WAYS)}")
    if not os.path.isdir(args.disk_dir):
        ap.error(f"--disk-dir {args.disk_dir} is no directory")
    if not torch.cuda.is_available():
        print("copyout.py: needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    start = time.monotonic()
    host = host_of(args.disk_dir)
    rows: list[dict] = []
    notes: list[str] = []

    def save() -> None:  # after every row: a run stopped by its timeout keeps what it measured
        Path(args.out).write_text(json.dumps({"rows": rows, "threads": torch.get_num_threads(), "host": host,
                                              "notes": notes}, indent=2) + "\n")

    for gb in (float(s) for s in args.sizes_gb.split(",")):
        ts = tensors_of(int(gb * 1e9) // 4 * 4)
        ref = [t.clone() for t in ts[:3]] + [ts[-1].clone()]
        offsets, total = layout(ts)
        torch.cuda.synchronize()
        for name in ways:
            way = WAYS[name]
            for r in range(args.repeat):
                if r and args.budget_s and time.monotonic() - start > args.budget_s:
                    note = f"{name} at {total / 1e9:.2f} GB: run {r} and later left out (--budget-s {args.budget_s:g})"
                    notes.append(note)
                    print(f"copyout.py: {note}", file=sys.stderr)
                    break
                try:
                    m = target_of(way, total, args.disk_dir)
                except OSError as e:
                    rows.append({"gb": total / 1e9, "way": name, "run": r, "skipped": str(e)})
                    print(json.dumps(rows[-1]), flush=True)
                    save()
                    break
                try:
                    marks_out: dict = {}
                    torch.cuda.synchronize()
                    t0 = time.monotonic()
                    way.out(ts, offsets, m, marks_out)
                    torch.cuda.synchronize()
                    out_s = time.monotonic() - t0
                    for t in ts:
                        t.zero_()
                    torch.cuda.synchronize()
                    marks_back: dict = drop_cache(m) if way.cold else {}
                    if way.cold and marks_back["drop_caches"] != "done":
                        note = (f"{name}: drop_caches {marks_back['drop_caches']}; the file's own pages dropped by "
                                f"posix_fadvise, {marks_back['resident_after_drop']:.1%} of them resident after")
                        if note not in notes:
                            notes.append(note)
                            print(f"copyout.py: {note}", file=sys.stderr)
                    t0 = time.monotonic()
                    way.back(ts, offsets, m, marks_back)
                    torch.cuda.synchronize()
                    back_s = time.monotonic() - t0
                    exact = all(torch.equal(a, b) for a, b in zip(ts[:3] + [ts[-1]], ref))
                finally:
                    m.close()
                row = {"gb": total / 1e9, "way": name, "run": r, "out_s": out_s, "back_s": back_s,
                       "out_gbps": total / 1e9 / out_s, "back_gbps": total / 1e9 / back_s,
                       "out_marks": marks_out, "back_marks": marks_back, "exact": exact}
                rows.append(row)
                print(json.dumps(row), flush=True)
                save()
                if not exact:
                    print(f"copyout.py: {name} did not bring the bytes back", file=sys.stderr)
        del ts, ref
        torch.cuda.empty_cache()
    lines = ["| GB | way | out s (first / best) | out GB/s | back s (first / best) | back GB/s | exact |",
             "|---|---|---|---|---|---|---|"]
    for gb in sorted({r["gb"] for r in rows}):
        for name in ways:
            rs = [r for r in rows if r["gb"] == gb and r["way"] == name]
            if not rs:
                continue
            if "skipped" in rs[0]:
                lines.append(f"| {gb:.2f} | {name} | skipped: {rs[0]['skipped']} | | | | |")
                continue
            bo, bb = min(r["out_s"] for r in rs), min(r["back_s"] for r in rs)
            lines.append(f"| {gb:.2f} | {name} | {rs[0]['out_s']:.3f} / {bo:.3f} | {gb / bo:.1f} | "
                         f"{rs[0]['back_s']:.3f} / {bb:.3f} | {gb / bb:.1f} | {all(r['exact'] for r in rs)} |")
    lines += [f"note: {n}" for n in notes]
    lines.append(f"wall {time.monotonic() - start:.1f} s")
    text = "\n".join(lines)
    print(text, flush=True)
    save()
    Path(args.out).with_suffix(".txt").write_text(text + "\n")  # the last write: stdout may be this same file
    measured = [r for r in rows if "skipped" not in r]
    return 0 if measured and all(r["exact"] for r in measured) else 1


if __name__ == "__main__":
    sys.exit(main())
