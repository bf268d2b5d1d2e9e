"""Every child snapguard starts runs under a deadline snapguard enforces.

A child (runc, CRIU, cuda-checkpoint) starts in a process group of its own; when its deadline
passes the whole group is killed (runc's CRIU and CRIU's helpers with it) and the caller gets a
typed reason, so the executor, and containerd's task with it, never hangs.

A child given no environment gets the executor's, less the entry that names a cuda-checkpoint
broker (snapguard.wire.BROKER_ENV): the CRIU run a broker serves is told of it by the environment
its caller builds; a child started here with snapguard's own (a `cuda-checkpoint -h` probe, ctr)
never inherits one.

Every child dies with the executor: it is started with a parent-death signal (SIGKILL, from
PR_SET_PDEATHSIG; it fires when the thread that started it ends, and `run` and `run_captured`
wait in that thread), so a killed `snapguard-runc` leaves no runc or CRIU behind it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping

from .reasons import Reason, SnapguardError
from .wire import BROKER_ENV

__all__ = ["ChildTimeout", "probe", "run", "run_captured"]


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork: the child only calls it


def _dies_with(parent: int) -> Callable[[], None]:
    """The child's step before exec: SIGKILL when its parent thread ends; and, when the parent is
    already gone (it died before the signal was set), exit at once."""
    def die_with_parent() -> None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(127)
    return die_with_parent


class ChildTimeout(SnapguardError):
    """The child outlived its deadline and its process group was killed."""


def _kill_group(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass  # unkillable (D state): the deadline still ends our wait


def _environment(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return env if env is not None else {k: v for k, v in os.environ.items() if k != BROKER_ENV}


def _start_error(argv: list[str], what: str, e: OSError, reason: Reason) -> SnapguardError:
    return SnapguardError(reason, f"{what}: {argv[0]} did not start: {e.strerror or e}",
                          evidence={"argv0": argv[0], "errno": e.errno})


def run(argv: list[str], *, timeout_s: float, what: str, reason: Reason, env: Mapping[str, str] | None = None,
        inherit_fds: bool = False, start_reason: Reason | None = None,
        pointless: Callable[[], str | None] | None = None, pointless_reason: Reason | None = None,
        grace_s: float = 10.0) -> int:
    """Run argv (stdio inherited) to completion within timeout_s; its exit status.
    `inherit_fds`: containerd hands runc the container's stdio and sockets by fd inheritance.
    `pointless()`, asked a few times a second, says why waiting on has stopped making sense (the
    workload a dump works on died): the child gets `grace_s` more to end by itself, as it may be
    finishing (CRIU ends a stopped dump's tree itself), then its group is killed and the caller
    gets `pointless_reason` with that why."""
    try:
        proc = subprocess.Popen(argv, env=_environment(env), close_fds=not inherit_fds, process_group=0,
                                stdin=None if inherit_fds else subprocess.DEVNULL, preexec_fn=_dies_with(os.getpid()))
    except OSError as e:
        raise _start_error(argv, what, e, start_reason or reason) from None
    deadline = time.monotonic() + timeout_s
    why: tuple[float, str] | None = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(argv, timeout_s)
            try:
                return proc.wait(timeout=left if pointless is None else min(left, 0.25))
            except subprocess.TimeoutExpired:
                if pointless is None or time.monotonic() >= deadline:
                    raise
            if why is None:
                said = pointless()
                why = (time.monotonic(), said) if said else None
            elif time.monotonic() - why[0] >= grace_s:
                _kill_group(proc)
                raise SnapguardError(pointless_reason or reason, f"{what}: {why[1]}, and it did not end within "
                                     f"{grace_s:g} s of that: killed", evidence={"argv0": argv[0]})
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ChildTimeout(reason, f"{what} did not finish within {timeout_s:g} s and was killed",
                           evidence={"argv0": argv[0], "timeout_s": timeout_s}) from None
    except BaseException:
        _kill_group(proc)
        raise


def run_captured(argv: list[str], *, timeout_s: float, what: str, reason: Reason,
                 env: Mapping[str, str] | None = None,
                 start_reason: Reason | None = None) -> subprocess.CompletedProcess[str]:
    """Run argv with its output captured (text, undecodable bytes replaced) within timeout_s."""
    try:
        proc = subprocess.Popen(argv, env=_environment(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", process_group=0,
                                preexec_fn=_dies_with(os.getpid()))
    except OSError as e:
        raise _start_error(argv, what, e, start_reason or reason) from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ChildTimeout(reason, f"{what} did not finish within {timeout_s:g} s and was killed",
                           evidence={"argv0": argv[0], "timeout_s": timeout_s}) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def probe(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | str:
    """Ask a tool something (`--version`, `check`, `-h`) under a deadline: its completed run, or one
    line saying why it did not answer (did not start, killed at the deadline with its group)."""
    what = " ".join(argv[:1] + [a for a in argv[1:2]])
    try:
        return run_captured(argv, timeout_s=timeout_s, what=f"`{what}`", reason=Reason.INTERNAL_ERROR)
    except SnapguardError as e:
        return e.failure.detail
