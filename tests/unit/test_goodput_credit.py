"""The goodput drill's credit for context parity (issue 14): an arm is credited the steps its own
pace makes in the time the parity of its cold starts took, never for its first launch's, which
every run has (the uninterrupted one's too)."""

from __future__ import annotations

import pytest

from snapguard_lab.goodput import credit_steps, relaunch_parity_s


def stall(at: float, seconds: float) -> dict[str, float]:
    return {"pid": 1, "at": at, "seconds": seconds}


def test_first_launch_is_not_credited() -> None:
    assert relaunch_parity_s([stall(10.0, 3.3)], end=600.0) == 0.0
    assert relaunch_parity_s([], end=600.0) == 0.0


def test_cold_starts_are_credited() -> None:
    # the H200 run's arm A: 3.279 s at its first launch, 3.5 and 4.076 s after its two cold starts
    stalls = [stall(0.0, 3.279), stall(279.0, 3.5), stall(563.0, 4.076)]
    assert relaunch_parity_s(stalls, end=600.0) == pytest.approx(7.576)
    assert credit_steps(7.576, 0.11382) == 67  # A's median step in that run


def test_a_stall_begun_before_the_end_counts_whole() -> None:
    # frozen from 598 s to 602 s: without it the trainer would have stepped from 598 s to the end
    stalls = [stall(0.0, 3.0), stall(598.0, 4.0), stall(601.0, 4.0)]
    assert relaunch_parity_s(stalls, end=600.0) == pytest.approx(4.0)


def test_no_credit_without_a_pace() -> None:
    assert credit_steps(0.0, 0.1) == 0
    assert credit_steps(5.0, None) == 0


def test_down_intervals_from_an_arms_events() -> None:
    from snapguard_lab.goodput import down_intervals

    # the H200 run's arm A (cold start after the machine went) and D (snapshot on notice)
    a = {"first_step_time": 1000.0, "events": [{"handled_s": 180.681, "kill_s": 264.919,
                                                "kill_to_first_new_step_s": 14.027,
                                                "notice_to_first_new_step_s": 98.265}]}
    d = {"first_step_time": 1000.0, "events": [{"handled_s": 180.681, "notice_to_first_new_step_s": 12.439,
                                                "snapshot": {"notice_to_freeze_s": 0.138}}]}
    assert down_intervals(a) == [(pytest.approx(1264.919), pytest.approx(1278.946))]
    assert down_intervals(d) == [(pytest.approx(1180.819), pytest.approx(1193.12))]
    assert down_intervals({"first_step_time": 0.0, "events": [{"handled_s": 5.0, "outcome": "absorbed"}]}) == []


def test_pace_while_arms_down() -> None:
    from snapguard_lab.goodput import pace_while_arms_down

    # a step every 0.5 s, every 0.25 s while an arm is down (two overlapping spans: 20-30 s)
    times = [i * 0.5 for i in range(1, 41)] + [20 + i * 0.25 for i in range(1, 41)] + \
        [30 + i * 0.5 for i in range(1, 61)]
    rows = [(n, "x", t) for n, t in enumerate(times)]
    pace = pace_while_arms_down(rows, 0.0, 60.0, [(20.0, 26.0), (24.0, 30.0), (70.0, 80.0)])
    assert pace["seconds_any_arm_down"] == pytest.approx(10.0)
    assert pace["steps_per_s_any_arm_down"] == pytest.approx(4.0)
    assert pace["steps_per_s_no_arm_down"] == pytest.approx(2.0)
    assert pace_while_arms_down(rows, 0.0, 60.0, [])["steps_per_s_any_arm_down"] is None


def test_steps_at_shared_pace() -> None:
    """The H200 run of seed 7: 53.61 s with an arm down at 13.151 steps/s, 8.869 otherwise; 5552
    steps in the window, 230 of them the GPU the arms left it."""
    from snapguard_lab.goodput import steps_at_shared_pace

    pace = {"seconds_any_arm_down": 53.61, "steps_per_s_any_arm_down": 13.151, "steps_per_s_no_arm_down": 8.869}
    assert steps_at_shared_pace(5552, pace) == 5552 - 230
    assert steps_at_shared_pace(5552, None) is None  # sequential: no pace
    assert steps_at_shared_pace(5552, {**pace, "steps_per_s_any_arm_down": None}) is None  # no arm down
    assert steps_at_shared_pace(5552, {**pace, "steps_per_s_any_arm_down": 8.0}) is None  # not faster


def test_the_h200_runs_at_shared_pace() -> None:
    """The two H200 drills of run 7 (their JSON predates these fields): what the README quotes."""
    import json
    from pathlib import Path

    from snapguard_lab.goodput import at_shared_pace

    results = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200x2"
    for name, steps, want in (("goodput-credit-s7-2026-11-30.json", 5322,
                               {"A": (0.854, 1.4), "B": (0.961, 1.6), "C": (0.955, 1.0), "D": (0.980, 1.4)}),
                              ("goodput-kill-s28-2026-11-30.json", 5360,
                               {"A": (0.739, -3.5), "B": (0.835, -4.5), "C": (0.855, -2.3), "D": (0.596, 14.1)})):
        report = json.loads((results / name).read_text())
        arms = report["arms"]
        assert at_shared_pace(arms, report["reference"]["steps_in_window"], report["reference"]["pace"]) == steps
        got = {k: (round(a["goodput_at_shared_pace"], 3), round(a["difference_points_at_shared_pace"], 1))
               for k, a in arms.items()}
        assert got == want
