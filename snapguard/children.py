"""Every child snapguard starts runs under a deadline snapguard enforces.

A child (runc, CRIU, cuda-checkpoint) starts in a process group of its own; when its deadline
passes the whole group is killed (runc's CRIU and CRIU's helpers with it) and the caller gets a
typed reason, so the executor, and containerd's task with it, never hangs.

A child given no environment gets the executor's, less the entry that names a cuda-checkpoint
broker (snapguard.wire.BROKER_ENV): the CRIU run a broker serves is told of it by the environment
its caller builds; a child started here with snapguard's own (a `cuda-checkpoint -h` probe, ctr)
never inherits one.

Every child dies with the executor, and what it started with it. The child itself gets a
parent-death signal (SIGKILL, from PR_SET_PDEATHSIG; it fires when the thread that started it
ends, and `run` and `run_captured` wait in that thread). What the child starts (runc's CRIU, which
goes on dumping for seconds after its runc is gone, and CRIU's helpers) stays in the child's
process group, and a watchdog ends that group: one small process per executor (this interpreter,
`-I -S`, stdlib only, in a group of its own) that holds the read end of a pipe only the executor
writes to. The executor tells it each group it starts and each that ended; when the pipe closes
without a goodbye (the executor was killed) it SIGKILLs every group still open, at once.

Where the watchdog cannot act (it was killed with the executor, the machine's OOM killer took
both), the next run clears what was left: with `keep_records(dir)` (the pipeline's, the state
directory's `children`), each group started is recorded there (pgid, its leader's start time, the
executor's pid and start time, the boot) until it ends, and `sweep(dir)` SIGKILLs every recorded
group whose executor is gone and that still runs: its leader by pid and start time, or, with the
leader gone, the group that still holds its number (a number is never given out again while a
group holds it, and a group made anew has its leader).

A container's cgroup freezer is put back the same way. CRIU freezes a container for its dump
and the executor thaws a paused one for the take point; an executor killed in between would
leave it frozen (or running where containerd's shim holds it paused). `freezer_put_back` names
the freezer's control file and the value it had: the watchdog writes the value back once it has
ended the groups, and removes the freezer's record, which snapguard.runc keeps beside the
groups' so that a later run puts it back where the watchdog died too.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import procfs
from .files import write_atomic
from .reasons import Reason, SnapguardError
from .wire import BROKER_ENV

__all__ = ["FREEZER_PREFIX", "ChildTimeout", "freezer_kept", "freezer_put_back", "keep_records", "probe", "read_record",
           "records", "run", "run_captured", "sweep"]


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork: the child only calls it


# Each child leads its own process group: Popen's process_group=0 from Python 3.11; on 3.10 the
# same setpgid(0, 0), made by the child's step before exec.
_OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {}


def _dies_with(parent: int) -> Callable[[], None]:
    """The child's step before exec: SIGKILL when its parent thread ends; and, when the parent is
    already gone (it died before the signal was set), exit at once."""
    def die_with_parent() -> None:
        if not _OWN_GROUP:
            os.setpgid(0, 0)
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(127)
    return die_with_parent


# The watchdog: lines "+PGID" and "-PGID" on its stdin-less pipe, "=CONTROL\tVALUE\tRECORD" and
# "~CONTROL" for a freezer to put back; "." is the goodbye. At EOF without it, every group still
# open is SIGKILLed, then each freezer gets its value back and its record goes.
_WATCHDOG = """
import os, signal, sys
fd, groups, buf, freezers = int(sys.argv[1]), set(), b"", {}
while True:
    try:
        chunk = os.read(fd, 4096)
    except InterruptedError:
        continue
    except OSError:
        chunk = b""
    if not chunk:
        break
    buf += chunk
    *lines, buf = buf.split(b"\\n")
    for line in lines:
        if line == b".":
            sys.exit(0)
        if line[:1] == b"+":
            groups.add(int(line[1:]))
        elif line[:1] == b"-":
            groups.discard(int(line[1:]))
        elif line[:1] == b"=" and line.count(b"\\t") == 2:
            control, value, record = line[1:].split(b"\\t")
            freezers[control] = (value, record)
        elif line[:1] == b"~":
            freezers.pop(line[1:], None)
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
for control, (value, record) in freezers.items():
    try:
        out = os.open(control, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(out, value)
        finally:
            os.close(out)
        if record:
            os.unlink(record)
    except OSError:
        pass
"""


class _Watchdog:
    """The executor's one watchdog, started with the first child (see the module's docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = 0  # the executor the watchdog serves (a forked child must start its own)
        self.fd = -1
        self.proc: subprocess.Popen[bytes] | None = None

    def _say(self, line: str) -> None:
        with self.lock:
            if self.pid != os.getpid():
                r, w = os.pipe()  # both ends close-on-exec: no child of ours but the watchdog holds one
                try:
                    self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(r)], pass_fds=(r,),
                                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                 env={}, **(_OWN_GROUP or {"preexec_fn": os.setpgrp}))
                except (OSError, subprocess.SubprocessError, ValueError):
                    os.close(w)
                    return  # no watchdog: the records and the next run's sweep remain
                finally:
                    os.close(r)
                self.pid, self.fd = os.getpid(), w
            try:
                os.write(self.fd, f"{line}\n".encode())
            except OSError:
                pass

    def started(self, pgid: int) -> None:
        self._say(f"+{pgid}")

    def ended(self, pgid: int) -> None:
        self._say(f"-{pgid}")

    def freezer(self, control: str, value: str, record: str) -> None:
        self._say(f"={control}\t{value}\t{record}")

    def freezer_kept(self, control: str) -> None:
        self._say(f"~{control}")


