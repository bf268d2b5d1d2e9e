"""Where the take point's full garbage collection goes: run ahead by the take's thread beside the
step still running (the default), or at the hold, inside the stall (SNAPGUARD_TAKE_GC_AHEAD=0).

    .venv/bin/python bench/take_gc.py OUT.json [--rounds 2] [--snapshots 3] [--trainer-args "..."]

The torch drill's trainer (lab/snapguard_lab/workloads/torch/train.py, default here --device cpu
--width 256 --layers 4 --batch 8) runs with the take point, once per arm and round (the order
alternated by round); each run takes --snapshots leave-running snapshots (`checkpoint_pid`, no
spill on a CPU trainer: the move does not run, which leaves the collection, the caches' emptying
and CRIU). A sample's stall is the longest gap between logged steps around the snapshot less the
median gap of the run; the take's trim seconds by part and the collection figures come from the
image's manifest. Medians per arm in the table; every sample in the JSON. Run as root. A GPU
trainer's step leaves its Python thread waiting on the device, where a CPU trainer's computes:
the ahead collection has more to hide behind there (bench/gpu/scaling.py measures that).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "lab"))
from _common import git_rev, write  # noqa: E402

from snapguard import image  # noqa: E402
from snapguard.config import load  # noqa: E402
from snapguard.pipeline import checkpoint_pid  # noqa: E402
from snapguard_lab.torch_drill import Trainer  # noqa: E402


def stall(rows: list[tuple[int, str, float, int]], t0: float, t1: float) -> float:
    """The longest gap between steps that ends after t0 and begins before t1, less the median gap."""
    gaps = [(b[2] - a[2], a[2], b[2]) for a, b in zip(rows, rows[1:])]
    around = [g for g, start, end in gaps if end >= t0 and start <= t1]
    return max(around) - statistics.median(g for g, _, _ in gaps)


def one_run(base: Path, name: str, ahead: bool, snapshots: int, extra: list[str]) -> list[dict[str, Any]]:
    config = load()
    run = Trainer(base, name, 100000, trimmed=True, extra=extra,
                  env={"SNAPGUARD_TAKE_GC_AHEAD": "1" if ahead else "0"})
    pid = run.start(os.path.join(config.state_dir, "take"))
    out = []
    try:
        run.wait_step(10, timeout=300)
        for i in range(snapshots):
            img = base / f"{name}-{i}.img"
            before = run.rows()[-1][0]
            t0 = time.time()
            checkpoint_pid(pid, str(img), config, leave_running=True, take_wait_s=30)
            t1 = time.time()
            run.wait_step(before + 6, timeout=300)
            (figures,) = image.verify(str(img)).to_json()["take_point"].values()
            out.append({"stall_s": stall(run.rows(), t0, t1), "trim_s": figures["trim_s"],
                        "trim_parts_s": figures.get("trim_parts_s"), "gc_collected": figures.get("gc_collected"),
                        "gc_ahead": figures.get("gc_ahead")})
            print(f"{name}: stall {out[-1]['stall_s']:.3f} s, trim {figures['trim_s']:.3f} s, "
                  f"gc at the hold {figures['trim_parts_s']['gc']:.3f} s, ahead {figures.get('gc_ahead')}", flush=True)
    finally:
        run.kill()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--snapshots", type=int, default=3)
    ap.add_argument("--trainer-args", default="--device cpu --width 384 --layers 2 --batch 8")
    args = ap.parse_args()
    extra = shlex.split(args.trainer_args)
    base = Path(tempfile.mkdtemp(prefix="take-gc-"))
    samples: dict[str, list[dict[str, Any]]] = {"ahead": [], "at-hold": []}
    for r in range(args.rounds):
        for ahead in ((True, False) if r % 2 == 0 else (False, True)):
            arm = "ahead" if ahead else "at-hold"
            samples[arm] += one_run(base, f"{arm}-{r}", ahead, args.snapshots, extra)
    print(f"\n{'arm':8} {'stall s':>8} {'trim s':>7} {'gc in the hold s':>17} {'gc ahead s':>11}   (medians of {args.rounds * args.snapshots})")
    medians = {}
    for arm, rows in samples.items():
        m = {"stall_s": statistics.median(s["stall_s"] for s in rows),
             "trim_s": statistics.median(s["trim_s"] for s in rows),
             "gc_at_hold_s": statistics.median(s["trim_parts_s"]["gc"] for s in rows),
             "gc_ahead_s": statistics.median(s["gc_ahead"]["s"] for s in rows) if all(s["gc_ahead"] for s in rows) else None}
        medians[arm] = m
        ahead_s = f"{m['gc_ahead_s']:11.3f}" if m["gc_ahead_s"] is not None else f"{'-':>11}"
        print(f"{arm:8} {m['stall_s']:8.3f} {m['trim_s']:7.3f} {m['gc_at_hold_s']:17.3f} {ahead_s}")
    write("take-gc", {"commit": git_rev(), "trainer_args": extra, "medians": medians, "samples": samples},
          args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
