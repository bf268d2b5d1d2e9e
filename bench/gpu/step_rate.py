"""Step time before and after a snapshot, per arm of a torch drill's working directory.

The goodput drill on the H200 (bench/results/h200x2/goodput-h200-2026-11-30.json) found the arms
that took a snapshot stepping about 45% slower than the one that did not, after their first
snapshot only. This reads the trainer logs the torch drill leaves (`<arm>.log`, lines `step N BITS
TIME RESERVED`) and prints, for each arm, the median step time in steps [10, at) and (at + 10, end],
to tell the take point's trim, the hook and the restore apart:

    python3 bench/gpu/step_rate.py WORKDIR AT [OUT.json]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def rows(log: Path) -> list[tuple[int, float]]:
    out = []
    for line in log.read_text().splitlines():
        p = line.split()
        if len(p) == 5 and p[0] == "step":
            out.append((int(p[1]), float(p[3])))
    return out


def main() -> int:
    workdir, at = Path(sys.argv[1]), int(sys.argv[2])
    table = {}
    for log in sorted(workdir.glob("*.log")):
        r = rows(log)
        # one row per step: a restore replays none, but keep the last time of a step seen twice
        times = dict(r)
        steps = sorted(times)
        gaps = {s: times[s] - times[s - 1] for s in steps if s - 1 in times}
        before = [g for s, g in gaps.items() if 10 <= s < at]
        after = [g for s, g in gaps.items() if s > at + 10]
        if not before or not after:
            continue
        b, a = statistics.median(before), statistics.median(after)
        table[log.stem] = {"before_s": b, "after_s": a, "ratio": a / b, "steps": len(steps)}
        print(f"{log.stem:<32} before {b * 1000:7.1f} ms  after {a * 1000:7.1f} ms  x{a / b:.2f}", flush=True)
    if len(sys.argv) > 3:
        Path(sys.argv[3]).write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
