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


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "no-pidfd"])
def test_run_returns_the_status_and_keeps_its_deadline(pidfd: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait ends on the child's pidfd; where the kernel (or a seccomp filter) refuses one, on
    Popen's own wait: the same status and the same deadline either way."""
    opened: list[int] = []
    real = os.pidfd_open

    def pidfd_open(pid: int, flags: int = 0) -> int:
        if not pidfd:
            raise OSError(38, "Function not implemented")
        opened.append(pid)
        return real(pid, flags)

    monkeypatch.setattr(children.os, "pidfd_open", pidfd_open)
    assert children.run(["/bin/sh", "-c", "exit 7"], timeout_s=10, what="t", reason=Reason.CRIU_DUMP_FAILED) == 7
    assert children.run(["/bin/true"], timeout_s=10, what="t", reason=Reason.CRIU_DUMP_FAILED) == 0
    with pytest.raises(children.ChildTimeout):
        children.run(["/bin/sleep", "30"], timeout_s=0.3, what="t", reason=Reason.CRIU_TIMEOUT)
    assert len(opened) == (3 if pidfd else 0)
    fds = set(os.listdir("/proc/self/fd"))
    children.run(["/bin/true"], timeout_s=10, what="t", reason=Reason.CRIU_DUMP_FAILED)
    assert set(os.listdir("/proc/self/fd")) == fds, "a pidfd was left open"


@pytest.mark.timeout(30)
def test_a_pointless_wait_ends_after_its_grace(tmp_path: Path) -> None:
    """`pointless()` says waiting stopped making sense: the child gets its grace, then its group is
    killed and the caller gets `pointless_reason` with the why."""
    asked: list[float] = []

    def pointless() -> str | None:
        asked.append(time.monotonic())
        return "the workload died" if len(asked) >= 2 else None

    with pytest.raises(SnapguardError) as e:
        children.run(["/bin/sleep", "30"], timeout_s=25, what="criu dump", reason=Reason.CRIU_DUMP_FAILED,
                     pointless=pointless, pointless_reason=Reason.PROCESS_NOT_FOUND, grace_s=0.5)
    assert e.value.reason is Reason.PROCESS_NOT_FOUND
    assert "criu dump: the workload died, and it did not end within 0.5 s of that: killed" in str(e.value)
    assert not isinstance(e.value, children.ChildTimeout)
    # a child that ends by itself within the grace is waited for, its status returned
    asked.clear()
    assert children.run(["/bin/sh", "-c", "sleep 0.6; exit 3"], timeout_s=25, what="criu dump",
                        reason=Reason.CRIU_DUMP_FAILED, pointless=pointless, pointless_reason=Reason.PROCESS_NOT_FOUND,
                        grace_s=20) == 3


@pytest.mark.timeout(10)
def test_a_blocking_call_is_abandoned_at_its_deadline() -> None:
    with pytest.raises(SnapguardError) as e:
        _within(0.3, "NVML (the GPU inventory)", lambda: time.sleep(60))
    assert e.value.reason is Reason.PREFLIGHT_FAILED and "did not answer within 0.3 s" in str(e.value)
    assert _within(5, "quick", lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        _within(5, "raises", lambda: 1 // 0)
