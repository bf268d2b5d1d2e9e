"""The plan: each strategy's lost share and best cadence from the costs and the failures, the
best one first."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._formulas import notice_files_loss, notice_loss, optimum_period, periodic_loss
from ._model import STRATEGIES, TIE_ORDER, Costs, FailureMix, Method, usage

__all__ = ["Plan", "StrategyResult", "plan"]


@dataclass(frozen=True)
class StrategyResult:
    """One strategy at its cadence: period_s is the file cadence (the snapshot period for
    periodic snapshots), None where there is none; lost_share is capped at 1."""

    name: str
    title: str
    period_s: float | None
    lost_share: float
    breakdown: dict[str, float]
    bounded: bool = True
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "period_s": self.period_s, "lost_share": self.lost_share,
                "breakdown": self.breakdown, "bounded": self.bounded, "note": self.note}


@dataclass(frozen=True)
class Plan:
    costs: Costs
    mix: FailureMix
    method: Method
    covered_share: float | None
    strategies: tuple[StrategyResult, ...]
    skipped: dict[str, str] = field(default_factory=dict)
    assumed_zero: tuple[str, ...] = ()

    @property
    def best(self) -> StrategyResult:
        return min(self.strategies, key=lambda s: (round(s.lost_share, 12), TIE_ORDER[s.name]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "costs": self.costs.given(),
            "assumed_zero": list(self.assumed_zero),
            "mix": {"noticed_per_hour": self.mix.noticed_per_hour,
                    "unannounced_per_hour": self.mix.unannounced_per_hour,
                    "lead": None if self.mix.lead is None else self.mix.lead.describe()},
            "method": self.method,
            "covered_share": self.covered_share,
            "strategies": [s.to_dict() for s in self.strategies],
            "skipped": self.skipped,
            "best": self.best.name,
        }


def _result(name: str, period: float | None, breakdown: dict[str, float], note: str = "",
            unbounded: bool = False) -> StrategyResult:
    title = dict(STRATEGIES)[name]
    total = sum(breakdown.values())
    bounded = not unbounded and math.isfinite(total) and total < 1.0
    if not bounded and not unbounded:
        note = (note + "; " if note else "") + "the model's losses reach the whole run: the job would not progress"
    return StrategyResult(name, title, period if period is not None and math.isfinite(period) else None,
                          1.0 if not bounded else total, breakdown, bounded, note)


def _notice_strategies(c: Costs, mix: FailureMix, method: Method, results: list[StrategyResult],
                       skipped: dict[str, str], used: set[str]) -> float | None:
    """The two strategies with a snapshot on notice, added to `results` (or to `skipped`, with
    why); the share of notices the snapshot covers, None when that cannot be told."""
    if c.snapshot_lag is None:
        why = "no snapshot lag (--snapshot-lag) to judge which notices it covers"
        skipped["notice"] = skipped["notice+files"] = why
        return None
    used |= {"snapshot_lag", "snapshot_restore"} | ({"notice_downtime"} if c.notice_downtime is not None else set())
    covered_share = mix.covered_share(c.snapshot_lag) if mix.noticed_per_hour > 0 else None
    covered = mix.covered_rate(c.snapshot_lag)
    uncovered = mix.uncovered_rate(c.snapshot_lag)
    restore = c.snapshot_restore or 0.0
    notices = notice_loss(covered, c.notice_cost)

    if uncovered > 0 and covered <= 0:
        results.append(_result("notice", None, {"notices": notices},
                               "no notice is covered: a failure has no snapshot to go back to", unbounded=True))
    else:
        age = 1.0 / covered if uncovered > 0 else 0.0
        results.append(_result("notice", None, {"notices": notices, "lost_work": uncovered * age,
                                                "recovery": uncovered * restore}))

    if c.file_stall is None:
        skipped["notice+files"] = "no file checkpoint stall (--file-stall)"
    else:
        t = optimum_period(c.file_stall, uncovered, method)
        loss = notice_files_loss(t, c.file_stall, uncovered, covered, restore, c.file_recovery, c.file_lag or 0.0)
        note = "" if math.isfinite(t) else "every failure is covered by a notice: no periodic files needed"
        results.append(_result("notice+files", t, {"notices": notices, **loss}, note))
    return covered_share


def plan(costs: Costs, mix: FailureMix, method: Method = "young") -> Plan:
    """Every strategy the costs allow, each at its cadence, with its expected lost share.

    files: Young/Daly period from every failure; periodic_loss with the file costs.
    snapshots: the same with the snapshot's stall, lag and restore.
    notice: each covered notice costs notice_cost; each uncovered failure restores the last
        notice's snapshot, on average 1/covered_rate old (unbounded without covered notices).
    notice+files: files at the Young/Daly period of the uncovered failures alone (section 13's
        131 s), costed by notice_files_loss, plus each covered notice's cost.
    """
    if mix.rate <= 0:
        raise usage("nothing to plan: no failures (give --noticed-per-hour and/or --unannounced-per-hour)")
    c = costs
    skipped: dict[str, str] = {}
    results: list[StrategyResult] = []
    used: set[str] = set()

    if c.file_stall is not None:
        used |= {"file_stall", "file_lag", "file_restore", "cold_start"}
        t = optimum_period(c.file_stall, mix.rate, method)
        results.append(_result("files", t, periodic_loss(t, c.file_stall, mix.rate, c.file_lag or 0.0,
                                                         c.file_recovery)))
    else:
        skipped["files"] = "no file checkpoint stall (--file-stall)"

    if c.snapshot_stall is not None:
        used |= {"snapshot_stall", "snapshot_lag", "snapshot_restore"}
        t = optimum_period(c.snapshot_stall, mix.rate, method)
        results.append(_result("snapshots", t, periodic_loss(t, c.snapshot_stall, mix.rate, c.snapshot_lag or 0.0,
                                                             c.snapshot_restore or 0.0)))
    else:
        skipped["snapshots"] = "no snapshot stall (--snapshot-stall)"

    covered_share = _notice_strategies(c, mix, method, results, skipped, used)

    if not results:
        raise usage("nothing to plan: give at least --file-stall, --snapshot-stall or --snapshot-lag "
                     "(or --from-result)")
    order = [name for name, _ in STRATEGIES]
    results.sort(key=lambda r: order.index(r.name))
    zero = ("file_lag", "file_restore", "cold_start", "snapshot_lag", "snapshot_restore")
    assumed = tuple(n for n in zero if n in used and getattr(c, n) is None)
    return Plan(c, mix, method, covered_share, tuple(results), skipped, assumed)


# --- costs from snapguard's records ------------------------------------------------------------

