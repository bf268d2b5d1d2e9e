"""The executor side of the take point: ask a workload to stop at a step boundary, then release it."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from ..reasons import Finding, Reason, Severity
from . import socket_path

__all__ = ["request", "release"]


def _ask(path: str, line: str, timeout: float) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(line.encode())
        f = s.makefile("rb")
        reply = f.readline()
        # Wait for the workload to close its end: a connection still open when CRIU freezes the
        # workload is an external socket that fails the dump.
        while f.read(4096):
            pass
    return json.loads(reply)


def request(take_dir: str, pid: int, wait_s: float) -> tuple[dict[str, Any] | None, Finding | None]:
    """(figures, None) when the workload held at a step boundary; (None, warning) otherwise."""
    path = socket_path(take_dir, pid)
    if not os.path.exists(path):
        return None, None  # no hook in this process: nothing to ask
    try:
        reply = _ask(path, f"take {wait_s}\n", wait_s + 5)
    except (OSError, ValueError) as e:
        reply = {"ok": False, "error": str(e)}
    if reply.get("ok"):
        return reply, None
    return None, Finding(Reason.TAKE_POINT_TIMEOUT,
                         f"pid {pid} did not reach a step boundary within {wait_s:g} s ({reply.get('error')})",
                         Severity.WARNING, {"pid": pid})


def release(take_dir: str, pid: int, timeout: float = 10.0) -> bool:
    try:
        return bool(_ask(socket_path(take_dir, pid), "release\n", timeout).get("ok"))
    except (OSError, ValueError):
        return False
