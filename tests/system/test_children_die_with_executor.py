"""A killed executor ends what it started: a stand-in executor (a real Python process) runs a real
child through snapguard.children, is killed with SIGKILL, and the child (in a process group of its
own, so no group kill reaches it) is gone within a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EXECUTOR = """
from snapguard import children
from snapguard.reasons import Reason
children.run(["/bin/sleep", "60"], timeout_s=60, what="a stand-in child", reason=Reason.INTERNAL_ERROR)
"""


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_child_dies_with_its_killed_executor() -> None:
    executor = subprocess.Popen([sys.executable, "-c", EXECUTOR], cwd=str(Path(__file__).resolve().parents[2]))
    child = None
    try:
        deadline = time.monotonic() + 20
        while child is None:
            assert time.monotonic() < deadline and executor.poll() is None, "the stand-in did not start its child"
            kids = _children(executor.pid)
            child = kids[0] if kids else None
            time.sleep(0.02)
        time.sleep(0.2)  # exec'd
        os.kill(executor.pid, signal.SIGKILL)
        executor.wait()
        deadline = time.monotonic() + 1.0
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child), f"child {child} outlived its killed executor"
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
        if executor.poll() is None:
            executor.kill()
