"""How late a child's exit is seen: `snapguard.children.run` (its wait on the child's pidfd)
against the wait it replaced (`Popen.wait(timeout=...)`, which CPython runs as a poll loop whose
sleeps double up to 50 ms), on the same child in the same command.

    .venv/bin/python bench/child_wait.py [--rounds 20] [--durations 0.05,0.3,1.0]

Each round runs `/bin/sleep D+j` once through each wait (j drawn per round from [0, 50 ms), the
same for both: a real child's exit falls anywhere in the poll loop's step), the order alternated by
round; a sample is the wall time of the call less D+j (the fork, exec and exit of the child, the same in both arms, plus
the wait's own lateness). The table gives the medians and the median of the paired differences
(the poll loop's extra lateness); JSON goes to bench/results/child-wait-DATE.json. A CRIU dump or
restore runs for 0.3-3 s, where the poll loop sleeps its full 50 ms steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import git_rev, summary, write  # noqa: E402

from snapguard import children  # noqa: E402
from snapguard.reasons import Reason  # noqa: E402

SLEEP = "/bin/sleep"


def pidfd_wait(duration: float) -> float:
    t = time.monotonic()
    rc = children.run([SLEEP, f"{duration:.4f}"], timeout_s=60, what="sleep", reason=Reason.INTERNAL_ERROR)
    assert rc == 0
    return time.monotonic() - t - duration


def poll_loop_wait(duration: float) -> float:
    """What children.run's wait was: Popen.wait with a timeout (the child in a group of its own)."""
    t = time.monotonic()
    proc = subprocess.Popen([SLEEP, f"{duration:.4f}"], stdin=subprocess.DEVNULL, process_group=0)
    rc = proc.wait(timeout=60)
    assert rc == 0
    return time.monotonic() - t - duration


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--durations", default="0.05,0.3,1.0", help="child run times in seconds, comma-separated")
    args = ap.parse_args()
    durations = [float(d) for d in args.durations.split(",")]
    rows: list[dict[str, Any]] = []
    print(f"{'child s':>8} {'pidfd ms':>9} {'poll loop ms':>13} {'extra ms (paired)':>18}")
    for d in durations:
        ours: list[float] = []
        old: list[float] = []
        rng = random.Random(1)
        for i in range(args.rounds):
            first, second = (pidfd_wait, poll_loop_wait) if i % 2 == 0 else (poll_loop_wait, pidfd_wait)
            j = d + rng.uniform(0, 0.05)
            a, b = first(j), second(j)
            (ours if first is pidfd_wait else old).append(a)
            (old if first is pidfd_wait else ours).append(b)
        extra = [o - n for o, n in zip(old, ours)]
        row = {"child_s": d, "pidfd_s": summary(ours), "poll_loop_s": summary(old),
               "extra_paired_median_s": statistics.median(extra)}
        rows.append(row)
        print(f"{d:8.2f} {row['pidfd_s']['median'] * 1e3:9.2f} {row['poll_loop_s']['median'] * 1e3:13.2f} "
              f"{row['extra_paired_median_s'] * 1e3:18.2f}")
    path = write("child-wait", {"commit": git_rev(), "rounds": args.rounds, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
