"""Summarise interleaved scaling.py runs of one arm with a setting each of two ways: a row per
run, the medians each way, and how many pairs favour the second way for each cost. Reads
DIR/pairN-A.json and DIR/pairN-B.json (scaling.py's JSON, one size, the snapguard arm) for the
labels A,B given (default off,on: the executor's cuda-checkpoint broker, whose answers in each
run must then agree with its name); prints the table and writes DIR/summary.json.

    python3 bench/gpu/pairs.py bench/results/h200x2/broker-pairs-2026-11-30
    python3 bench/gpu/pairs.py bench/results/h200/criu-loglevel-2026-11-30 --labels v4,v3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

COSTS = {  # column: where it is in the arm's record
    "stall": ("leave_running", "stall_s"),
    "take": ("leave_running", "checkpoint_timings", "take_s"),
    "cuda_suspend": ("leave_running", "checkpoint_timings", "cuda_suspend_s"),
    "criu_dump": ("leave_running", "checkpoint_timings", "dump_s"),
    "cuda_resume": ("leave_running", "checkpoint_timings", "cuda_resume_s"),
    "seized": ("leave_running", "dump_marks", "seized"),
    "stop_to_image": ("stop_warm", "stop_to_image_s"),
    "restore_warm": ("stop_warm", "restore_to_first_new_step_s"),
    "restore_cold": ("stop_cold", "restore_to_first_new_step_s"),
    "image_gb": ("stop_warm", "image_bytes"),
}
SCALE = {"image_gb": 1e-9}  # bytes to GB; every other column is seconds


def _dig(record: dict, path: tuple[str, ...]) -> float:
    for key in path:
        record = record[key]
    return float(record)  # type: ignore[arg-type]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the runs' directory")
    ap.add_argument("--labels", default="off,on", help="the two ways, as the runs' names end (default off,on)")
    args = ap.parse_args()
    d = Path(args.dir)
    labels = tuple(args.labels.split(","))
    if len(labels) != 2 or labels[0] == labels[1]:
        ap.error("--labels takes two different names, A,B")
    first, second = labels
    runs = []
    for f in sorted(d.glob("*.json")):
        name = f.name[:-len(".json")]
        way = name.rsplit("-", 1)[-1]
        if way not in labels:
            continue
        arm = json.loads(f.read_text())["sizes"][0]["arms"]["snapguard"]
        if labels == ("off", "on"):
            answered = (arm["leave_running"].get("checkpoint_counts") or {}).get("cuda_broker_answers", 0)
            if (way == "on") != (answered > 0):  # the name must say what the run did
                print(f"pairs.py: {f} is named {way!r} but its broker answered {answered} runs", file=sys.stderr)
                return 1
        runs.append({"run": name, "pair": name.rsplit("-", 1)[0], "switch": way,
                     **{c: _dig(arm, p) * SCALE.get(c, 1.0) for c, p in COSTS.items()}})
    if {r["switch"] for r in runs} != set(labels):
        print(f"pairs.py: no runs of both ways (NAME-{first}.json, NAME-{second}.json) in {d}", file=sys.stderr)
        return 1
    print(f"{'run':<12}" + "".join(f"{c:>14}" for c in COSTS))
    for r in runs:
        print(f"{r['run']:<12}" + "".join(f"{r[c]:>14.2f}" for c in COSTS))
    medians = {s: {c: statistics.median(r[c] for r in runs if r["switch"] == s) for c in COSTS} for s in labels}
    for s in labels:
        n = sum(1 for r in runs if r["switch"] == s)
        print(f"{'median ' + s:<12}" + "".join(f"{medians[s][c]:>14.2f}" for c in COSTS) + f"   ({n} runs)")
    by_pair: dict[str, dict[str, dict]] = {}
    for r in runs:
        by_pair.setdefault(r["pair"], {})[r["switch"]] = r
    pairs = [p for p in by_pair.values() if len(p) == 2]
    favour = {c: sum(1 for p in pairs if p[second][c] < p[first][c]) for c in COSTS}
    print(f"{second + ' lower':<12}" + "".join(f"{f'{favour[c]}/{len(pairs)}':>14}" for c in COSTS))
    (d / "summary.json").write_text(json.dumps({"runs": runs, "medians": medians, "pairs": len(pairs),
                                                f"pairs_{second}_lower": favour}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
