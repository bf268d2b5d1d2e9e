"""Recovery economics: how often a job should still write file checkpoints, and what share of
its GPU time each way of protecting it loses (`snapguard plan`).

The model is the reference's (``../shared/reference/000_*.txt``, the Nodus report 035,
section 8 "What reclaims cost at a given rate" with Table 7, and section 13 "Follow-up 2" with
Table 12; summarised in ``../shared/DESIGN.md``, "Recovery economics"). It is first order, as
the reference's is: failures are a Poisson process, a failure does not move the protection
cycle, and each term is a rate times a cost, as a share of wall time.

- A periodic protection (file checkpoints or leave-running snapshots) every ``period`` seconds
  with failures at ``rate`` per second loses ``stall / period + rate * (period / 2 + lag +
  recovery)`` (section 8, Table 7's caption): its stall once per period, and at each failure half
  a period of work, the protection's lag (until the copy is whole) and the time to the first new
  step. Its best period is Young's ``sqrt(2 * stall / rate)`` [8], Daly's higher-order estimate
  [9] optionally.
- One stopping snapshot on a reclaim notice loses only its freeze-to-first-new-step time at each
  noticed reclaim (section 8: 44 s per reclaim in Table 7), provided the notice comes early
  enough for the snapshot to be whole (its lag) before the machine goes.
- Snapshot on notice plus files (section 13, Table 12, arms B and C): the cadence of the files is
  set from the failures a notice does not cover, unannounced losses plus noticed reclaims whose
  lead is no longer than the snapshot's lag. Each unannounced failure loses the work since the
  newest protection point and then restores the notice's paired snapshot if no file is newer,
  else starts cold from the newest file. Each covered notice restarts the file cycle (the
  reference's arms write an urgent file with the snapshot), which is what reproduces Table 12.

Pure functions, no I/O: the CLI reads the files and prints. Times in seconds, rates per second
unless a name says per hour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from .reasons import Reason, SnapguardError

__all__ = [
    "Costs",
    "FailureMix",
    "LeadTime",
    "Method",
    "Plan",
    "StrategyResult",
    "STRATEGIES",
    "break_even_interval",
    "costs_from_record",
    "daly_period",
    "mean_age_of_newest_protection",
    "notice_files_loss",
    "notice_loss",
    "optimum_period",
    "periodic_loss",
    "plan",
    "snapshot_newest_share",
    "unannounced_kill_cost",
    "young_break_even",
    "young_period",
]

SECONDS_PER_HOUR = 3600.0
Method = Literal["young", "daly"]

# (name, title) in the order the table shows them
STRATEGIES: tuple[tuple[str, str], ...] = (
    ("files", "periodic file checkpoints"),
    ("snapshots", "periodic snapshots"),
    ("notice", "snapshot on notice"),
    ("notice+files", "snapshot on notice + files"),
)
# among equal losses, prefer what the reference recommends: files stay the recovery state (section 9)
_TIE_ORDER = {"notice+files": 0, "files": 1, "notice": 2, "snapshots": 3}


def _usage(detail: str) -> SnapguardError:
    return SnapguardError(Reason.USAGE_ERROR, detail)


def _check_seconds(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _usage(f"{name} must be a finite number of seconds >= 0, not {value!r}")


# --- inputs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """What one protection point and one recovery cost the job, in seconds; None: not measured.

    file_stall: training time one file checkpoint takes (Table 7: 1.36 s; Table 12: 4.79 s).
    file_lag: from the start of a file checkpoint to its copy being usable by a replacement.
    file_restore: from the start of a file resume to its first new step (Table 7: 4.77 s).
    cold_start: what a replacement pays before and around a file resume that a snapshot restore
        skips: start, copy in, compile (Table 12's 55.1 s is the whole kill-to-first-step of a file
        resume: give it here and leave file_restore out). A file recovery costs
        cold_start + file_restore.
    snapshot_stall: training time one leave-running snapshot takes (Table 7: 12.9 s).
    snapshot_lag: from the snapshot request to the image being whole where the replacement reads
        it (Table 7: 31.9 s); a notice with a lead no longer than this is not covered.
    snapshot_restore: from the start of a snapshot restore to the first new step (7.24 s; 4.8 s).
    notice_downtime: freeze to first new step of one snapshot on notice; default
        snapshot_lag + snapshot_restore (Table 7 uses the measured 44 s).
    """

    file_stall: float | None = None
    file_lag: float | None = None
    file_restore: float | None = None
    cold_start: float | None = None
    snapshot_stall: float | None = None
    snapshot_lag: float | None = None
    snapshot_restore: float | None = None
    notice_downtime: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_seconds(f.name, getattr(self, f.name))

    @property
    def file_recovery(self) -> float:
        """Seconds from a failure to the first new step when resuming from a file."""
        return (self.cold_start or 0.0) + (self.file_restore or 0.0)

    @property
    def notice_cost(self) -> float:
        """Seconds from the freeze to the first new step of one snapshot on notice."""
        if self.notice_downtime is not None:
            return self.notice_downtime
        return (self.snapshot_lag or 0.0) + (self.snapshot_restore or 0.0)

    def given(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class LeadTime:
    """How long before the reclaim its notice comes: weighted points, or uniform on [lo, hi]."""

    points: tuple[tuple[float, float], ...] = ()
    uniform: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if (self.uniform is None) == (not self.points):
            raise _usage("a lead time is either weighted points or one uniform range")
        if self.uniform is not None:
            lo, hi = self.uniform
            _check_seconds("lead", lo)
            _check_seconds("lead", hi)
            if hi < lo:
                raise _usage(f"lead range {lo:g}-{hi:g}: the upper end is below the lower")
        for lead, weight in self.points:
            _check_seconds("lead", lead)
            if not math.isfinite(weight) or weight < 0:
                raise _usage(f"lead weight must be a finite number >= 0, not {weight!r}")
        if self.points and sum(w for _, w in self.points) <= 0:
            raise _usage("lead weights sum to 0")

    @classmethod
    def fixed(cls, lead_s: float) -> LeadTime:
        return cls(points=((lead_s, 1.0),))

    @classmethod
    def between(cls, lo_s: float, hi_s: float) -> LeadTime:
        return cls(uniform=(lo_s, hi_s))

    def share_longer_than(self, t: float) -> float:
        """The share of notices whose lead exceeds t seconds (strictly)."""
        if self.uniform is not None:
            lo, hi = self.uniform
            if t < lo:
                return 1.0
            if t >= hi:
                return 0.0
            return (hi - t) / (hi - lo)
        total = sum(w for _, w in self.points)
        return sum(w for lead, w in self.points if lead > t) / total

    def describe(self) -> str:
        if self.uniform is not None:
            return f"{self.uniform[0]:g}-{self.uniform[1]:g} s"
        if len(self.points) == 1:
            return f"{self.points[0][0]:g} s"
        return ",".join(f"{lead:g}:{w:g}" for lead, w in self.points) + " s:weight"


@dataclass(frozen=True)
class FailureMix:
    """Noticed reclaims (with their notice's lead time) and unannounced losses, per hour."""

    noticed_per_hour: float = 0.0
    unannounced_per_hour: float = 0.0
    lead: LeadTime | None = None

    def __post_init__(self) -> None:
        for name in ("noticed_per_hour", "unannounced_per_hour"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise _usage(f"{name} must be a finite rate >= 0, not {v!r}")
        if self.noticed_per_hour > 0 and self.lead is None:
            raise _usage("noticed reclaims need their notice's lead time (--lead S or LO-HI)")

    @property
    def rate(self) -> float:
        """All failures, per second."""
        return (self.noticed_per_hour + self.unannounced_per_hour) / SECONDS_PER_HOUR

    def covered_share(self, snapshot_lag: float) -> float:
        """The share of noticed reclaims whose lead exceeds the snapshot's lag (section 13)."""
        return self.lead.share_longer_than(snapshot_lag) if self.lead is not None else 0.0

    def covered_rate(self, snapshot_lag: float) -> float:
        """Noticed reclaims a snapshot on notice covers, per second."""
        return self.noticed_per_hour * self.covered_share(snapshot_lag) / SECONDS_PER_HOUR

    def uncovered_rate(self, snapshot_lag: float) -> float:
        """Failures a notice does not cover, per second: unannounced losses plus noticed
        reclaims whose lead is too short for the snapshot (section 13's cadence rule)."""
        return self.rate - self.covered_rate(snapshot_lag)


# --- the model -------------------------------------------------------------------------------


def young_period(stall: float, rate: float) -> float:
    """Young's first-order optimum period, sqrt(2 * stall / rate) = sqrt(2 * stall * MTBF)
    (reference section 8, Table 7's caption; section 13's 131 s cadence). inf when rate is 0."""
    if rate <= 0:
        return math.inf
    return math.sqrt(2.0 * stall / rate)


def daly_period(stall: float, rate: float) -> float:
    """Daly's higher-order estimate [9] (Daly 2006): with M = 1/rate,
    sqrt(2 * stall * M) * (1 + sqrt(stall / 2M) / 3 + (stall / 2M) / 9) - stall when
    stall < 2M, else M. The reference cites it (section 11); its tables use Young's."""
    if rate <= 0:
        return math.inf
    mtbf = 1.0 / rate
    if stall >= 2.0 * mtbf:
        return mtbf
    a = stall / (2.0 * mtbf)
    return math.sqrt(2.0 * stall * mtbf) * (1.0 + math.sqrt(a) / 3.0 + a / 9.0) - stall


def optimum_period(stall: float, rate: float, method: Method = "young") -> float:
    if method == "young":
        return young_period(stall, rate)
    if method == "daly":
        return daly_period(stall, rate)
    raise _usage(f"unknown period method {method!r} (young or daly)")


def periodic_loss(period: float, stall: float, rate: float, lag: float, recovery: float) -> dict[str, float]:
    """The share of time a periodic protection loses (section 8, Table 7):
    stall / period + rate * (period / 2 + lag + recovery), as its three terms."""
    return {
        "stall": stall / period if math.isfinite(period) else 0.0,
        "lost_work": rate * (period / 2.0 + lag) if rate > 0 else 0.0,
        "recovery": rate * recovery,
    }


def notice_loss(covered_rate: float, downtime: float) -> float:
    """One snapshot on each covered notice: rate * freeze-to-first-new-step (section 8)."""
    return covered_rate * downtime


def snapshot_newest_share(period: float, covered_rate: float) -> float:
    """The chance that at an unannounced failure the newest protection point is the snapshot of
    the last covered notice, not a periodic file: no file written since that notice, with the
    file cycle restarted at each notice, 1 - exp(-period * covered_rate) (section 13)."""
    if covered_rate <= 0 or period <= 0:
        return 0.0
    if not math.isfinite(period):
        return 1.0
    return -math.expm1(-period * covered_rate)


def mean_age_of_newest_protection(period: float, covered_rate: float) -> float:
    """The expected work lost at an unannounced failure when files are written every period
    and each covered notice (Poisson, covered_rate) restarts the cycle with a snapshot: the age
    of the newest of the two, E[X mod period] with X ~ Exp(covered_rate),
    = 1/rate - period * q / (1 - q), q = exp(-period * rate). With no notices it is period / 2,
    Young's half period (section 8); with no files it is 1/rate (section 13's arm D)."""
    if covered_rate <= 0:
        return period / 2.0
    if not math.isfinite(period):
        return 1.0 / covered_rate
    x = period * covered_rate
    if x < 1e-6:
        return period / 2.0 - period * x / 12.0  # the series, where 1 - x/expm1(x) cancels
    if x > 700.0:
        return 1.0 / covered_rate
    return (1.0 - x / math.expm1(x)) / covered_rate


def unannounced_kill_cost(period: float, covered_rate: float, snapshot_restore: float, file_recovery: float,
                          file_lag: float = 0.0) -> float:
    """Seconds one unannounced failure costs with a snapshot on notice plus files every period
    (section 13, Table 12: "the expected cost of one unannounced kill"): the work since the
    newest protection point, then the paired snapshot's restore while no file is newer, else a
    file recovery (a cold start) and the file's lag."""
    p_snapshot = snapshot_newest_share(period, covered_rate)
    return (mean_age_of_newest_protection(period, covered_rate)
            + p_snapshot * snapshot_restore + (1.0 - p_snapshot) * (file_recovery + file_lag))


def notice_files_loss(period: float, stall: float, uncovered_rate: float, covered_rate: float,
                      snapshot_restore: float, file_recovery: float, file_lag: float = 0.0) -> dict[str, float]:
    """What files every period lose next to a snapshot on notice, the notices' own cost left
    out (section 13, Table 12: "the checkpoint stall over the cadence plus the unannounced rate
    times the expected cost of one unannounced kill"; "the cost of the notices ... cancels")."""
    p_snapshot = snapshot_newest_share(period, covered_rate)
    return {
        "stall": stall / period if math.isfinite(period) else 0.0,
        "lost_work": uncovered_rate * (mean_age_of_newest_protection(period, covered_rate)
                                       + (1.0 - p_snapshot) * file_lag),
        "recovery": uncovered_rate * (p_snapshot * snapshot_restore + (1.0 - p_snapshot) * file_recovery),
    }


def break_even_interval(period_a: float, period_b: float, stall: float, covered_rate: float,
                        snapshot_restore: float, file_recovery: float, file_lag: float = 0.0) -> float:
    """The mean interval between unannounced failures at which files every period_a and every
    period_b lose the same (section 13: "C stops beating B at about 534 s"). The loss is
    stall/T + k(T)/M, so M = (k(b) - k(a)) / (stall/a - stall/b)."""
    def k(t: float) -> float:
        return unannounced_kill_cost(t, covered_rate, snapshot_restore, file_recovery, file_lag)
    return (k(period_b) - k(period_a)) / (stall / period_a - stall / period_b)


def young_break_even(period_a: float, period_b: float, stall: float) -> float:
    """The same break-even with plain Young/Daly costs, stall/T + (T/2)/M: the product of the two
    cadences over twice the checkpoint cost (section 13: 821 s)."""
    return period_a * period_b / (2.0 * stall)


# --- outputs ---------------------------------------------------------------------------------


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
        return min(self.strategies, key=lambda s: (round(s.lost_share, 12), _TIE_ORDER[s.name]))

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
        raise _usage("nothing to plan: no failures (give --noticed-per-hour and/or --unannounced-per-hour)")
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

    covered_share: float | None = None
    if c.snapshot_lag is None:
        why = "no snapshot lag (--snapshot-lag) to judge which notices it covers"
        skipped["notice"] = skipped["notice+files"] = why
    else:
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

    if not results:
        raise _usage("nothing to plan: give at least --file-stall, --snapshot-stall or --snapshot-lag "
                     "(or --from-result)")
    order = [name for name, _ in STRATEGIES]
    results.sort(key=lambda r: order.index(r.name))
    zero = ("file_lag", "file_restore", "cold_start", "snapshot_lag", "snapshot_restore")
    assumed = tuple(n for n in zero if n in used and getattr(c, n) is None)
    return Plan(c, mix, method, covered_share, tuple(results), skipped, assumed)


# --- costs from snapguard's records ------------------------------------------------------------


def _num(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def _snapshot_rank(arm: str, want_stop: bool) -> tuple[Any, ...]:
    # trimmed (the take point's release: the product's snapshot) first, then the kind wanted
    # (a stop snapshot is the one taken on notice), then the plain eager trainer
    trimmed = "trimmed" in arm and "untrimmed" not in arm
    return (not trimmed, ("stop" in arm) != want_stop, "container" in arm, "expandable" in arm,
            "compiled" in arm, arm)


def _file_rank(arm: str) -> tuple[Any, ...]:
    return ("warm" in arm, "compiled" in arm, arm != "file-checkpoint", arm)


def _from_drill(rows: list[Any]) -> tuple[dict[str, float], dict[str, str]]:
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("arm"), str)]
    snaps = [r for r in rows if "file" not in r["arm"] and r["arm"] not in ("reference", "compiled-reference")]
    files = [r for r in rows if "file" in r["arm"]]
    wanted: list[tuple[str, list[dict[str, Any]], str, Any]] = [
        ("snapshot_stall", snaps, "stall_s", lambda a: _snapshot_rank(a, want_stop=False)),
        ("snapshot_lag", snaps, "request_to_complete_image_s", lambda a: _snapshot_rank(a, want_stop=True)),
        ("snapshot_restore", snaps, "restore_to_first_new_step_s", lambda a: _snapshot_rank(a, want_stop=True)),
        ("file_stall", files, "stall_s", _file_rank),
        # measured from the resumed trainer's launch: it holds the start, so cold_start stays unset
        ("file_restore", files, "resume_to_first_new_step_s", _file_rank),
    ]
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    for name, pool, key, rank in wanted:
        have = sorted((r for r in pool if _num(r, key) is not None), key=lambda r: rank(r["arm"]))
        if have:
            values[name] = _num(have[0], key)  # type: ignore[assignment]
            sources[name] = f"{have[0]['arm']} {key}"
    return values, sources


def _from_result(record: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    timings = record.get("timings")
    if not isinstance(timings, dict) or _num(timings, "total_s") is None:
        raise _usage("a result record without timings.total_s")
    total = _num(timings, "total_s") or 0.0
    op = record.get("operation")
    if op == "checkpoint":
        values = {"snapshot_lag": total}
        sources = {"snapshot_lag": "checkpoint timings.total_s"}
        if record.get("leave_running"):
            # the workload runs through the preflight, the image directory and the seal
            running = sum(_num(timings, k) or 0.0 for k in ("preflight_s", "image_dir_s", "seal_s"))
            values["snapshot_stall"] = max(total - running, 0.0)
            sources["snapshot_stall"] = "checkpoint timings.total_s - preflight_s - image_dir_s - seal_s"
        return values, sources
    if op == "restore":
        return {"snapshot_restore": total}, {"snapshot_restore": "restore timings.total_s"}
    raise _usage(f"a result record of operation {op!r}, not checkpoint or restore")


def costs_from_record(record: Any) -> tuple[dict[str, float], dict[str, str]]:
    """Costs measured in one of snapguard's records, and where each came from.

    A `snapguard-result.json` (``operation``, ``timings``): a checkpoint gives the snapshot lag
    (total_s: request to complete image) and, left running, its stall (total_s less the steps
    during which the workload runs); a restore gives the snapshot restore (total_s). A drill
    record (``rows``, `snapguard drill --workload torch`): the trimmed leave-running row's
    stall_s, the trimmed stop row's request_to_complete_image_s and restore_to_first_new_step_s,
    the file arm's stall_s and resume_to_first_new_step_s. A failure record has no costs."""
    if not isinstance(record, dict):
        raise _usage("not a JSON object")
    if isinstance(record.get("rows"), list):
        values, sources = _from_drill(record["rows"])
    elif record.get("ok") is False:
        raise _usage(f"the record of a failed run ({record.get('reason', 'no reason')}): it measured no costs")
    elif "operation" in record:
        values, sources = _from_result(record)
    else:
        raise _usage("neither a snapguard result (operation, timings) nor a drill record (rows)")
    if not values:
        raise _usage("no cost in it (stall_s, request_to_complete_image_s, restore_to_first_new_step_s, "
                     "resume_to_first_new_step_s)")
    return values, sources
