"""Nothing wedged: bring a CUDA process that a failed snapshot left locked or checkpointed back to
running. cuda-checkpoint does not roll back by itself, and a process left locked hangs at its next
CUDA call."""

from __future__ import annotations

from ._driver import CudaError, Driver

__all__ = ["recover"]


def recover(driver: Driver, pid: int) -> tuple[str, str]:
    """Restore and unlock as needed; return (state found, state left). Raises CudaError."""
    found = driver.state(pid)
    state = found
    if state == "checkpointed":
        driver.restore(pid)
        state = driver.state(pid)
    if state == "locked":
        driver.unlock(pid)
        state = driver.state(pid)
    if state != "running":
        raise CudaError("recover", 999, "CUDA_STATE_WEDGED", f"pid {pid} was {found}, is {state}", pid)
    return found, state
