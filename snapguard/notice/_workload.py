"""The agent's view of one registered workload: whether it still runs, the runner that snapshots
it, and what a killed snapshot left behind (stray CRIU or runc processes, a frozen container,
CUDA processes left checkpointed)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from .. import procfs
from ..config import Config
from ..reasons import SnapguardError, failure_from

__all__ = ["alive", "bring_back", "end_strays", "runner", "stray_processes"]


def alive(config: Config, entry: dict[str, Any]) -> bool:
    """Whether the workload of a registry entry still runs (the same process: pid and start time;
    a container runc says is running or paused)."""
    if entry.get("kind") == "pid":
        return procfs.running_start_ticks(int(entry["pid"])) == entry.get("start_time")
    if entry.get("kind") == "container":
        from .. import runc

        try:
            return runc.state(config.runc, entry.get("root"), entry["container"]).get("status") in (
                "running", "paused")
        except SnapguardError:
            return False
    if entry.get("kind") == "pod":
        return True  # the CRI path: containerd answers for it when CheckpointContainer is called
    return False


def runner(config: Config, w: dict[str, Any], image: str) -> Any:
    """The pipeline runner that takes a stopping snapshot of workload `w` into `image`."""
    from .. import pipeline

    if w["kind"] == "pid":
        return pipeline.CriuRunner(config.criu, int(w["pid"]))
    from .. import runc

    root = w.get("root")
    args = [*(["--root", root] if root else []), "checkpoint", "--image-path", image, "--work-path", image,
            w["container"]]
    if runc.version(config.runc, config.state_dir) < runc.CRIU_BY_PATH:
        args = ["--criu", config.criu, *args]
    return pipeline.RuncRunner(config.runc, args, root=root, container_id=w["container"])


def bring_back(config: Config, entry: dict[str, Any], log: Callable[[str], None]) -> None:
    """After a killed snapshot: a container CRIU froze is thawed, CUDA processes run again."""
    if entry.get("kind") == "container":
        from .. import pipeline

        r = pipeline.RuncRunner(config.runc, [], root=entry.get("root"), container_id=entry["container"])
        r.status_before = "running"
        try:
            r.after_failed_dump()
        except SnapguardError:
            pass
        return
    pid = entry.get("pid")
    if not pid or not alive(config, entry):
        return
    try:
        from .. import gpu_suspend

        inv = procfs.inventory(procfs.process_tree(pid))
        cuda = [p.pid for p in inv.cuda_processes()]
        if cuda:
            log(f"CUDA processes {cuda} of pid {pid}: {gpu_suspend.resume(cuda)}")
    except Exception as e:  # best effort: the workload itself runs
        log(f"could not check CUDA state of pid {pid}: {failure_from(e).message}")


def stray_processes(image: str) -> list[int]:
    """Processes (CRIU, a wrapper, runc) that name `image` as an argument: left by a killed agent."""
    return procfs.with_argument(image)


def end_strays(image: str, wait_s: float = 10.0) -> list[int]:
    """Kill the stray processes of `image` (their process group: CRIU runs in one of its own) and
    wait up to `wait_s` for them to go; the pids found."""
    strays = stray_processes(image)
    own = os.getpgrp()
    for pid in strays:
        try:
            pgid = os.getpgid(pid)
            os.killpg(pgid, signal.SIGKILL) if pgid != own else os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + wait_s
    while strays and time.monotonic() < end and any(procfs.exists(p) and procfs.running_start_ticks(p) is not None
                                                     for p in strays):
        time.sleep(0.05)
    return strays
