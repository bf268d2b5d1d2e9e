"""The executor's CUDA step never waits on a process that cannot answer: a stopped process is
refused before any driver call, and a driver call that does not return ends at its deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from snapguard import gpu_suspend
from snapguard.reasons import Reason, SnapguardError


def test_a_stopped_process_is_refused_before_the_driver_is_asked() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert gpu_suspend.frozen(child.pid) is None
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while gpu_suspend.frozen(child.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(SnapguardError) as refused:
            gpu_suspend.suspend([child.pid], 60.0)  # no libcuda here: the refusal comes first
        assert time.monotonic() - t0 < 2
        assert refused.value.reason is Reason.WORKLOAD_FROZEN
        assert "stopped" in str(refused.value) and refused.value.failure.workload_intact
    finally:
        child.kill()
        child.wait()


def test_a_driver_call_that_never_returns_ends_at_its_deadline() -> None:
    """A call blocked in the kernel (a read of a pipe no one writes, as the driver's lock of a
    frozen process sat in anon_pipe_read) is abandoned at the deadline with CUDA_LOCK_TIMEOUT."""
    r, w = os.pipe()
    try:
        t0 = time.monotonic()
        with pytest.raises(SnapguardError) as stuck:
            gpu_suspend._within(lambda: os.read(r, 1) and None, 0.3, os.getpid(), "lock")
        assert 0.3 <= time.monotonic() - t0 < 2
        assert stuck.value.reason is Reason.CUDA_LOCK_TIMEOUT and "did not return within 0.3 s" in str(stuck.value)
        assert not stuck.value.failure.workload_intact
        gpu_suspend._within(lambda: None, 5.0, os.getpid(), "lock")  # one that returns is waited for
        with pytest.raises(OSError):
            gpu_suspend._within(lambda: os.close(-1), 5.0, os.getpid(), "lock")  # its error is the caller's
    finally:
        os.write(w, b"x")  # the abandoned thread's read returns
        os.close(w)
        time.sleep(0.05)
        os.close(r)