_watchdog = _Watchdog()
_records: str | None = None


def keep_records(directory: str | None) -> None:
    """Record each child's group in `directory` (root's alone; the caller made it) while it runs,
    for `sweep` to find if this executor and its watchdog die together; None: keep none."""
    global _records
    _records = directory


def _record_name(pgid: int, start: int) -> str:
    return f"{pgid}-{start}.json"


def _record(pgid: int) -> str | None:
    directory = _records
    start = procfs.start_ticks(pgid)
    if directory is None or start is None:
        return None
    name = os.path.join(directory, _record_name(pgid, start))
    try:
        write_atomic(name, json.dumps({"pgid": pgid, "start": start, "executor": os.getpid(),
                                       "executor_start": procfs.start_ticks(os.getpid()),
                                       "boot": procfs.boot_id()}).encode())
    except OSError:
        return None
    return name


def _forget(name: str | None) -> None:
    if name is not None:
        try:
            os.unlink(name)
        except OSError:
            pass


def _group_left(rec: dict[str, Any]) -> bool:
    """Whether the recorded group still runs as the one recorded (see the module's docstring)."""
    pgid = rec["pgid"]
    leader = procfs.start_ticks(pgid)
    if leader is not None:
        return leader == rec["start"]
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


FREEZER_PREFIX = "freezer-"  # a freezer's record (snapguard.runc's): its name begins so


def records() -> str | None:
    """The directory `keep_records` named (None: none kept)."""
    return _records


def freezer_put_back(control: str, value: str, record: str | None) -> None:
    """Should this executor die, the watchdog writes `value` into the freezer's `control` file
    (once it has ended the groups) and removes `record` (see the module's docstring)."""
    if any(c in control + value + (record or "") for c in "\t\n\0"):
        raise ValueError(f"a freezer's control file, value or record with a tab or newline: {control!r}")
    _watchdog.freezer(control, value, record or "")


def freezer_kept(control: str) -> None:
    """The freezer is as it was again (or its container is gone): nothing to put back."""
    _watchdog.freezer_kept(control)


