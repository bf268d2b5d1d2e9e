"""`snapguard reasons`: the typed failure reasons, with meaning, phase and remedy."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..reasons import Reason

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    rs = sub.add_parser("reasons", help="list the typed failure reasons",
                        description="The stable failure reason names with meaning, phase and remedy.")
    rs.add_argument("--json", action="store_true", help="print as JSON")


def run(args: argparse.Namespace) -> int:
    rows = [{"reason": r.name, "phase": r.phase.value, "workload_intact": r.workload_intact,
             "meaning": r.meaning, "remedy": r.remedy} for r in Reason]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max(len(r.name) for r in Reason)
        for r in Reason:
            print(f"{r.name:<{width}}  {r.phase.value:<10}  {r.meaning}")
    return 0
