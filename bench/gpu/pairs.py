"""Summarise interleaved scaling.py runs of one arm with the executor's cuda-checkpoint broker on
and off (each run's broker answers must agree with its name): a row per run, the medians each
way, and how many pairs favour "on" for each cost. Reads DIR/NAME-on.json and DIR/NAME-off.json
(scaling.py's JSON, one size, the snapguard arm); prints the table and writes DIR/summary.json.

    python3 bench/gpu/pairs.py bench/results/h200x2/broker-pairs-2026-11-30
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

COSTS = {  # column: where it is in the arm's record
    "stall": ("leave_running", "stall_s"),
    "cuda_suspend": ("leave_running", "checkpoint_timings", "cuda_suspend_s"),
    "criu_dump": ("leave_running", "checkpoint_timings", "dump_s"),
    "cuda_resume": ("leave_running", "checkpoint_timings", "cuda_resume_s"),
    "seized": ("leave_running", "dump_marks", "seized"),
    "stop_to_image": ("stop_warm", "stop_to_image_s"),
    "restore_warm": ("stop_warm", "restore_to_first_new_step_s"),
    "restore_cold": ("stop_cold", "restore_to_first_new_step_s"),
}


def _dig(record: dict, path: tuple[str, ...]) -> float:
    for key in path:
        record = record[key]
    return float(record)  # type: ignore[arg-type]


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    d = Path(sys.argv[1])
    runs = []
    for f in sorted(d.glob("*-o[nf]*.json")):
        name = f.name[:-len(".json")]
        switch = name.rsplit("-", 1)[1]
        if switch not in ("on", "off"):
            continue
        arm = json.loads(f.read_text())["sizes"][0]["arms"]["snapguard"]
        answered = (arm["leave_running"].get("checkpoint_counts") or {}).get("cuda_broker_answers", 0)
        if (switch == "on") != (answered > 0):  # the name must say what the run did
            print(f"pairs.py: {f} is named {switch!r} but its broker answered {answered} runs", file=sys.stderr)
            return 1
        runs.append({"run": name, "pair": name.rsplit("-", 1)[0], "switch": switch,
                     **{c: _dig(arm, p) for c, p in COSTS.items()}})
    if not runs:
        print(f"pairs.py: no NAME-on.json / NAME-off.json in {d}", file=sys.stderr)
        return 1
    print(f"{'run':<12}" + "".join(f"{c:>14}" for c in COSTS))
    for r in runs:
        print(f"{r['run']:<12}" + "".join(f"{r[c]:>14.2f}" for c in COSTS))
    medians = {s: {c: statistics.median(r[c] for r in runs if r["switch"] == s) for c in COSTS} for s in ("off", "on")}
    for s in ("off", "on"):
        n = sum(1 for r in runs if r["switch"] == s)
        print(f"{'median ' + s:<12}" + "".join(f"{medians[s][c]:>14.2f}" for c in COSTS) + f"   ({n} runs)")
    by_pair: dict[str, dict[str, dict]] = {}
    for r in runs:
        by_pair.setdefault(r["pair"], {})[r["switch"]] = r
    pairs = [p for p in by_pair.values() if len(p) == 2]
    favour = {c: sum(1 for p in pairs if p["on"][c] < p["off"][c]) for c in COSTS}
    print(f"{'on lower':<12}" + "".join(f"{f'{favour[c]}/{len(pairs)}':>14}" for c in COSTS))
    (d / "summary.json").write_text(json.dumps({"runs": runs, "medians": medians, "pairs": len(pairs),
                                                "pairs_on_lower": favour}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
