"""`snapguard protect`: register a workload for the agent to snapshot on a notice."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..config import load
from ..reasons import Reason, SnapguardError
from ._base import root_only

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    pr = sub.add_parser("protect", help="register a workload for the agent to snapshot on a notice",
                        description=("Add a bare process tree (--pid) or a runc container (--container, --root) "
                                     "to the agent's registry (<state_dir>/agent/registry.json, root only), "
                                     "remove it (--remove) or list the registry (--list)."))
    what = pr.add_mutually_exclusive_group()
    what.add_argument("--pid", type=int, metavar="PID", help="root of a bare process tree")
    what.add_argument("--container", metavar="ID", help="a runc container id")
    pr.add_argument("--root", metavar="DIR", help="runc --root for --container (containerd: /run/containerd/runc/NS)")
    pr.add_argument("--job", metavar="J", help="the job's name (the image's name in the store)")
    pr.add_argument("--file-checkpoint", metavar="PATH", help="the job's file checkpoint: the fallback when no "
                                                                "snapshot can be taken (journalled)")
    pr.add_argument("--epoch", type=epoch_number, metavar="N", help="the fencing epoch this attempt of the job holds (its "
                                                            "uploads are refused once a newer one is taken)")
    pr.add_argument("--remove", action="store_true", help="remove --pid or --container from the registry")
    pr.add_argument("--list", action="store_true", help="list the registry")
    pr.add_argument("--json", action="store_true", help="print as JSON")


def epoch_number(text: str) -> int:
    """--epoch: an integer >= 0 (the store's epochs count up from 0)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"an epoch is >= 0, not {text}")
    return value


def run(args: argparse.Namespace) -> int:
    from ..notice import Registry, agent_dir
    from ..notice import check_job

    root_only("snapguard protect")
    registry = Registry(agent_dir(load()))
    if args.list:
        w = registry.load()
        if args.json:
            print(json.dumps(w, indent=2, sort_keys=True))
        elif not w:  # as kubectl's "No resources found": said, on stderr, and not a failure
            print(f"snapguard protect: nothing is protected (the registry {registry.path} is empty)",
                  file=sys.stderr)
        else:
            for key, e in sorted(w.items()):
                print(f"{key}\tjob {e.get('job')}\t{e.get('state')}\t{e.get('image') or ''}".rstrip())
        return 0
    if args.pid is None and args.container is None:
        raise SnapguardError(Reason.USAGE_ERROR, "protect needs --pid or --container (or --list)")
    key = f"pid:{args.pid}" if args.pid is not None else f"container:{args.container}"
    if args.remove:
        if not registry.remove(key):
            raise SnapguardError(Reason.USAGE_ERROR, f"{key} is not registered")
        print(json.dumps({"removed": key}) if args.json else f"snapguard protect: {key} removed")
        return 0
    if not args.job:
        raise SnapguardError(Reason.USAGE_ERROR, "protect needs --job")
    check_job(args.job)  # the store's own name check: refused now, not after the notice stopped it
    fc = os.path.abspath(args.file_checkpoint) if args.file_checkpoint else None
    entry = (registry.add_pid(args.pid, args.job, fc, args.epoch) if args.pid is not None
             else registry.add_container(args.container, args.root, args.job, fc, args.epoch))
    print(json.dumps(entry, sort_keys=True) if args.json else f"snapguard protect: {key} (job {args.job}) registered")
    return 0
