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

from ._formulas import (break_even_interval, daly_period, mean_age_of_newest_protection, notice_files_loss,
                        notice_loss, optimum_period, periodic_loss, snapshot_newest_share, unannounced_kill_cost,
                        young_break_even, young_period)
from ._model import SECONDS_PER_HOUR, STRATEGIES, Costs, FailureMix, LeadTime, Method
from ._planner import Plan, StrategyResult, plan
from ._records import costs_from_record

__all__ = [
    "Costs",
    "FailureMix",
    "LeadTime",
    "Method",
    "Plan",
    "StrategyResult",
    "SECONDS_PER_HOUR",
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
