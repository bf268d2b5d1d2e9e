"""`ctr containers checkpoint --task` + `ctr containers restore --live` of the counter container,
through snapguard-runc against bare runc, interleaved in one run. Target: at most 5% slower.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import git_rev, summary, write  # noqa: E402

from snapguard_lab.testbed import Containerd, CounterLog  # noqa: E402


def one_cycle(ctd: Containerd, runc_binary: str, out: Path, cid: str) -> tuple[float, float]:
    log = CounterLog(out / "counter.log")
    ctd.run_counter(cid, str(out), runc_binary)
    log.wait_for(10)
    ref = f"snapguard.local/bench-{cid}:1"
    t0 = time.perf_counter()
    ctd.ctr("containers", "checkpoint", "--task", cid, ref)
    checkpoint_s = time.perf_counter() - t0
    ctd.remove(cid)
    t0 = time.perf_counter()
    ctd.ctr("containers", "restore", "--live", cid, ref)
    restore_s = time.perf_counter() - t0
    n = len(log.values())
    log.wait_for(n + 3)  # the restored workload runs
    ctd.remove(cid)
    ctd.ctr("images", "rm", ref, check=False)
    return checkpoint_s, restore_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    arms = {"runc": "/usr/sbin/runc", "snapguard-runc": os.path.join(os.path.dirname(sys.executable), "snapguard-runc")}
    base = Path(tempfile.mkdtemp(prefix="sg-bench-ckpt-"))
    ctd = Containerd(str(base / "containerd"))
    ctd.start()
    results: dict[str, dict[str, list[float]]] = {a: {"checkpoint": [], "restore": [], "total": []} for a in arms}
    try:
        ctd.import_counter_image()
        for arm, binary in arms.items():  # warm-up, not counted
            one_cycle(ctd, binary, base / f"warm-{arm}", f"warm-{arm}")
        for i in range(args.rounds):
            order = list(arms.items()) if i % 2 == 0 else list(arms.items())[::-1]
            for arm, binary in order:
                c, r = one_cycle(ctd, binary, base / f"{arm}-{i}", f"b{i}-{arm.replace('-', '')}")
                results[arm]["checkpoint"].append(c)
                results[arm]["restore"].append(r)
                results[arm]["total"].append(c + r)
    finally:
        ctd.stop()
        shutil.rmtree(base, ignore_errors=True)
    stats = {a: {k: summary(v) for k, v in r.items()} for a, r in results.items()}
    print(f"{'arm':<16} {'checkpoint s':>12} {'restore s':>10} {'total s':>8} {'ratio':>6}")
    base_total = stats["runc"]["total"]["median"]
    for a, s in stats.items():
        print(f"{a:<16} {s['checkpoint']['median']:>12.3f} {s['restore']['median']:>10.3f} "
              f"{s['total']['median']:>8.3f} {s['total']['median'] / base_total:>6.3f}")
    ratio = stats["snapguard-runc"]["total"]["median"] / base_total
    path = write("checkpoint-restore", {"rounds": args.rounds, "stats": stats, "ratio_total": ratio,
                                        "target_ratio": 1.05, "rev": git_rev()})
    print(f"snapguard-runc / runc (median total) = {ratio:.3f}, target <= 1.05; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
