"""The model's formulas: each term a rate times a cost, as a share of wall time."""

from __future__ import annotations

import math

from ._model import Method, usage

__all__ = ["break_even_interval", "daly_period", "mean_age_of_newest_protection", "notice_files_loss", "notice_loss",
           "optimum_period", "periodic_loss", "snapshot_newest_share", "unannounced_kill_cost", "young_break_even",
           "young_period"]


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
    raise usage(f"unknown period method {method!r} (young or daly)")


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


