"""How fast the take point fills its spill, by where the spill's file is: the take point's own move
(`Offload.take` on CPU storages, SNAPGUARD_TAKE_OFFLOAD_DEVICE=cpu's path: the ring, its draining
threads, MADV_POPULATE_WRITE before each copy) into

  anon    the process's own memory (no spill: one anonymous mapping asked for huge pages), the
          baseline: what a take costs when CRIU writes the bytes;
  shm     a file in /dev/shm, a tmpfs mounted without huge= as distributions mount it (4 KiB
          pages whatever is asked);
  huge    a file on a tmpfs this run mounts with huge=within_size (as a node mounts
          /run/snapguard-spill, `snapguard preflight --node`), 2 MiB pages.

    python3 bench/spill_fill.py OUT.json [--gb 2] [--rounds 5]

Run as root (it mounts the huge tmpfs under a fresh directory of /tmp and unmounts it). Each round
takes the same tensors into every arm in turn (the order rotated per round), then reloads them
and checks the bytes; the table gives the median take seconds, GB/s and the ratio to anon's
median in the same run, and how many bytes of huge shmem pages the spill's file got (ShmemHugePages
grown). No disk is involved (tmpfs and anonymous memory only). On a VM the first touch of guest
memory the host has not backed yet is slow: the first round is reported but the medians say more.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

os.environ["SNAPGUARD_TAKE_OFFLOAD_DEVICE"] = "cpu"


def _shmem_huge_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) * 1024
    return -1


def _mount_huge(target: str, size_bytes: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"size={size_bytes},huge=within_size,mode=1777".encode()
    if libc.mount(b"snapguard-bench", target.encode(), b"tmpfs", 0, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs huge=within_size on {target}: {os.strerror(err)}")


def _umount(target: str) -> None:
    ctypes.CDLL(None, use_errno=True).umount2(target.encode(), 2)  # MNT_DETACH


def _one(torch: Any, tensors: list[Any], spill_dir: str | None) -> dict[str, Any]:
    from snapguard.takepoint.workload.offload import Offload

    before = _shmem_huge_bytes()
    offload = Offload("cpu")
    t0 = time.monotonic()
    figures = offload.take(torch, tensors, spill_dir=spill_dir)
    take_s = time.monotonic() - t0
    huge = _shmem_huge_bytes() - before
    if figures.get("state") != "moved" or (spill_dir is not None and "spill" not in figures):
        raise RuntimeError(f"the take did not move every byte into its place: {json.dumps(figures)[:400]}")
    fd = offload.spill_fd
    t1 = time.monotonic()
    offload.reload(torch, source_fd=fd)
    reload_s = time.monotonic() - t1
    if fd is not None:
        os.close(fd)
    return {"take_s": take_s, "reload_s": reload_s, "huge_shmem_bytes": huge, "bytes": figures["bytes"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="where the JSON goes")
    ap.add_argument("--gb", type=float, default=2.0, help="bytes moved per take, in GB (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="takes per arm (default 5)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("spill_fill: run as root (it mounts a tmpfs)", file=sys.stderr)
        return 2
    if args.gb <= 0 or args.rounds < 1:
        print("spill_fill: --gb must be > 0 and --rounds >= 1", file=sys.stderr)
        return 2
    import torch

    n = int(args.gb * 1e9) // 4
    torch.manual_seed(0)
    # a few storages of different sizes, as an optimizer's are
    tensors = [torch.randn(n // 2), torch.randn(n // 4), torch.randn(n // 8), torch.randn(n - n // 2 - n // 4 - n // 8)]
    reference = [t.clone() for t in tensors]
    total = sum(t.numel() * 4 for t in tensors)
    mount = tempfile.mkdtemp(prefix="snapguard-spill-bench-")
    _mount_huge(mount, 2 * total + (64 << 20))
    arms = {"anon": None, "shm": "/dev/shm", "huge": mount}
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    try:
        for r in range(args.rounds):
            order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
            for arm in order:
                run = _one(torch, tensors, arms[arm])
                if not all(torch.equal(a, b) for a, b in zip(tensors, reference)):
                    raise RuntimeError(f"{arm}: the bytes came back changed")
                run["round"] = r
                runs[arm].append(run)
                print(f"round {r} {arm:<5} take {run['take_s']:.3f} s  reload {run['reload_s']:.3f} s  "
                      f"huge shmem {run['huge_shmem_bytes'] / 1e9:.2f} GB", flush=True)
    finally:
        _umount(mount)
        os.rmdir(mount)
    base = statistics.median(r["take_s"] for r in runs["anon"])
    rows = []
    for arm, samples in runs.items():
        take = statistics.median(r["take_s"] for r in samples)
        rows.append({"arm": arm, "dir": arms[arm], "take_s_median": take, "take_s_first": samples[0]["take_s"],
                     "take_gb_per_s": total / take / 1e9, "take_vs_anon": take / base,
                     "reload_s_median": statistics.median(r["reload_s"] for r in samples),
                     "huge_shmem_bytes": max(r["huge_shmem_bytes"] for r in samples)})
    print(f"\n{total / 1e9:.2f} GB moved per take, {args.rounds} rounds, medians; first round apart")
    print(f"{'arm':<6} {'take s':>8} {'first s':>8} {'GB/s':>6} {'x anon':>7} {'reload s':>9} {'huge GB':>8}")
    for row in rows:
        print(f"{row['arm']:<6} {row['take_s_median']:>8.3f} {row['take_s_first']:>8.3f} {row['take_gb_per_s']:>6.2f} "
              f"{row['take_vs_anon']:>7.2f} {row['reload_s_median']:>9.3f} {row['huge_shmem_bytes'] / 1e9:>8.2f}")
    Path(args.out).write_text(json.dumps({
        "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "bytes": total,
        "rounds": args.rounds, "rows": rows, "runs": runs,
        "shmem_enabled": Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip(),
        "page_cache": "none: tmpfs and anonymous memory only"}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