def read_record(path: str, ids: tuple[str, ...]) -> dict[str, Any] | None:
    """A record's body (a link is not followed), None unless it is a JSON object whose `ids` are
    positive ints."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            rec = json.loads(os.read(fd, 4096))
        finally:
            os.close(fd)
    except (OSError, ValueError, RecursionError):
        return None
    good = isinstance(rec, dict) and all(isinstance(rec.get(k), int) and rec[k] > 0 for k in ids)
    return rec if good else None


def sweep(directory: str) -> list[dict[str, Any]]:
    """End the groups an executor recorded in `directory` and left running when it died with its
    watchdog; the records of those ended (with `ended`), each record removed once its executor is
    gone (a freezer's, snapguard.runc's, is left to `runc.sweep_freezers`). A record that is not
    one (a name or body of the wrong shape) is removed, never acted on."""
    ended: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return ended
    boot = procfs.boot_id()
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(FREEZER_PREFIX):
            continue  # snapguard.runc's to put back
        rec = read_record(path, ("pgid", "start", "executor"))
        if rec is not None and name == _record_name(rec["pgid"], rec["start"]):
            executor_start = procfs.start_ticks(rec["executor"])
            if executor_start is not None and executor_start == rec.get("executor_start"):
                continue  # its executor runs: its children are its own
            if rec.get("boot") == boot and _group_left(rec):
                try:
                    os.killpg(rec["pgid"], signal.SIGKILL)
                    ended.append({**rec, "ended": True})
                except OSError:
                    pass
        _forget(path)
    return ended


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
        proc = subprocess.Popen(argv, env=_environment(env), close_fds=not inherit_fds, **_OWN_GROUP,
                                stdin=None if inherit_fds else subprocess.DEVNULL, preexec_fn=_dies_with(os.getpid()))
    except OSError as e:
        raise _start_error(argv, what, e, start_reason or reason) from None
    record = _watch(proc.pid)
    try:
        return _wait(proc, argv, timeout_s=timeout_s, what=what, reason=reason, pointless=pointless,
                     pointless_reason=pointless_reason, grace_s=grace_s)
    finally:
        _unwatch(proc.pid, record)


def _watch(pgid: int) -> str | None:
    _watchdog.started(pgid)
    return _record(pgid)


def _unwatch(pgid: int, record: str | None) -> None:
    _watchdog.ended(pgid)
    _forget(record)


def _pidfd(pid: int) -> int | None:
    """A pidfd of the child (Linux 5.3): readable the moment it exits. None where the kernel or a
    seccomp filter refuses one; the wait then falls back to Popen's own."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _exits_within(proc: subprocess.Popen[bytes], pidfd: int | None, seconds: float) -> bool:
    """Whether the child exits within `seconds`. On its pidfd the wait ends at the exit; Popen's
    wait with a timeout polls in sleeps of up to 50 ms, so a child's exit was seen up to 50 ms late
    (25 ms on average) by every CRIU run, inside a snapshot's stall and a restore's."""
    if pidfd is None:
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(max(0, int(seconds * 1000 + 0.999))))


def _wait(proc: subprocess.Popen[bytes], argv: list[str], *, timeout_s: float, what: str, reason: Reason,
          pointless: Callable[[], str | None] | None, pointless_reason: Reason | None, grace_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    why: tuple[float, str] | None = None
    pidfd = _pidfd(proc.pid)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(argv, timeout_s)
            if _exits_within(proc, pidfd, left if pointless is None else min(left, 0.25)):
                return proc.wait()
            if pointless is None:
                continue  # the deadline ends the loop above
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
    finally:
        if pidfd is not None:
            os.close(pidfd)


def run_captured(argv: list[str], *, timeout_s: float, what: str, reason: Reason,
                 env: Mapping[str, str] | None = None,
                 start_reason: Reason | None = None) -> subprocess.CompletedProcess[str]:
    """Run argv with its output captured (text, undecodable bytes replaced) within timeout_s."""
    try:
        proc = subprocess.Popen(argv, env=_environment(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", **_OWN_GROUP,
                                preexec_fn=_dies_with(os.getpid()))
    except OSError as e:
        raise _start_error(argv, what, e, start_reason or reason) from None
    record = _watch(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ChildTimeout(reason, f"{what} did not finish within {timeout_s:g} s and was killed",
                           evidence={"argv0": argv[0], "timeout_s": timeout_s}) from None
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        _unwatch(proc.pid, record)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def probe(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | str:
    """Ask a tool something (`--version`, `check`, `-h`) under a deadline: its completed run, or one
    line saying why it did not answer (did not start, killed at the deadline with its group)."""
    what = " ".join(argv[:1] + [a for a in argv[1:2]])
    try:
        return run_captured(argv, timeout_s=timeout_s, what=f"`{what}`", reason=Reason.INTERNAL_ERROR)
    except SnapguardError as e:
        return e.failure.detail
