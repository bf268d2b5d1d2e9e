"""Whole-node scan with 2,000 live processes: the C helper against the pure-Python scanner and
against psutil's memory_maps (same run, same processes), and the wall time of
`snapguard preflight --node`. Targets: C >= 10x faster than psutil, C < 50 ms for 2,000
processes, `preflight --node` < 300 ms.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, summary, write  # noqa: E402

import psutil  # noqa: E402

from snapguard.preflight import scan  # noqa: E402


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def psutil_maps(pids: list[int]) -> int:
    n = 0
    for pid in pids:
        try:
            n += len(psutil.Process(pid).memory_maps(grouped=False))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--processes", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    kids = [subprocess.Popen(["/bin/sleep", "600"]) for _ in range(args.processes)]
    try:
        time.sleep(1.0)
        pids = scan.all_pids()
        assert sum(1 for k in kids if k.poll() is None) == args.processes
        prefixes, majors = scan.GPU_AND_RDMA_PREFIXES, (scan.NVIDIA_MAJOR,)
        arms = {
            "c helper": timed(lambda: scan.scan_c(pids, prefixes, majors), args.repeat),
            "pure python": timed(lambda: scan.scan_python(pids, prefixes, majors), args.repeat),
            "psutil memory_maps": timed(lambda: psutil_maps(pids), max(1, args.repeat // 2)),
        }
        exe = os.path.join(os.path.dirname(sys.executable), "snapguard")
        node = timed(lambda: subprocess.run([exe, "preflight", "--node", "--json"], capture_output=True,
                                            check=False), args.repeat)
        same = sorted(scan.scan_c(pids, prefixes, majors)) == sorted(scan.scan_python(pids, prefixes, majors))
    finally:
        for k in kids:
            k.kill()
        for k in kids:
            k.wait()
    stats = {k: summary(v) for k, v in arms.items()}
    c = stats["c helper"]["median"]
    print(f"{len(pids)} processes on the node ({args.processes} planted)")
    print(f"{'arm':<22} {'median ms':>10} {'vs C':>8}")
    for k, s in stats.items():
        print(f"{k:<22} {s['median'] * 1e3:>10.1f} {s['median'] / c:>7.1f}x")
    node_stats = summary(node)
    print(f"{'preflight --node':<22} {node_stats['median'] * 1e3:>10.1f}   (whole CLI, incl. interpreter start)")
    print(f"C and Python results identical: {same}")
    path = write("scan", {"processes": len(pids), "planted": args.processes, "stats": stats,
                          "preflight_node": node_stats, "identical": same,
                          "psutil_over_c": stats["psutil memory_maps"]["median"] / c,
                          "targets": {"c_ms": 50, "psutil_over_c": 10, "node_ms": 300}, "rev": git_rev()})
    print(f"targets: C < 50 ms, psutil/C >= 10, preflight --node < 300 ms; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
