"""Every child and every blocking call has a deadline snapguard enforces: a tool that hangs (with
a grandchild holding its pipes) is killed with its whole process group; an NVML call that blocks
is abandoned with a typed reason."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from snapguard import children
from snapguard.preflight import _within
from snapguard.reasons import Reason, SnapguardError


@pytest.mark.timeout(30)
def test_probe_kills_the_whole_group_at_its_deadline(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    tool = tmp_path / "hangs"
    tool.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {pidfile}\nwait\n")
    os.chmod(tool, 0o700)
    t0 = time.monotonic()
    out = children.probe([str(tool), "--version"], timeout_s=1)
    assert isinstance(out, str) and "did not finish within 1 s and was killed" in out
    assert time.monotonic() - t0 < 15
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{grandchild}"), "the grandchild outlived its group's deadline"


def test_probe_says_why_a_tool_did_not_start(tmp_path: Path) -> None:
    out = children.probe([str(tmp_path / "absent"), "--version"], timeout_s=5)
    assert isinstance(out, str) and "did not start" in out and "\n" not in out


def test_run_deadline_is_typed(tmp_path: Path) -> None:
    with pytest.raises(children.ChildTimeout) as e:
        children.run(["/bin/sleep", "30"], timeout_s=0.5, what="criu dump", reason=Reason.CRIU_TIMEOUT)
    assert e.value.reason is Reason.CRIU_TIMEOUT and "criu dump did not finish within 0.5 s" in str(e.value)


@pytest.mark.timeout(10)
def test_a_blocking_call_is_abandoned_at_its_deadline() -> None:
    with pytest.raises(SnapguardError) as e:
        _within(0.3, "NVML (the GPU inventory)", lambda: time.sleep(60))
    assert e.value.reason is Reason.PREFLIGHT_FAILED and "did not answer within 0.3 s" in str(e.value)
    assert _within(5, "quick", lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        _within(5, "raises", lambda: 1 // 0)
