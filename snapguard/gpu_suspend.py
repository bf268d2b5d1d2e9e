"""The executor's own CUDA steps around a dump: lock and checkpoint before CRIU, restore and unlock
after a leave-running dump, and bring every process back after a failure.

CRIU's CUDA plugin can do the same, but it runs `cuda-checkpoint` once per step and per query (eight
runs for a leave-running snapshot, 0.2 s each on the H200 with snapguard's tool) while the trainer
is stalled. Done here, in-process, the steps cost the driver's own time. The plugin then finds the
processes checkpointed and leaves them so; at restore it restores and unlocks them as usual.

The driver's calls wait on the process itself: one that is stopped or in a frozen cgroup never
answers, and the lock's own timeout does not end that wait. Such a process is refused before any
call (WORKLOAD_FROZEN), and every lock and checkpoint call runs under a deadline of its own that
ends the wait (CUDA_LOCK_TIMEOUT), the call left to the driver in a thread of its own.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from . import procfs
from .reasons import Reason, SnapguardError

__all__ = ["CALL_GRACE_S", "frozen", "resume", "suspend", "wedged"]

CALL_GRACE_S = 5.0  # past the lock's own timeout, the driver's call has this long to return


def suspend(pids: list[int], lock_timeout_s: float) -> float:
    """Lock every process, then checkpoint each: ranks that talk to each other all stop making CUDA
    calls before any one's GPU state moves. Returns the seconds it took. On failure every process is
    brought back to running and SnapguardError raised (CUDA_LOCK_TIMEOUT, CUDA_CHECKPOINT_FAILED)."""
    from . import cuda

    if not pids:
        return 0.0
    stuck = {pid: why for pid in pids if (why := frozen(pid))}
    if stuck:
        raise SnapguardError(Reason.WORKLOAD_FROZEN, f"the CUDA driver cannot lock a process that does not run: "
                             f"{'; '.join(stuck.values())}; nothing was locked",
                             evidence={"pids": sorted(stuck), "why": stuck})
    t0 = time.monotonic()
    try:
        driver = cuda.load()
    except OSError as e:
        raise SnapguardError(Reason.CUDA_PLUGIN_UNAVAILABLE, f"cannot load the CUDA driver: {e}") from None
    step = "lock"
    try:
        for pid in pids:
            _within(lambda pid=pid: driver.lock(pid, int(lock_timeout_s * 1000)), lock_timeout_s + CALL_GRACE_S,
                    pid, step)
        step = "checkpoint"
        for pid in pids:
            # the GPU's memory copied out: seconds per ten GB on the H200
            _within(lambda pid=pid: driver.checkpoint(pid), 2 * lock_timeout_s + CALL_GRACE_S, pid, step)
    except cuda.CudaError as e:
        outcomes = resume(pids)
        reason = Reason.CUDA_LOCK_TIMEOUT if step == "lock" and e.timed_out else Reason.CUDA_CHECKPOINT_FAILED
        raise SnapguardError(reason, str(e), workload_intact=not wedged(outcomes),
                             evidence={"pid": e.pid, "step": step, "cuda_recovery": outcomes}) from None
    except SnapguardError as e:  # a call past its deadline: the others back, that one left to the driver
        left = e.failure.evidence.get("pid")
        e.failure.evidence["cuda_recovery"] = resume([p for p in pids if p != left])
        raise
    return time.monotonic() - t0


def resume(pids: list[int]) -> dict[int, str]:
    """Every CUDA process back to running, from whatever state it is in. {pid: outcome}."""
    from . import cuda

    outcomes = {}
    try:
        driver = cuda.load()
    except OSError as e:
        return {pid: f"driver not loadable: {e}" for pid in pids}
    for pid in pids:
        if not procfs.exists(pid):
            outcomes[pid] = "gone"
            continue
        try:
            found, _ = cuda.recover(driver, pid)
            outcomes[pid] = "running" if found == "running" else f"recovered from {found}"
        except cuda.CudaError as e:
            outcomes[pid] = f"wedged: {e}"
    return outcomes


def wedged(outcomes: dict[int, str]) -> dict[int, str]:
    """The processes `resume` could not bring back."""
    return {pid: o for pid, o in outcomes.items() if o.startswith("wedged")}


def frozen(pid: int) -> str | None:
    """Why pid cannot answer the driver now, or None: stopped (SIGSTOP, a tracer's stop) or in a
    frozen cgroup (`runc pause`, containerd's pause before its checkpoint): v2's cgroup.events,
    or v1's freezer.state where the freezer is a v1 hierarchy."""
    state = procfs.process_state(pid)
    if state in ("T", "t"):
        return f"pid {pid} is stopped (state {state})"
    for line in procfs.proc_text(pid, "cgroup").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if not path.startswith("/"):
            continue
        if controllers == "":
            where = [(os.path.join(base, path.lstrip("/")), "cgroup.events", "frozen 1")
                     for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")]
        elif "freezer" in controllers.split(","):
            where = [(os.path.join("/sys/fs/cgroup/freezer", path.lstrip("/")), "freezer.state", "FROZEN")]
        else:
            continue
        for directory, name, mark in where:
            text = _small_file(os.path.join(directory, name))
            if text is not None and (mark in text.splitlines() or text.strip() == "FREEZING"):
                return f"pid {pid} is in a frozen cgroup ({directory})"
    return None


def _small_file(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            return f.read(4096)
    except OSError:
        return None


def _within(call: Callable[[], None], deadline_s: float, pid: int, step: str) -> None:
    """`call()` in a thread of its own, waited on for `deadline_s`; CUDA_LOCK_TIMEOUT when it has
    not returned by then (the thread is left in the driver: a daemon, it ends with the process)."""
    done = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # handed to the caller's thread
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name=f"cuda-{step}-{pid}", daemon=True).start()
    if not done.wait(deadline_s):
        why = frozen(pid) or "it runs, but the driver did not answer"
        raise SnapguardError(Reason.CUDA_LOCK_TIMEOUT,
                             f"the driver's {step} of pid {pid} did not return within {deadline_s:g} s ({why}); "
                             "it may still take effect: check it with "
                             f"`snapguard-cuda-checkpoint --get-state --pid {pid}`",
                             workload_intact=False, evidence={"pid": pid, "step": step, "deadline_s": deadline_s})
    if failed:
        raise failed[0]
