"""The goodput drill's credit for context parity (issue 14): an arm's window is extended by what the
parity of its cold starts took before the window's end, never by its first launch's, which every
run has (the uninterrupted one's too)."""

from __future__ import annotations

import pytest

from snapguard_lab.goodput import relaunch_parity_s


def stall(at: float, seconds: float) -> dict[str, float]:
    return {"pid": 1, "at": at, "seconds": seconds}


def test_first_launch_is_not_credited() -> None:
    assert relaunch_parity_s([stall(10.0, 3.3)], end=600.0) == 0.0
    assert relaunch_parity_s([], end=600.0) == 0.0


def test_cold_starts_are_credited() -> None:
    # the H200 run's arm A: 3.279 s at its first launch, 3.5 and 4.076 s after its two cold starts
    stalls = [stall(0.0, 3.279), stall(279.0, 3.5), stall(563.0, 4.076)]
    assert relaunch_parity_s(stalls, end=600.0) == pytest.approx(7.576)


def test_only_the_part_before_the_end_counts() -> None:
    stalls = [stall(0.0, 3.0), stall(598.0, 4.0), stall(601.0, 4.0)]
    assert relaunch_parity_s(stalls, end=600.0) == pytest.approx(2.0)
