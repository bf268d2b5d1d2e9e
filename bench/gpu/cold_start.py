"""What a restore's programs cost to start from a cold page cache, with and without snapguard's
read-ahead (snapguard.prefetch), on the machine it runs on.

For each program: `sync; echo 3 > /proc/sys/vm/drop_caches`, then run it (cold); then drop again,
ask the read-ahead for its closure, wait --settle-s, run it (ahead); then run it once more (warm).
ROUNDS rounds, medians. Programs: CRIU (`criu --version`: the loader and its libraries), and the
Python that snapguard's cuda-checkpoint starts (`python3 -S -c "import json, socket"`, as the tool
does before it asks the executor's broker), whose closure covers the interpreter but not the
modules.

    source bench/gpu/setup.sh && python3 bench/gpu/cold_start.py OUT.json [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from snapguard import prefetch
from snapguard.config import load

PY = "/usr/bin/python3"


def drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def timed(argv: list[str]) -> float:
    t = time.monotonic()
    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=60, check=True)
    return time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle-s", type=float, default=0.05, help="between the read-ahead and the run")
    args = ap.parse_args()
    config = load()
    programs = {"criu": [config.criu, "--version"], "python": [PY, "-S", "-c", "import json, socket"]}
    rows: dict[str, dict[str, list[float]]] = {}
    for name, argv in programs.items():
        got: dict[str, list[float]] = {"cold": [], "ahead": [], "warm": [], "ahead_call": []}
        for _ in range(args.rounds):
            drop()
            got["cold"].append(timed(argv))
            drop()
            t = time.monotonic()
            prefetch.read_ahead([argv[0]])
            got["ahead_call"].append(time.monotonic() - t)
            time.sleep(args.settle_s)
            got["ahead"].append(timed(argv))
            got["warm"].append(timed(argv))
        rows[name] = got
    out = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "programs": programs, "settle_s": args.settle_s,
           "closures": {n: prefetch.closure(a[0]) for n, a in programs.items()}, "rows": rows,
           "medians_s": {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'program':<8} {'cold s':>8} {'ahead s':>8} {'warm s':>8} {'read-ahead call s':>18}")
    for n, m in out["medians_s"].items():
        print(f"{n:<8} {m['cold']:8.3f} {m['ahead']:8.3f} {m['warm']:8.3f} {m['ahead_call']:18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
