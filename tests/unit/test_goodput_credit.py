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
