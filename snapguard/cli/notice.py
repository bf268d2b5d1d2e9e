"""`snapguard notice`: give the local agent a reclaim notice (operators, drains)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..config import load
from ._base import positive_seconds, root_only

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    no = sub.add_parser("notice", help="give the local agent a reclaim notice (operators, drains)",
                        description=("Write a notice into the agent's inbox (<state_dir>/agent/inbox, atomically); "
                                     "the running agent snapshots the protected workloads on it. The same --id "
                                     "twice is acted on once."))
    no.add_argument("--reason", default="operator notice", metavar="TEXT", help="why (journalled)")
    no.add_argument("--id", metavar="ID", help="the notice's id (default: a new one)")
    no.add_argument("--lead", type=positive_seconds, metavar="S", help="seconds before the node goes (informational)")
    no.add_argument("--json", action="store_true", help="print what was written as JSON")


def run(args: argparse.Namespace) -> int:
    from ..notice import post_notice

    root_only("snapguard notice")
    path = post_notice(load(), args.reason, notice_id=args.id, lead_s=args.lead)
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    print(json.dumps({**doc, "path": path}) if args.json else f"snapguard notice {doc['id']} posted ({path})")
    return 0
