"""The executor's own CUDA steps around a dump: lock and checkpoint before CRIU, restore and unlock
after a leave-running dump, and bring every process back after a failure.

CRIU's CUDA plugin can do the same, but it runs `cuda-checkpoint` once per step and per query (eight
runs for a leave-running snapshot, 0.2 s each on the H200 with snapguard's tool) while the trainer
is stalled. Done here, in-process, the steps cost the driver's own time. The plugin then finds the
processes checkpointed and leaves them so; at restore it restores and unlocks them as usual.
"""

from __future__ import annotations

import time

from . import procfs
from .reasons import Reason, SnapguardError

__all__ = ["resume", "suspend", "wedged"]


def suspend(pids: list[int], lock_timeout_s: float) -> float:
    """Lock every process, then checkpoint each: ranks that talk to each other all stop making CUDA
    calls before any one's GPU state moves. Returns the seconds it took. On failure every process is
    brought back to running and SnapguardError raised (CUDA_LOCK_TIMEOUT, CUDA_CHECKPOINT_FAILED)."""
    from . import cuda

    if not pids:
        return 0.0
    t0 = time.monotonic()
    try:
        driver = cuda.load()
    except OSError as e:
        raise SnapguardError(Reason.CUDA_PLUGIN_UNAVAILABLE, f"cannot load the CUDA driver: {e}") from None
    step = "lock"
    try:
        for pid in pids:
            driver.lock(pid, int(lock_timeout_s * 1000))
        step = "checkpoint"
        for pid in pids:
            driver.checkpoint(pid)
    except cuda.CudaError as e:
        outcomes = resume(pids)
        reason = Reason.CUDA_LOCK_TIMEOUT if step == "lock" and e.timed_out else Reason.CUDA_CHECKPOINT_FAILED
        raise SnapguardError(reason, str(e), workload_intact=not wedged(outcomes),
                             evidence={"pid": e.pid, "step": step, "cuda_recovery": outcomes}) from None
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
