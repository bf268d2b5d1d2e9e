"""`snapguard plan`: the reference's recovery-economics model (../shared/reference/000_*.txt,
sections 8 and 13) reproduces its published figures, Table 7 and Table 12, to the rounding shown.

Rounding as published: lost shares in percent to one decimal, periods and break-evens to the
nearest second. Where the published figure differs from what the model gives on the published
(rounded) inputs, the cell is listed in a KNOWN_* dict with both values and asserted as such; a
second test then shows that inputs inside the published rounding reproduce every cell, so the
differences come from the inputs having been published rounded, not from the model.
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from snapguard.plan import (
    Costs,
    FailureMix,
    LeadTime,
    break_even_interval,
    costs_from_record,
    daly_period,
    mean_age_of_newest_protection,
    notice_files_loss,
    periodic_loss,
    plan,
    snapshot_newest_share,
    young_break_even,
    young_period,
)
from snapguard.reasons import Reason, SnapguardError

REPO = Path(__file__).resolve().parents[2]
SNAPGUARD = os.path.join(os.path.dirname(sys.executable), "snapguard")
DRILL = REPO / "bench/results/h200/torch-drill-final-2026-11-29.json"


def pct(share: float) -> float:
    return round(100.0 * share, 1)


# --- Table 7 (section 8) ---------------------------------------------------------------------

# snapshots 12.9 s stall, 31.9 s lag, 7.24 s to the first new step; files 1.36 s, 3.4 s, 4.77 s;
# one snapshot on notice 44 s from the freeze to the first new step
T7_COSTS = Costs(file_stall=1.36, file_lag=3.4, file_restore=4.77, snapshot_stall=12.9, snapshot_lag=31.9,
                 snapshot_restore=7.24, notice_downtime=44.0)
# reclaims per hour -> strategy -> (lost %, period s); the notice has no period
T7_PUBLISHED: dict[float, dict[str, tuple[float, int | None]]] = {
    0.25: {"snapshots": (4.5, 610), "files": (1.4, 198), "notice": (0.3, None)},
    1.0: {"snapshots": (9.6, 305), "files": (3.0, 99), "notice": (1.2, None)},
    4.0: {"snapshots": (21.3, 153), "files": (6.4, 50), "notice": (4.9, None)},
}
# (rate, strategy, what) -> (published, the model on the published inputs). sqrt(2 * 12.9 * 900)
# = 152.38 and sqrt(2 * 1.36 * 900) = 49.48: the published 153 and 50 need a stall of at least
# 12.920 s and 1.3613 s, which the text rounds to 12.9 and 1.36 (see the test after this one).
T7_KNOWN: dict[tuple[float, str, str], tuple[float, float]] = {
    (4.0, "snapshots", "period"): (153, 152),
    (4.0, "files", "period"): (50, 49),
}


def _table7(costs: Costs) -> dict[tuple[float, str, str], float | None]:
    got: dict[tuple[float, str, str], float | None] = {}
    for rate in T7_PUBLISHED:
        # every reclaim of Table 7 comes with a notice long enough (37 s were needed)
        result = plan(costs, FailureMix(noticed_per_hour=rate, lead=LeadTime.fixed(120.0)))
        by_name = {s.name: s for s in result.strategies}
        for name in ("snapshots", "files", "notice"):
            s = by_name[name]
            got[(rate, name, "lost")] = pct(s.lost_share)
            got[(rate, name, "period")] = None if s.period_s is None else round(s.period_s)
    return got


def _published7() -> dict[tuple[float, str, str], float | None]:
    return {(rate, name, what): value for rate, row in T7_PUBLISHED.items() for name, cell in row.items()
            for what, value in zip(("lost", "period"), cell)}


def test_table7_every_cell_from_the_published_inputs() -> None:
    got, published = _table7(T7_COSTS), _published7()
    assert len(published) == 18
    for cell, value in published.items():
        if cell in T7_KNOWN:
            assert T7_KNOWN[cell][0] == value, cell
            assert got[cell] == T7_KNOWN[cell][1] != value, cell  # the known difference, explicitly
        else:
            assert got[cell] == value, cell


def test_table7_every_cell_from_inputs_inside_the_published_rounding() -> None:
    # 12.93 s rounds to 12.9 and 1.363 s to 1.36: with them every cell, periods included, matches
    costs = Costs(file_stall=1.363, file_lag=3.4, file_restore=4.77, snapshot_stall=12.93, snapshot_lag=31.9,
                  snapshot_restore=7.24, notice_downtime=44.0)
    assert _table7(costs) == _published7()


def test_table7_is_the_young_cost_at_the_young_period() -> None:
    rate = 1.0 / 3600.0
    t = young_period(12.9, rate)
    assert t == pytest.approx(math.sqrt(2 * 12.9 * 3600))
    terms = periodic_loss(t, 12.9, rate, 31.9, 7.24)
    assert sum(terms.values()) == pytest.approx(12.9 / t + rate * (t / 2 + 31.9 + 7.24))
    assert terms["stall"] == pytest.approx(terms["lost_work"] - rate * 31.9)  # Young's optimum: equal halves


def test_follow_up_1_figures() -> None:
    """Section 12 reruns the same model with the released snapshots (9.1 s, 22.9 s, 3.74 s) and
    the rerun files (1.44 s, 4.9 s, 4.90 s): 1.5/3.7, 3.1/7.8 and 6.8/17.2 % at 0.25, 1 and 4
    reclaims per hour. Not part of the issue's tables; two of its six figures differ in the last
    digit on these rounded inputs (7.850 % and 6.746 %)."""
    published = {(0.25, "files"): 1.5, (0.25, "snapshots"): 3.7, (1.0, "files"): 3.1, (1.0, "snapshots"): 7.8,
                 (4.0, "files"): 6.8, (4.0, "snapshots"): 17.2}
    known = {(1.0, "snapshots"): (7.8, 7.9), (4.0, "files"): (6.8, 6.7)}
    costs = Costs(file_stall=1.44, file_lag=4.9, file_restore=4.90, snapshot_stall=9.1, snapshot_lag=22.9,
                  snapshot_restore=3.74)
    for (rate, name), value in published.items():
        s = {s.name: s for s in plan(costs, FailureMix(unannounced_per_hour=rate)).strategies}[name]
        assert pct(s.lost_share) == (known[(rate, name)][1] if (rate, name) in known else value), (rate, name)


# --- Table 12 (section 13) -------------------------------------------------------------------

# compressed seconds: notices every 300 s (all covered), a 4.79 s checkpoint, a 55.1 s cold
# start, a 4.8 s restore of the paired snapshot; arm B files every 60 s, arm C every 131 s
T12_NOTICE_EVERY, T12_STALL, T12_COLD, T12_RESTORE, T12_B, T12_C = 300.0, 4.79, 55.1, 4.8, 60.0, 131.0
# unannounced kill every (s) -> (lost % B, lost % C, C against B in points)
T12_PUBLISHED = {300: (33.0, 36.3, -3.4), 450: (24.6, 25.4, -0.8), 600: (20.5, 20.0, 0.5),
                 900: (16.3, 14.5, 1.8), 1800: (12.1, 9.1, 3.0), 3600: (10.1, 6.4, 3.7), 7200: (9.0, 5.0, 4.0)}
T12_BREAK_EVEN, T12_YOUNG_BREAK_EVEN = 534, 821
# (interval, arm) -> (published, the model on the published inputs): C at 900 s is 14.551 %, a
# thousandth of a point past the rounding boundary; the break-evens are 533.15 s and 820.46 s.
# A checkpoint of 4.786 s (which the text rounds to 4.79 s) gives all three as published.
T12_KNOWN: dict[tuple[int | str, str], tuple[float, float]] = {
    (900, "C"): (14.5, 14.6),
    ("break-even", "model"): (534, 533),
    ("break-even", "young"): (821, 820),
}


def _table12(stall: float) -> dict[tuple[int | str, str], float]:
    covered = 1.0 / T12_NOTICE_EVERY
    got: dict[tuple[int | str, str], float] = {}
    for every in T12_PUBLISHED:
        b = sum(notice_files_loss(T12_B, stall, 1.0 / every, covered, T12_RESTORE, T12_COLD).values())
        c = sum(notice_files_loss(T12_C, stall, 1.0 / every, covered, T12_RESTORE, T12_COLD).values())
        got[(every, "B")], got[(every, "C")], got[(every, "C-B")] = pct(b), pct(c), round(100 * (b - c), 1)
    got[("break-even", "model")] = round(break_even_interval(T12_B, T12_C, stall, covered, T12_RESTORE, T12_COLD))
    got[("break-even", "young")] = round(young_break_even(T12_B, T12_C, stall))
    return got


def _published12() -> dict[tuple[int | str, str], float]:
    cells: dict[tuple[int | str, str], float] = {}
    for every, (b, c, d) in T12_PUBLISHED.items():
        cells[(every, "B")], cells[(every, "C")], cells[(every, "C-B")] = b, c, d
    cells[("break-even", "model")] = T12_BREAK_EVEN
    cells[("break-even", "young")] = T12_YOUNG_BREAK_EVEN
    return cells


def test_table12_every_cell_and_the_break_evens_from_the_published_inputs() -> None:
    got, published = _table12(T12_STALL), _published12()
    assert len(published) == 23
    for cell, value in published.items():
        if cell in T12_KNOWN:
            assert T12_KNOWN[cell][0] == value, cell
            assert got[cell] == T12_KNOWN[cell][1] != value, cell  # the known difference, explicitly
        else:
            assert got[cell] == value, cell


def test_table12_every_cell_and_the_break_evens_from_a_checkpoint_inside_the_rounding() -> None:
    assert _table12(4.786) == _published12()


def test_table12_break_even_is_where_b_and_c_lose_the_same() -> None:
    covered = 1.0 / T12_NOTICE_EVERY
    m = break_even_interval(T12_B, T12_C, T12_STALL, covered, T12_RESTORE, T12_COLD)
    b = notice_files_loss(T12_B, T12_STALL, 1.0 / m, covered, T12_RESTORE, T12_COLD)
    c = notice_files_loss(T12_C, T12_STALL, 1.0 / m, covered, T12_RESTORE, T12_COLD)
    assert sum(b.values()) == pytest.approx(sum(c.values()))
    assert 1800 / m == pytest.approx(3.4, abs=0.05)  # "3.4 times the design rate"
    # plain Young/Daly: stall/T + (T/2)/M, no notices, no recovery
    y = young_break_even(T12_B, T12_C, T12_STALL)
    assert T12_STALL / T12_B + 30 / y == pytest.approx(T12_STALL / T12_C + 65.5 / y)


def test_section13_cadences() -> None:
    # C's 131 s: "the classic interval for the unannounced rate alone, from the 4.77 s checkpoint
    # ... and the 1800 s mean gap"; A's 60 s "is close to the 50 s the same rule gives when it
    # counts every failure"
    costs = Costs(file_stall=4.77, cold_start=55.1, snapshot_lag=15.0, snapshot_restore=4.8)
    mix = FailureMix(noticed_per_hour=12.0, unannounced_per_hour=2.0, lead=LeadTime.between(30.0, 120.0))
    by_name = {s.name: s for s in plan(costs, mix).strategies}
    assert round(by_name["notice+files"].period_s or 0) == 131
    assert round(by_name["files"].period_s or 0) == 50
    # real rates: a 1 minute write, one noticed reclaim an hour, one unannounced loss a day: 644 s
    # today, 3220 s from unannounced losses only; files plus redone work 9.7 % -> 3.7 % (plain
    # Young costs: stall/T + unannounced rate * T/2, the snapshot on notice assumed)
    today = young_period(60.0, 1 / 3600 + 1 / 86400)
    relaxed = young_period(60.0, 1 / 86400)
    assert (round(today), round(relaxed)) == (644, 3220)
    for t, share in ((today, 9.7), (relaxed, 3.7)):
        terms = periodic_loss(t, 60.0, 1 / 86400, 0.0, 0.0)
        assert pct(terms["stall"] + terms["lost_work"]) == share


# --- the model's pieces ----------------------------------------------------------------------


def test_newest_protection_limits() -> None:
    assert mean_age_of_newest_protection(60.0, 0.0) == 30.0  # no notices: Young's half period
    assert mean_age_of_newest_protection(math.inf, 1 / 300) == pytest.approx(300.0)  # no files: arm D
    assert mean_age_of_newest_protection(1e6, 1 / 300) == pytest.approx(300.0)
    # the series branch joins the closed form
    assert mean_age_of_newest_protection(60.0, 1e-9) == pytest.approx(30.0, rel=1e-6)
    assert mean_age_of_newest_protection(60.0, 1.01e-8) == pytest.approx(
        mean_age_of_newest_protection(60.0, 1.0e-8), rel=1e-6)
    q = math.exp(-60 / 300)
    assert mean_age_of_newest_protection(60.0, 1 / 300) == pytest.approx(300 - 60 * q / (1 - q))
    assert snapshot_newest_share(60.0, 1 / 300) == pytest.approx(1 - q)
    assert snapshot_newest_share(60.0, 0.0) == 0.0


def test_daly_refines_young() -> None:
    rate = 1 / 3600
    a = 12.9 / 7200
    assert daly_period(12.9, rate) == pytest.approx(math.sqrt(2 * 12.9 * 3600) * (1 + math.sqrt(a) / 3 + a / 9) - 12.9)
    assert daly_period(12.9, rate) == pytest.approx(296.2, abs=0.05)
    assert daly_period(10_000.0, rate) == 3600.0  # stall >= 2 MTBF: the MTBF
    assert young_period(1.0, 0.0) == daly_period(1.0, 0.0) == math.inf
    by_name = {s.name: s for s in plan(T7_COSTS, FailureMix(1.0, lead=LeadTime.fixed(60)), "daly").strategies}
    assert round(by_name["snapshots"].period_s or 0) == 296


def test_lead_time_and_coverage() -> None:
    assert LeadTime.between(30, 120).share_longer_than(75) == pytest.approx(0.5)
    assert LeadTime.between(30, 120).share_longer_than(20) == 1.0
    assert LeadTime.between(30, 120).share_longer_than(120) == 0.0
    assert LeadTime.fixed(31.9).share_longer_than(31.9) == 0.0  # covered only when the lead exceeds the lag
    assert LeadTime(points=((20, 1), (60, 3))).share_longer_than(30) == 0.75
    # noticed reclaims the snapshot cannot cover count with the unannounced ones for the cadence
    mix = FailureMix(noticed_per_hour=4.0, unannounced_per_hour=1.0, lead=LeadTime.between(30, 120))
    costs = Costs(file_stall=2.0, snapshot_lag=75.0, snapshot_restore=5.0)
    result = plan(costs, mix)
    assert result.covered_share == pytest.approx(0.5)
    by_name = {s.name: s for s in result.strategies}
    assert by_name["notice+files"].period_s == pytest.approx(young_period(2.0, 3.0 / 3600))
    assert by_name["files"].period_s == pytest.approx(young_period(2.0, 5.0 / 3600))
    assert by_name["notice+files"].breakdown["notices"] == pytest.approx(2.0 / 3600 * 80.0)
    assert "snapshots" in result.skipped
    assert result.best.lost_share == min(s.lost_share for s in result.strategies)


def test_no_covered_notice_leaves_the_notice_alone_unbounded() -> None:
    result = plan(Costs(file_stall=2.0, snapshot_lag=10.0, snapshot_restore=3.0), FailureMix(unannounced_per_hour=1.0))
    by_name = {s.name: s for s in result.strategies}
    assert by_name["notice"].bounded is False and by_name["notice"].lost_share == 1.0
    # without notices, notice + files is files at the unannounced rate
    assert by_name["notice+files"].lost_share == pytest.approx(by_name["files"].lost_share)
    json.dumps(result.to_dict(), allow_nan=False)


@pytest.mark.parametrize("make", [
    lambda: Costs(file_stall=-1.0),
    lambda: Costs(snapshot_lag=math.nan),
    lambda: Costs(cold_start=math.inf),
    lambda: FailureMix(noticed_per_hour=-1.0),
    lambda: FailureMix(noticed_per_hour=1.0),  # no lead
    lambda: LeadTime.between(60, 30),
    lambda: LeadTime(points=((30, 0),)),
    lambda: plan(Costs(file_stall=1.0), FailureMix()),  # no failures
    lambda: plan(Costs(file_restore=1.0), FailureMix(unannounced_per_hour=1.0)),  # no strategy
    lambda: costs_from_record({"ok": False, "reason": "CRIU_DUMP_FAILED"}),
    lambda: costs_from_record({"something": 1}),
    lambda: costs_from_record({"rows": [{"arm": "reference", "launch_to_first_step_s": 9.5}]}),
])
def test_bad_input_is_a_usage_error(make: Any) -> None:
    with pytest.raises(SnapguardError) as e:
        make()
    assert e.value.reason is Reason.USAGE_ERROR


def test_plan_imports_only_the_stdlib_and_reasons() -> None:
    package = REPO / "snapguard/plan"
    modules = {path.stem for path in package.glob("*.py")}
    imported: set[tuple[int, str | None]] = set()
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported |= {(n.level, n.module) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {(0, a.name) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    # within the package, its own modules; above it, snapguard.reasons alone
    assert {m for level, m in imported if level == 1} <= modules
    assert {m for level, m in imported if level > 1} == {"reasons"}
    assert all(m.split(".")[0] in sys.stdlib_module_names or m == "__future__"
               for level, m in imported if not level and m), imported


# --- the CLI ---------------------------------------------------------------------------------


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SNAPGUARD, "plan", *args], capture_output=True, text=True, timeout=60)


def run_json(*args: str) -> dict[str, Any]:
    out = run(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


T7_FLAGS = ("--file-stall", "1.36", "--file-lag", "3.4", "--file-restore", "4.77", "--snapshot-stall", "12.9",
            "--snapshot-lag", "31.9", "--snapshot-restore", "7.24", "--notice-downtime", "44")


@pytest.mark.parametrize("rate", sorted(T7_PUBLISHED))
def test_cli_table7(rate: float) -> None:
    doc = run_json(*T7_FLAGS, "--noticed-per-hour", str(rate), "--lead", "30-120")
    by_name = {s["name"]: s for s in doc["strategies"]}
    assert doc["covered_share"] == pytest.approx(1 - 1.9 / 90)  # leads of 30-31.9 s are too short
    for name, (lost, period) in T7_PUBLISHED[rate].items():
        if name == "notice":  # the uniform 30-120 s lead leaves 2 % of the notices uncovered
            continue
        published_period = T7_KNOWN.get((rate, name, "period"), (period, period))[1]
        assert pct(by_name[name]["lost_share"]) == lost
        assert round(by_name[name]["period_s"]) == published_period
    # all covered: the notice column exactly
    doc = run_json(*T7_FLAGS, "--noticed-per-hour", str(rate), "--lead", "120")
    by_name = {s["name"]: s for s in doc["strategies"]}
    assert pct(by_name["notice"]["lost_share"]) == T7_PUBLISHED[rate]["notice"][0]
    assert by_name["notice+files"]["period_s"] is None  # nothing uncovered: no periodic files needed
    assert doc["best"] == "notice+files"


def test_cli_table12_mix() -> None:
    doc = run_json("--file-stall", "4.77", "--cold-start", "55.1", "--snapshot-restore", "4.8", "--snapshot-lag", "15",
                   "--noticed-per-hour", "12", "--lead", "30-120", "--unannounced-per-hour", "2")
    by_name = {s["name"]: s for s in doc["strategies"]}
    assert round(by_name["notice+files"]["period_s"]) == 131 and round(by_name["files"]["period_s"]) == 50
    b = by_name["notice+files"]["breakdown"]
    assert pct(b["stall"] + b["lost_work"] + b["recovery"]) == 9.1  # Table 12, C at the design rate
    assert doc["best"] == "notice+files"
    assert doc["skipped"] == {"snapshots": "no snapshot stall (--snapshot-stall)"}


def test_cli_table_text() -> None:
    out = run(*T7_FLAGS, "--noticed-per-hour", "1", "--lead", "120")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "snapguard plan (Young): noticed 1/h, 100% covered (lead 120 s vs 31.9 s snapshot lag); " \
                       "unannounced 0/h"
    assert any("periodic file checkpoints" in l and "files every 99 s" in l and "3.0%" in l for l in lines)
    assert any("periodic snapshots" in l and "snapshots every 305 s" in l and "9.6%" in l for l in lines)
    assert any(l.strip().startswith("snapshot on notice ") and "1.2%" in l for l in lines)
    assert any("snapshot on notice + files" in l and "no files needed" in l and "<- best" in l for l in lines)


def test_cli_from_a_result_file(tmp_path: Path) -> None:
    ck = tmp_path / "ck.json"
    ck.write_text(json.dumps({"ok": True, "operation": "checkpoint", "leave_running": True,
                              "timings": {"preflight_s": 0.5, "take_s": 0.2, "cuda_suspend_s": 1.3, "dump_s": 3.0,
                                          "cuda_resume_s": 0.5, "seal_s": 0.3, "total_s": 5.8}}))
    rt = tmp_path / "rt.json"
    rt.write_text(json.dumps({"ok": True, "operation": "restore", "timings": {"restore_s": 3.0, "total_s": 3.5}}))
    doc = run_json("--from-result", str(ck), "--from-result", str(rt), "--file-stall", "1.2",
                   "--unannounced-per-hour", "1")
    assert doc["costs"] == {"file_stall": 1.2, "snapshot_stall": pytest.approx(5.0), "snapshot_lag": 5.8,
                            "snapshot_restore": 3.5}
    assert doc["sources"]["file_stall"] == "flag"
    assert doc["sources"]["snapshot_restore"] == f"{rt}: restore timings.total_s"
    # a flag wins over the file
    doc = run_json("--from-result", str(ck), "--snapshot-lag", "7", "--unannounced-per-hour", "1")
    assert doc["costs"]["snapshot_lag"] == 7.0 and doc["costs"]["snapshot_stall"] == pytest.approx(5.0)


def test_cli_from_the_torch_drill() -> None:
    rows = {r["arm"]: r for r in json.loads(DRILL.read_text())["rows"]}
    doc = run_json("--from-result", str(DRILL), "--noticed-per-hour", "1", "--lead", "30-120",
                   "--unannounced-per-hour", "0.25")
    assert doc["costs"] == {
        "snapshot_stall": rows["leave-running-trimmed"]["stall_s"],
        "snapshot_lag": rows["stop-trimmed"]["request_to_complete_image_s"],
        "snapshot_restore": rows["stop-trimmed"]["restore_to_first_new_step_s"],
        "file_stall": rows["file-checkpoint"]["stall_s"],
        "file_restore": rows["file-checkpoint"]["resume_to_first_new_step_s"],
    }
    assert doc["covered_share"] == 1.0  # a 4.8 s lag against 30-120 s of notice
    assert [s["name"] for s in doc["strategies"]] == ["files", "snapshots", "notice", "notice+files"]
    assert doc["best"] == "notice+files"
    values, sources = costs_from_record(json.loads(DRILL.read_text()))
    assert sources["snapshot_stall"] == "leave-running-trimmed stall_s"


@pytest.mark.parametrize("args", [
    ("--file-stall", "-1", "--unannounced-per-hour", "1"),
    ("--file-stall", "nan", "--unannounced-per-hour", "1"),
    ("--file-stall", "1", "--unannounced-per-hour", "-2"),
    ("--file-stall", "1"),  # no failures
    ("--unannounced-per-hour", "1"),  # no costs
    ("--file-stall", "1", "--noticed-per-hour", "1"),  # no lead
    ("--file-stall", "1", "--noticed-per-hour", "1", "--lead", "120-30"),
    ("--file-stall", "1", "--noticed-per-hour", "1", "--lead", "soon"),
    ("--from-result", "/nonexistent/snapguard-result.json", "--unannounced-per-hour", "1"),
    ("--from-result", str(REPO / "README.md"), "--unannounced-per-hour", "1"),
])
def test_cli_bad_input_is_one_typed_line(args: tuple[str, ...]) -> None:
    out = run(*args)
    assert out.returncode == 2, out
    assert out.stdout == ""
    assert out.stderr.startswith("snapguard USAGE_ERROR: ") and out.stderr.count("\n") == 1, out.stderr


def test_cli_failed_record_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "snapguard-result.json"
    bad.write_text(json.dumps({"ok": False, "reason": "CRIU_DUMP_FAILED", "detail": "x"}))
    out = run("--from-result", str(bad), "--unannounced-per-hour", "1")
    assert out.returncode == 2
    assert out.stderr == (f"snapguard USAGE_ERROR: --from-result {bad}: the record of a failed run "
                          "(CRIU_DUMP_FAILED): it measured no costs\n")


def test_cli_imports_plan_lazily() -> None:
    code = "import sys, snapguard.cli; print('snapguard.plan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
