"""Retries of a transient failure, with jittered exponential backoff, inside one deadline.

A metadata service that restarts, an API server behind a load balancer that drops a connection,
containerd coming back after an upgrade: one refused or reset exchange should not cost a poll.
`Backoff.wait(deadline)` sleeps "full jitter" (a uniform draw in [0, min(cap, base * 2**n)], as
AWS's architecture blog "Exponential Backoff And Jitter" recommends, so many nodes that lost one
peer together do not come back in step) and says whether another attempt fits: never past the
caller's deadline (the notice's, or the source's poll), never more than `attempts` retries.

This is a small helper rather than tenacity: the bound is the caller's own monotonic deadline,
shared with the exchange itself (an attempt gets what is left of it, not a fresh timeout), and
the node profile and the Debian package take no dependency for twenty lines.
"""

from __future__ import annotations

import random
import time
from typing import Callable, TypeVar

__all__ = ["Backoff", "retry"]

T = TypeVar("T")


class Backoff:
    """`wait(deadline)`: sleep the next jittered delay and return True when another attempt fits
    before `deadline` (time.monotonic()), with at least `min_attempt_s` left for it; else False
    at once, having slept nothing."""

    def __init__(self, base_s: float = 0.1, cap_s: float = 2.0, attempts: int = 4, min_attempt_s: float = 0.25,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.base_s, self.cap_s, self.attempts, self.min_attempt_s, self.sleep = base_s, cap_s, attempts, min_attempt_s, sleep
        self.retries = 0

    def wait(self, deadline: float) -> bool:
        if self.retries >= self.attempts:
            return False
        delay = random.uniform(0, min(self.cap_s, self.base_s * 2 ** self.retries))
        if time.monotonic() + delay + self.min_attempt_s > deadline:
            return False
        self.retries += 1
        self.sleep(delay)
        return True


def retry(attempt: Callable[[], T], deadline: float, transient: Callable[[Exception], bool],
          backoff: Backoff | None = None) -> T:
    """attempt() until it returns, retrying what `transient` accepts while the backoff fits
    before `deadline`; the last failure is raised as it was."""
    backoff = backoff or Backoff()
    while True:
        try:
            return attempt()
        except Exception as e:
            if not transient(e) or not backoff.wait(deadline):
                raise
