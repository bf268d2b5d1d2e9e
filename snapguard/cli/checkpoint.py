"""`snapguard checkpoint`: snapshot a bare process tree with the executor's guards.

Its flags become one pipeline.Request."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..config import load
from ._base import snapshot

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    ck = sub.add_parser("checkpoint", help="snapshot a bare process tree (not in a container) with CRIU",
                        description=(
                            "Snapshot the process tree rooted at --pid into --images with the executor's guards: "
                            "preflight, the take point (a workload started with snapguard's hook is asked to "
                            "stop at a step boundary, move its optimizer's tensors off the GPU and release "
                            "PyTorch's free reserve), CRIU with its CUDA plugin, and on failure every CUDA "
                            "process brought back to running. A trainer in this mount namespace moves those "
                            "bytes into a tmpfs file of its own (its spill), which snapguard writes into the "
                            "image apart from CRIU and passes back at the release: in SNAPGUARD_TAKE_SPILL_DIR "
                            "of its environment, else /run/snapguard-spill where a tmpfs is mounted there (with "
                            "huge pages: `snapguard preflight --node` says), else /dev/shm; "
                            "SNAPGUARD_TAKE_SPILL=0 keeps them in its memory. Exit 0 done, "
                            "1 refused or failed (one typed line on stderr), 2 usage, configuration or an "
                            "untrusted install (UNTRUSTED_PATH): nothing was tried."))
    ck.add_argument("--pid", type=int, required=True, help="root of the process tree")
    ck.add_argument("--images", required=True, metavar="DIR", help="image directory (created 0700)")
    ck.add_argument("--leave-running", action="store_true", help="keep the tree running after the snapshot")
    ck.add_argument("--tcp-established", action="store_true", help="carry established TCP connections")
    ck.add_argument("--take-wait", type=float, default=None, metavar="S",
                    help="seconds to wait for the workload's step boundary (default: take_wait_s of the "
                         "config, 10); then go on without")
    ck.add_argument("--job", metavar="J", help="the job this tree runs: its fencing epoch on this node (taken by "
                    "`restore --store`) is sealed into the manifest, so a stale node's push is refused")
    ck.add_argument("--network-lock", choices=("auto", "iptables", "nftables", "skip"), default="auto",
                    help="how CRIU keeps the network still: auto (default) skips it when nothing outside the "
                         "tree can reach it, else iptables")
    ck.add_argument("--at-step", type=_step, default=None, metavar="N",
                    help="hold the tree's trainers at the end of optimizer step N (a step none has reached): "
                         "give every node of a multi-node job the same N, so that all ranks stop together; "
                         "default: two steps past the furthest rank of this tree")
    ck.add_argument("--json", action="store_true", help="print the result record as JSON")


def _step(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 1 << 62:
        raise argparse.ArgumentTypeError(f"not a step number: {text[:40]!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    from .. import pipeline

    config = load()
    req = pipeline.Request(os.path.abspath(args.images), leave_running=args.leave_running,
                           tcp_established=args.tcp_established, network_lock=args.network_lock,
                           timeouts=pipeline.Timeouts.from_config(config, args.take_wait),
                           fence_epoch=pipeline.node_epoch(config, args.job, "") if args.job else None,
                           at_step=args.at_step)
    runner = pipeline.CriuRunner(config.criu, args.pid)
    return snapshot(args, req.work_dir, lambda: pipeline.checkpoint(runner, req, config))
