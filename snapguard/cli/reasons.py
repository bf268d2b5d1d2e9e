"""`snapguard reasons [NAME]`: the typed failure reasons, with meaning, phase and remedy; with
NAME, that one reason explained."""

from __future__ import annotations

import argparse
import difflib
import json
from typing import Any

from ..reasons import Reason, SnapguardError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    rs = sub.add_parser("reasons", help="list the typed failure reasons, or explain one",
                        description=("The stable failure reason names with meaning, phase and remedy. With NAME "
                                     "(as printed in `snapguard NAME: ...` lines, any case), that reason alone "
                                     "with its remedy; an unknown name is a USAGE_ERROR (exit 2) naming the "
                                     "closest ones."))
    rs.add_argument("name", nargs="?", metavar="NAME", help="a reason to explain (e.g. CRIU_MISSING)")
    rs.add_argument("--json", action="store_true", help="print as JSON")


def _row(r: Reason) -> dict[str, Any]:
    return {"reason": r.name, "phase": r.phase.value, "workload_intact": r.workload_intact,
            "meaning": r.meaning, "remedy": r.remedy}


def run(args: argparse.Namespace) -> int:
    if args.name is not None:
        name = args.name.strip().upper().replace("-", "_")
        if name not in Reason.__members__:
            close = difflib.get_close_matches(name, Reason.__members__, n=3, cutoff=0.5)
            raise SnapguardError(Reason.USAGE_ERROR, f"no reason named {args.name[:60]!r}"
                                 + (f"; did you mean {', '.join(close)}?" if close else "; `snapguard reasons` "
                                    "lists them"))
        r = Reason[name]
        if args.json:
            print(json.dumps(_row(r), indent=2))
        else:
            print(f"{r.name}\n  meaning:   {r.meaning}\n  phase:     {r.phase.value}\n"
                  f"  workload:  {'left as it was' if r.workload_intact else 'may be affected'}\n"
                  f"  remedy:    {r.remedy}")
        return 0
    rows = [_row(r) for r in Reason]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max(len(r.name) for r in Reason)
        for r in Reason:
            print(f"{r.name:<{width}}  {r.phase.value:<10}  {r.meaning}")
    return 0
