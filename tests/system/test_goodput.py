"""The goodput drill's machinery on the CPU (issue 14, item 3): a short seeded reclaim schedule
replayed against the real trainer (small model) for arms A-D, through the real agent, a file://
store, CRIU and restore_from, every logged step compared with the uninterrupted run's loss bits.

Two runs at a time, one a core of this machine's 2 (the uninterrupted one and arm A, then each
arm as another ends; `--concurrent`, all at once with the pace beside arms standing still measured,
is for the GPU): the goodput figures of a 15 s window mean little, what is checked is that every
arm met its events and recovered as its rule says, and that no step's loss differs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from snapguard_lab.goodput import make_schedule, run_goodput_drill, shape_with

pytest.importorskip("torch")  # in the test extra: a skip here means the install is broken

SMALL_CPU = ("--device", "cpu", "--width", "48", "--layers", "1", "--batch", "1")
# compressed 40 times: a 15 s window, notices every 7.5 s with 8-12 s of lead (a snapshot of the
# small trainer is whole in 2-4 s here, restored and stepping 4-5 s after its notice), unannounced
# kills every 15 s, files every 3 s. Seed 115: a notice at 2.1 s (lead 11.8 s) and an unannounced
# kill at 11.4 s, before A's reclaim and 5 s after the snapshot arms' restores (many of C's files
# later), 3.6 s before the window ends (a cold start steps again 2-3 s after its kill here)
SEED, COMPRESS = 115, 40.0
SHAPE = shape_with(window_s=600, lead_lo_s=320, lead_hi_s=480, unannounced_every_s=600, file_every_s=120)


def test_schedule_is_seeded_and_scaled() -> None:
    a, b = make_schedule(SEED, SHAPE.scaled(COMPRESS)), make_schedule(SEED, SHAPE.scaled(COMPRESS))
    assert a == b and [e.kind for e in a] == ["notice", "unannounced"]
    assert all(0 <= e.t < 15 for e in a) and all(8 <= e.lead <= 12 for e in a if e.kind == "notice")
    assert make_schedule(SEED + 1, SHAPE.scaled(COMPRESS)) != a
    # the reference's shape, uncompressed: about 5 notices and 1 unannounced kill in 1500 s
    ref = [make_schedule(s, shape_with()) for s in range(1, 41)]
    notices = sum(1 for sched in ref for e in sched if e.kind == "notice") / len(ref)
    assert 3.5 < notices < 6.5 and all(30 <= e.lead <= 120 for s in ref for e in s if e.kind == "notice")


@pytest.mark.stack
def test_goodput_drill_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() != 0:
        pytest.fail("the goodput drill needs root (CRIU, the agent)")
    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("SNAPGUARD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("SNAPGUARD_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "goodput.json"
    rc = run_goodput_drill(str(tmp_path / "work"), seed=SEED, compress=COMPRESS, shape=SHAPE,
                           trainer_args=SMALL_CPU, concurrent=False, parallel=2, json_path=str(out))
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == 0 and report["ok"], printed

    # JSON shape
    assert {"seed", "compress", "concurrent", "shape_reference_s", "shape_s", "schedule", "calibration",
            "cadence_c_s", "planner_inputs", "reference", "arms"} <= set(report)
    assert report["shape_s"]["window_s"] == pytest.approx(15.0) and report["shape_s"]["file_every_s"] == 3.0
    schedule = report["schedule"]
    assert [e["kind"] for e in schedule] == ["notice", "unannounced"]
    cal = report["calibration"]
    assert cal["file_stall_s"] > 0 and cal["cold_start_s"] > 0 and cal["snapshot_lag_s"] > 0
    assert cal["bits"]["bit_identical"]
    assert set(report["planner_inputs"]["costs"]) >= {"file_stall_s", "cold_start_s", "snapshot_lag_s",
                                                      "snapshot_restore_s", "notice_downtime_s"}
    assert report["reference"]["steps_in_window"] > 20
    # its pace beside arms standing still is measured only when they share its time (--concurrent;
    # tests/unit/test_goodput_credit.py has the arithmetic)
    assert report["reference"]["pace"] is None and report["reference"]["steps_at_shared_pace"] is None
    assert not any("goodput_at_shared_pace" in a for a in report["arms"].values())
    arms = report["arms"]
    assert set(arms) == {"A", "B", "C", "D"}
    # C's cadence is the planner's (set from the calibrated costs), D writes none, A and B every 3 s
    assert arms["C"]["file_every_s"] == report["cadence_c_s"] > 0 and arms["D"]["file_every_s"] is None
    assert arms["A"]["file_every_s"] == arms["B"]["file_every_s"] == 3.0

    for name, arm in arms.items():
        assert not arm.get("failed"), (name, arm.get("failure"))
        # every scheduled event met, each with how training went on and what it cost
        assert arm["ran_all_events"] and arm["events"], name
        assert [e["id"] for e in arm["events"] + arm["events_after_window"]] == [e["id"] for e in schedule], name
        for e in arm["events"]:
            if e["outcome"] != "overtaken":
                assert e["steps_lost"] >= 0 and e["first_new_step"] == e["resumed_from_step"] + 1, (name, e)
        # every logged step, replays included, has the uninterrupted run's loss bits
        bits = arm["bits"]
        assert bits["bit_identical"] and bits["rows_compared"] == bits["rows_logged"] > 10, (name, bits)
        # at most what the arm could make at its own pace: the arms run two at a time on a
        # shared CPU, most against a reference run at another time, and one that got more of the
        # CPU than the reference did steps faster than it (1.02 once, with a benchmark beside it);
        # one step of slack for counting whole steps at the window's end
        ref = report["reference"]
        own_pace = ref["step_time_s"] / arm["step_time_s"] if arm.get("step_time_s") else 1.0
        assert 0 < arm["goodput"] <= max(1.0, own_pace) * (1 + 1 / ref["steps_in_window"]), \
            (name, arm["goodput"], own_pace)
        assert 0 <= arm["predicted_goodput"] <= 1, name
        assert arm["difference_points"] == pytest.approx(100 * (arm["goodput"] - arm["predicted_goodput"]))
        assert arm["steps_lost_per_event"] == [e.get("steps_lost") for e in arm["events"]]
        # no context parity on the CPU, so no step is credited
        assert arm["parity_credit_s"] == 0 and arm["parity_credit_steps"] == 0 and arm["context_parity"] == [], name
        assert arm["goodput_uncredited"] == arm["goodput"], name

    # notice -> urgent file (A, B, C) -> the agent's stopping snapshot, whole in the store before
    # the lead ran out -> restore_from on the "replacement": nothing lost
    for name in "BCD":
        (notice,) = [e for e in arms[name]["events"] if e["kind"] == "notice"]
        assert notice["outcome"] == "restored" and notice["steps_lost"] == 0, (name, notice)
        assert notice["snapshot"]["spare_lead_s"] > 0 and notice["snapshot"]["bytes"] > 0
        assert notice["notice_to_first_new_step_s"] > notice["restore_to_first_new_step_s"] > 0
        assert ("urgent_file" in notice) == (name != "D")
    (a_notice,) = [e for e in arms["A"]["events"] if e["kind"] == "notice"]
    assert "urgent_file" in a_notice and a_notice["outcome"] in ("cold start from file", "overtaken")

    # the last unannounced kill: D goes back to its notice's snapshot, C only to its newest file
    d_kill, c_kill = arms["D"]["events"][-1], arms["C"]["events"][-1]
    assert d_kill["outcome"] == "restored paired snapshot" and c_kill["outcome"] == "cold start from file"
    assert d_kill["steps_lost"] > c_kill["steps_lost"], (d_kill, c_kill)

    assert "goodput drill:" in printed and "PASS" in printed
    for name in "ABCD":
        assert f"\n{name} " in printed  # a table row per arm
    # nothing of the drill keeps running
    work = str(tmp_path / "work")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert work.encode() not in cmdline, (pid, cmdline[:200])


def test_context_parity_applies_to_cuda_trainers_only() -> None:
    from snapguard_lab.goodput import _on_cpu

    assert _on_cpu(("--device", "cpu", "--width", "48"))
    assert _on_cpu(("--width", "48", "--device=cpu"))
    assert not _on_cpu(("--device", "cuda"))
    assert not _on_cpu(("--width", "48", "--device"))
    assert not _on_cpu(())
