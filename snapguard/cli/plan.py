"""`snapguard plan`: file-checkpoint cadence and GPU time lost per protection strategy.

snapguard.plan is imported when the command runs, not with the CLI."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..reasons import Reason, SnapguardError
from ._base import seconds

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    pl = sub.add_parser("plan", help="file-checkpoint cadence and GPU time lost per protection strategy",
                        description=(
                            "The recovery economics of a job (Young/Daly, notice-aware): from its measured costs "
                            "and a failure mix, the file-checkpoint cadence and the expected share of GPU time "
                            "lost with periodic file checkpoints, periodic snapshots, a snapshot on notice, and a "
                            "snapshot on notice plus files at the cadence the uncovered failures set. A notice "
                            "covers a reclaim only when its lead exceeds the snapshot's lag. All costs in seconds."))
    for flag, what in (("--file-stall", "training time one file checkpoint takes"),
                       ("--file-lag", "file checkpoint start to its copy being usable by a replacement"),
                       ("--file-restore", "file resume start to its first new step"),
                       ("--cold-start", "what a replacement pays around a file resume and a snapshot restore "
                                        "skips (start, copy in, compile); a file recovery costs it plus "
                                        "--file-restore"),
                       ("--snapshot-stall", "training time one leave-running snapshot takes"),
                       ("--snapshot-lag", "snapshot request to the image being whole for the replacement"),
                       ("--snapshot-restore", "snapshot restore start to the first new step"),
                       ("--notice-downtime", "freeze to first new step of one snapshot on notice (default: "
                                             "snapshot lag + restore)")):
        pl.add_argument(flag, type=seconds, metavar="S", help=what)
    pl.add_argument("--noticed-per-hour", type=seconds, default=0.0, metavar="R",
                    help="reclaims that come with a notice, per hour")
    pl.add_argument("--lead", type=_lead, metavar="S|LO-HI",
                    help="the notice's lead before the reclaim: S seconds, uniform LO-HI, or S:W,S:W weighted")
    pl.add_argument("--unannounced-per-hour", type=seconds, default=0.0, metavar="R",
                    help="losses without a notice (crashes, heartbeat loss), per hour")
    pl.add_argument("--from-result", action="append", default=[], metavar="PATH",
                    help="fill costs from a snapguard-result.json or a torch drill JSON (repeatable; later files "
                         "win, flags win over files)")
    pl.add_argument("--daly", action="store_true", help="periods by Daly's higher-order estimate (default: Young)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")


def _lead(text: str) -> tuple[str, tuple[float, ...]]:
    """--lead S, LO-HI or S:W,S:W,...: a fixed lead, a uniform range or weighted points."""
    try:
        if ":" in text:
            points = [part.split(":") for part in text.split(",")]
            if any(len(pt) != 2 for pt in points):
                raise argparse.ArgumentTypeError("each point is LEAD:WEIGHT")
            return "points", tuple(seconds(x) for pt in points for x in pt)
        try:
            float(text)
        except ValueError:
            lo, sep, hi = text.rpartition("-")
            if sep and lo:
                return "range", (seconds(lo), seconds(hi))
        return "fixed", (seconds(text),)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--lead {text}: {e} (give S, LO-HI or S:W,S:W)") from None


def run(args: argparse.Namespace) -> int:
    from .. import plan

    measured: dict[str, float] = {}
    sources: dict[str, str] = {}
    for path in args.from_result:
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError) as e:
            raise SnapguardError(Reason.USAGE_ERROR, f"--from-result {path}: {getattr(e, 'strerror', None) or e}")
        try:
            values, found_in = plan.costs_from_record(record)
        except SnapguardError as e:
            raise SnapguardError(Reason.USAGE_ERROR, f"--from-result {path}: {e.failure.detail}") from None
        measured.update(values)
        sources.update({k: f"{path}: {v}" for k, v in found_in.items()})
    for name in ("file_stall", "file_lag", "file_restore", "cold_start", "snapshot_stall", "snapshot_lag",
                 "snapshot_restore", "notice_downtime"):
        if getattr(args, name) is not None:
            measured[name] = getattr(args, name)
            sources[name] = "flag"
    lead = None
    if args.lead is not None:
        kind, v = args.lead
        lead = (plan.LeadTime.fixed(v[0]) if kind == "fixed" else plan.LeadTime.between(v[0], v[1])
                if kind == "range" else plan.LeadTime(points=tuple(zip(v[::2], v[1::2]))))
    mix = plan.FailureMix(args.noticed_per_hour, args.unannounced_per_hour, lead)
    result = plan.plan(plan.Costs(**measured), mix, "daly" if args.daly else "young")
    if args.json:
        print(json.dumps({**result.to_dict(), "sources": sources}, indent=2))
        return 0
    cover = ""
    if result.covered_share is not None and lead is not None:
        cover = (f", {result.covered_share:.0%} covered (lead {lead.describe()} vs "
                 f"{measured['snapshot_lag']:g} s snapshot lag)")
    print(f"snapguard plan ({'Daly' if args.daly else 'Young'}): noticed {mix.noticed_per_hour:g}/h{cover}; "
          f"unannounced {mix.unannounced_per_hour:g}/h")
    best = result.best.name
    for s in result.strategies:
        every = f"every {round(s.period_s)} s" if s.period_s is not None else ""
        cadence = {"files": f"files {every}", "snapshots": f"snapshots {every}", "notice": "-",
                   "notice+files": f"files {every}" if every else "no files needed"}[s.name]
        lost = f"{s.lost_share:6.1%}" if s.bounded else "  100% (no progress)"
        print(f"  {s.title:<28}{cadence:<22}{lost}{'   <- best' if s.name == best else ''}")
    for name, why in result.skipped.items():
        print(f"  not planned: {dict(plan.STRATEGIES)[name]}: {why}")
    if result.assumed_zero:
        print(f"  taken as 0 s (not given): {', '.join(result.assumed_zero)}")
    for name, where in sources.items():
        if where != "flag":
            print(f"  {name} {measured[name]:.2f} s from {where}")
    return 0
