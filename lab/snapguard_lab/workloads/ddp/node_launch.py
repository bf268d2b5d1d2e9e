"""Start this node's ranks of a job of train.py as torchrun's agent starts them, and wait for them.

Each rank gets the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) and nothing else of the job's: the
rendezvous is rank 0's node's address, as given. The launcher is the root of the node's process
tree: a snapshot of its pid is a snapshot of this node's ranks. Rank output goes to
<out>/rank<r>.out, opened O_APPEND.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", required=True, help="this node's global ranks, comma-separated")
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master", required=True, metavar="HOST:PORT")
    ap.add_argument("--out", required=True)
    args, rest = ap.parse_known_args()
    host, port = args.master.rsplit(":", 1)
    ranks = [int(r) for r in args.ranks.split(",")]
    procs = []
    for local, rank in enumerate(ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(args.world),
               "LOCAL_WORLD_SIZE": str(len(ranks)), "GROUP_RANK": str(args.node_rank),
               "MASTER_ADDR": host, "MASTER_PORT": port}
        out = open(os.path.join(args.out, f"rank{rank}.out"), "ab")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--out", args.out, *rest],
                                      env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out))
        out.close()
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
