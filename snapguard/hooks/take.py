"""The executor side of the take point: ask a workload to stop at a step boundary, then release it."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from ..reasons import Finding, Reason, Severity
from . import socket_path

__all__ = ["coordinated", "hooked", "request", "release", "status", "trainers"]


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


def hooked(take_dir: str, pids: list[int]) -> list[int]:
    """The pids that run the take-point hook (have a socket)."""
    return [p for p in pids if os.path.exists(socket_path(take_dir, p))]


def trainers(take_dir: str, pids: list[int]) -> dict[int, dict[str, Any]]:
    """{pid: status} of the hooked pids that train (their step hook is registered); a launcher
    that runs the hook but no optimizer is not one to wait for."""
    found = {}
    for pid in hooked(take_dir, pids):
        try:
            st = status(take_dir, pid)
        except (OSError, ValueError):
            continue
        if st.get("trainer"):
            found[pid] = st
    return found


def status(take_dir: str, pid: int, timeout: float = 5.0) -> dict[str, Any]:
    return _ask(socket_path(take_dir, pid), "status\n", timeout)


def coordinated(take_dir: str, pids: list[int], wait_s: float) -> tuple[dict[int, Any], str | None]:
    """Bring every rank to the end of one common optimizer step and hold them all there.

    The step is two past the furthest rank's: a rank that finishes its step while the request is
    on its way still stops at the common one, and none is left inside a collective that waits for
    a held peer. Returns ({pid: figures}, None), or ({pid: figures of those held}, why not).
    """
    import threading

    try:
        steps = {pid: int(status(take_dir, pid)["step"]) for pid in pids}
    except (OSError, ValueError, KeyError) as e:
        return {}, f"status: {e}"
    target = max(steps.values()) + 2
    replies: dict[int, dict[str, Any]] = {}

    def ask(pid: int) -> None:
        try:
            replies[pid] = _ask(socket_path(take_dir, pid), f"take-at {target} {wait_s}\n", wait_s + 5)
        except (OSError, ValueError) as e:
            replies[pid] = {"ok": False, "error": str(e)}

    threads = [threading.Thread(target=ask, args=(pid,)) for pid in pids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = {pid: r for pid, r in replies.items() if r.get("ok")}
    failed = {pid: r.get("error") for pid, r in replies.items() if not r.get("ok")}
    return held, (f"step {target}: {failed}" if failed else None)


def release(take_dir: str, pid: int, timeout: float = 10.0) -> bool:
    try:
        return bool(_ask(socket_path(take_dir, pid), "release\n", timeout).get("ok"))
    except (OSError, ValueError):
        return False
