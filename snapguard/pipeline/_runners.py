"""Who runs CRIU: the one thing the two entry points do differently.

`RuncRunner` (snapguard-runc): the real runc runs CRIU (`criu swrk`), with containerd's argv
unchanged but for the pinned CRIU; the container's pid comes from `runc state`. `CriuRunner`
(snapguard checkpoint/restore): snapguard runs `criu dump/restore` itself on a bare process tree.
Everything else, before and after, is the one sequence of `checkpoint` or `restore`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Protocol

from .. import children, procfs, runc
from ..criu import CriuOptions
from ..names import DUMP_LOG, RESTORE_LOG, RESTORED_PIDFILE
from ..reasons import Reason, SnapguardError
from ._request import Request

__all__ = ["CriuRunner", "Runner", "RuncRunner"]


class Runner(Protocol):
    #: whether restored processes take their pids in this host's pid namespace (a bare tree), so
    #: pids of the image in use here are a conflict; a container gets a namespace of its own
    uses_host_pids: bool

    def describe(self) -> str: ...

    def identity(self) -> dict[str, Any]: ...

    def target_pid(self) -> int: ...

    def dump(self, req: Request, options: CriuOptions, env: dict[str, str]) -> int: ...

    def after_failed_dump(self) -> None: ...

    def thaw(self) -> bool: ...

    def settle(self) -> None: ...

    def restore(self, req: Request, options: CriuOptions, env: dict[str, str]) -> int: ...

    def restored_pid(self, req: Request) -> int: ...

    def failure_detail(self) -> str | None: ...

    def discard(self, pid: int) -> bool: ...


class CriuRunner:
    """snapguard runs CRIU on a bare process tree (`pid` for a checkpoint, None for a restore)."""

    uses_host_pids = True

    def __init__(self, criu: str, pid: int | None = None) -> None:
        self.criu = criu
        self.pid = pid

    def describe(self) -> str:
        return f"--pid {self.pid}" if self.pid is not None else "bare restore"

    def identity(self) -> dict[str, Any]:
        return {"root_pid": self.pid, "bare": True}

    def target_pid(self) -> int:
        assert self.pid is not None
        return self.pid

    def dump(self, req: Request, options: CriuOptions, env: dict[str, str]) -> int:
        pid = self.target_pid()
        return children.run(options.dump_argv(self.criu, pid), env=env, timeout_s=req.timeouts.run_s,
                            what="criu dump", reason=Reason.CRIU_TIMEOUT, start_reason=Reason.CRIU_MISSING,
                            pointless=_died(pid), pointless_reason=Reason.CRIU_DUMP_FAILED,
                            grace_s=req.timeouts.died_grace_s)

    def after_failed_dump(self) -> None:
        pass  # CRIU seized the tree with ptrace: its end, even a kill, lets the tree go on

    def thaw(self) -> bool:
        return False  # a bare tree has no freezer of snapguard's to undo

    def settle(self) -> None:
        pass

    def restore(self, req: Request, options: CriuOptions, env: dict[str, str]) -> int:
        pidfile = req.path(RESTORED_PIDFILE)
        try:
            os.unlink(pidfile)  # a stale one would name another process
        except FileNotFoundError:
            pass
        return children.run(options.restore_argv(self.criu, pidfile), env=env, timeout_s=req.timeouts.run_s,
                            what="criu restore", reason=Reason.CRIU_TIMEOUT, start_reason=Reason.CRIU_MISSING)

    def failure_detail(self) -> str | None:
        return None  # CRIU's own log says why it failed

    def discard(self, pid: int) -> bool:
        """End a restored tree that is not the workload; whether it is gone."""
        return end_tree(pid)

    def restored_pid(self, req: Request) -> int:
        pidfile = req.path(RESTORED_PIDFILE)
        try:
            fd = os.open(pidfile, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd) as f:
                return int(f.read(32).strip())
        except (OSError, ValueError):
            raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"CRIU exited 0 but left no pid in {pidfile}",
                                 workload_intact=False, evidence={"pidfile": pidfile}) from None


class RuncRunner:
    """The real runc runs CRIU for a container; `args` is snapguard-runc's argv without argv[0]."""

    uses_host_pids = False

    def __init__(self, runc_path: str, args: list[str], *, root: str | None, container_id: str,
                 pid_file: str | None = None, log: str | None = None, log_format: str = "text") -> None:
        self.runc = runc_path
        self.args = args
        self.root = root
        self.container_id = container_id
        self.pid_file = pid_file
        self.status_before: str | None = None
        self.pid: int | None = None  # the container's init, as `target_pid` first found it
        self.thawed = False  # `thaw` resumed the paused container; `settle` pauses it again
        self.freezer: runc.FreezerGuard | None = None  # its freezer as it was, should we die
        self.log = log  # runc's --log: where runc says why it failed when CRIU never ran
        self.log_format = log_format
        self._log_offset = 0

    def describe(self) -> str:
        return f"container {self.container_id}"

    def identity(self) -> dict[str, Any]:
        return {"container_id": self.container_id}

    def target_pid(self) -> int:
        state = runc.state(self.runc, self.root, self.container_id)
        status = state.get("status")
        if status not in ("running", "paused"):
            raise SnapguardError(Reason.CONTAINER_NOT_FOUND,
                                 f"container {self.container_id} is {status}, not running",
                                 evidence={"container": self.container_id, "status": status})
        if self.pid is None:
            self.status_before, self.pid = status, int(state["pid"])
        return int(state["pid"])

    def _guard_freezer(self) -> None:
        """Before the thaw or the dump: the freezer put back as it was should the executor die."""
        if self.freezer is None and self.pid is not None:
            self.freezer = runc.FreezerGuard(self.pid, self.container_id, self.root,
                                             frozen=self.status_before == "paused")

    def _run(self, req: Request, env: dict[str, str], verb: str, pointless: Any = None) -> int:
        try:
            self._log_offset = os.stat(self.log).st_size if self.log else 0
        except OSError:
            self._log_offset = 0
        # containerd hands runc the container's stdio and sockets by fd inheritance
        return children.run([self.runc, *self.args], env=env, timeout_s=req.timeouts.run_s, what=f"runc {verb}",
                            reason=Reason.RUNC_TIMEOUT, start_reason=Reason.RUNC_UNUSABLE, inherit_fds=True,
                            pointless=pointless, pointless_reason=Reason.CRIU_DUMP_FAILED,
                            grace_s=req.timeouts.died_grace_s)

    def dump(self, req: Request, options: CriuOptions, env: dict[str, str]) -> int:
        pointless = _died(self.target_pid())
        self._guard_freezer()
        return self._run(req, env, "checkpoint", pointless=pointless)

    def after_failed_dump(self) -> None:
        """CRIU freezes a container's cgroup: a runc or CRIU killed mid-dump leaves it frozen
        (a thawed one too: its trainers are released before `settle` pauses it again)."""
        try:
            now = runc.state(self.runc, self.root, self.container_id).get("status")
        except SnapguardError:
            return
        if now == "paused" and (self.status_before == "running" or self.thawed):
            self._runc("resume")
        if (self.status_before == "running" or self.thawed) and self.freezer is not None:
            self.freezer.thaw()  # runc resumes FROZEN only: CRIU killed while freezing leaves FREEZING

    def _runc(self, verb: str) -> int:
        return children.run([self.runc, *(["--root", self.root] if self.root else []), verb, self.container_id],
                            timeout_s=30, what=f"runc {verb}", reason=Reason.RUNC_TIMEOUT)

    def thaw(self) -> bool:
        """A paused container resumed (containerd's CRI pauses the task before it asks the runtime
        for a checkpoint): a frozen trainer cannot answer its take point, nor a frozen CUDA
        process the driver's lock. runc's CRIU freezes the container itself for the dump.
        Whether it was thawed; WORKLOAD_FROZEN when runc cannot resume it."""
        if self.status_before != "paused":
            return False
        self._guard_freezer()
        rc = self._runc("resume")
        if rc != 0:
            raise SnapguardError(Reason.WORKLOAD_FROZEN, f"container {self.container_id} is paused and `runc resume` "
                                 f"exited {rc}: its take point and CUDA processes cannot be reached frozen",
                                 evidence={"container": self.container_id, "status": "paused", "exit": rc})
        self.thawed = True
        return True

    def settle(self) -> None:
        """A container `thaw` resumed, paused again once the snapshot let go of it, as containerd
        left it (its client resumes the task after the checkpoint, and its shim holds it paused
        until then, answering `paused` to every status); one a stop checkpoint ended is left so.
        Never raises: a pause that fails leaves the container running, and containerd's client
        ignores the failed resume that follows. Last, the freezer is as it was before the
        snapshot where the container still is, and nothing is left to put back."""
        if self.thawed:
            self.thawed = False
            try:
                if runc.state(self.runc, self.root, self.container_id).get("status") == "running":
                    self._runc("pause")
            except SnapguardError:
                pass
        if self.freezer is not None:
            self.freezer.settle()
            self.freezer = None

    def restore(self, req: Request, options: CriuOptions, env: dict[str, str]) -> int:
        existed = self._exists()
        try:
            return self._run(req, env, "restore")
        except SnapguardError:
            # the deadline passed and runc was killed half way: it leaves the container's state
            # directory (no state.json yet), and runc refuses the id until it is deleted
            if not existed:
                self._delete_leftover()
            raise

    def discard(self, pid: int) -> bool:
        """End a restored container that is not the workload, and free its id."""
        prefix = [self.runc, *(["--root", self.root] if self.root else [])]
        for verb in (["kill", self.container_id, "KILL"], ["delete", "--force", self.container_id]):
            try:
                children.run([*prefix, *verb], timeout_s=30, what=f"runc {verb[0]}", reason=Reason.RUNC_TIMEOUT)
            except SnapguardError:
                pass
        return end_tree(pid)

    def _exists(self) -> bool:
        try:
            runc.state(self.runc, self.root, self.container_id)
        except SnapguardError:
            return False
        return True

    def _delete_leftover(self) -> None:
        """`runc delete --force`: runc 1.1 removes a state directory without state.json too."""
        try:
            children.run([self.runc, *(["--root", self.root] if self.root else []), "delete", "--force",
                          self.container_id], timeout_s=30, what="runc delete", reason=Reason.RUNC_TIMEOUT)
        except SnapguardError:
            pass

    def failure_detail(self) -> str | None:
        """runc's last error of this run, from its --log: why it failed where CRIU never ran
        (CRIU not startable, its version check failed) is only there."""
        if not self.log:
            return None
        try:
            with open(self.log, "rb") as f:
                f.seek(self._log_offset)
                text = f.read(64 << 10).decode("utf-8", "replace")
        except OSError:
            return None
        said = []
        for line in text.splitlines():
            if self.log_format == "json":
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and entry.get("level") == "error":
                    said.append(str(entry.get("msg", "")))
            else:
                m = re.search(r'level=error msg=("(?:[^"\\]|\\.)*")', line)
                if m:
                    said.append(json.loads(m.group(1)))
        said = [m for m in said if not m.startswith("snapguard ")]
        return f"runc: {' '.join(said[-1].split())[:400]}" if said else None

    def restored_pid(self, req: Request) -> int:
        if self.pid_file:
            try:
                fd = os.open(self.pid_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                with os.fdopen(fd) as f:
                    return int(f.read(32).strip())
            except (OSError, ValueError):
                pass
        return int(runc.state(self.runc, self.root, self.container_id)["pid"])


def _died(pid: int) -> Any:
    """For a dump's wait: why waiting on is pointless once the workload died under it (killed
    mid-dump: CRIU, still tracing a zombie, was seen to wait on for minutes). A stopping dump's
    CRIU ends the tree itself when done; the grace children.run gives covers its last steps."""
    def why() -> str | None:
        state = procfs.process_state(pid)
        return f"the workload (pid {pid}) died during the dump" if state in ("Z", "X", "gone") else None
    return why


def end_tree(pid: int, wait_s: float = 10.0) -> bool:
    """SIGKILL a process tree, leaves first; whether every process is gone (or a zombie) in time."""
    import signal
    import time

    try:
        pids = procfs.process_tree(pid)
    except SnapguardError:
        return True
    for p in reversed(pids):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all(not procfs.alive(p) for p in pids):
            return True
        time.sleep(0.02)
    return False


def log_path(req: Request, restore: bool) -> str:
    return req.path(RESTORE_LOG if restore else DUMP_LOG)
