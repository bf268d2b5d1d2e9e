"""Start a `world`-rank job of train.py on this host (store and peers on loopback) and wait for it.

The launcher is the root of the job's process tree: a snapshot of its pid is a snapshot of every
rank. Rank output goes to <out>/rank<r>.out, opened O_APPEND so the files may grow after a dump.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", required=True)
    args, rest = ap.parse_known_args()
    port = free_port()
    ranks = []
    for rank in range(args.world):
        # TCPStore's libuv server makes an io_uring instance, which CRIU cannot dump (snapguard
        # refuses it as IO_URING_PRESENT): the classic TCPStore server has none.
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "USE_LIBUV": "0", "UV_USE_IO_URING": "0"}
        out = open(os.path.join(args.out, f"rank{rank}.out"), "ab")
        ranks.append(subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), "--out", args.out, *rest],
                                      env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out))
        out.close()
    return max(p.wait() for p in ranks)


if __name__ == "__main__":
    sys.exit(main())
