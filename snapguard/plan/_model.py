"""The planner's inputs: what protections cost (Costs), when notices come (LeadTime), and how
often failures come, noticed or not (FailureMix)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Literal

from ..reasons import Reason, SnapguardError

__all__ = ["Costs", "FailureMix", "LeadTime", "Method", "SECONDS_PER_HOUR", "STRATEGIES", "TIE_ORDER", "check_seconds",
           "usage"]

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
TIE_ORDER = {"notice+files": 0, "files": 1, "notice": 2, "snapshots": 3}


def usage(detail: str) -> SnapguardError:
    return SnapguardError(Reason.USAGE_ERROR, detail)


def check_seconds(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise usage(f"{name} must be a finite number of seconds >= 0, not {value!r}")


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
            check_seconds(f.name, getattr(self, f.name))

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
            raise usage("a lead time is either weighted points or one uniform range")
        if self.uniform is not None:
            lo, hi = self.uniform
            check_seconds("lead", lo)
            check_seconds("lead", hi)
            if hi < lo:
                raise usage(f"lead range {lo:g}-{hi:g}: the upper end is below the lower")
        for lead, weight in self.points:
            check_seconds("lead", lead)
            if not math.isfinite(weight) or weight < 0:
                raise usage(f"lead weight must be a finite number >= 0, not {weight!r}")
        if self.points and sum(w for _, w in self.points) <= 0:
            raise usage("lead weights sum to 0")

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
                raise usage(f"{name} must be a finite rate >= 0, not {v!r}")
        if self.noticed_per_hour > 0 and self.lead is None:
            raise usage("noticed reclaims need their notice's lead time (--lead S or LO-HI)")

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

