"""The schedule's Targets (snapguard.notice._schedule) built from registry entries: each
workload's size estimated, its run and its fallback bound.

Size: the resident memory (VmRSS, from procfs) of the workload's process tree (a container's:
from the pid runc's state names) plus `gpu_bytes` when the registry names the GPU memory it holds
(the device memory a CUDA checkpoint moves to the host, NVML's figure). A workload whose tree
cannot be read counts as 0 bytes and is scheduled last among those of its deadline.

Fallback: the registry's `file_checkpoint`, else the newest file checkpoint registered with the
job in the store (snapguard.store: a record that is not one snapguard writes is skipped and the
next older one used).

A `pod` entry (the CRI path: `cri_socket`, `container`, `registry_url`, `repository`) runs
snapguard.notice._cri.snapshot_pod, the kubelet's CheckpointContainer and the OCI publish, within
what is left of the notice; when that module cannot be imported (grpcio missing) the entry falls
back with the typed reason it raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .. import procfs
from ..config import Config
from ..reasons import Failure, Reason, SnapguardError, failure_from
from ._schedule import Target

__all__ = ["fallback_for", "size_of", "target_for"]

_CRI_WORKDIR = "cri"


def _rss_bytes(pid: int) -> int:
    total = 0
    for p in procfs.process_tree(pid):
        for line in procfs.proc_text(p, "status").splitlines():
            if line.startswith("VmRSS:"):
                value = line.split()[1:2]
                if value and value[0].isdigit():
                    total += int(value[0]) * 1024
    return total


def size_of(config: Config, entry: dict[str, Any]) -> int:
    """The snapshot size estimate of a registry entry, in bytes (see the module's docstring)."""
    gpu = entry.get("gpu_bytes") if isinstance(entry.get("gpu_bytes"), int) else 0
    try:
        if entry.get("kind") == "pid":
            return _rss_bytes(int(entry["pid"])) + gpu
        if entry.get("kind") == "container":
            from .. import runc

            return _rss_bytes(runc.state(config.runc, entry.get("root"), entry["container"])["pid"]) + gpu
    except Exception:  # an estimate never stops a notice: unknown counts as 0 bytes
        pass
    return gpu


def fallback_for(entry: dict[str, Any], store_url: str | None) -> Callable[[], str | None]:
    def find() -> str | None:
        if entry.get("file_checkpoint"):
            return str(entry["file_checkpoint"])
        if not store_url:
            return None
        from .. import store

        return store.open_store(store_url).newest_file_checkpoint(entry["job"])
    return find


def _pod_run(agent: Any, key: str, entry: dict[str, Any]) -> Callable[[float | None], Failure | None]:
    def run(left: float | None) -> Failure | None:
        try:
            from . import _cri
            from .. import store

            if not agent.store_url:
                raise SnapguardError(Reason.USAGE_ERROR, f"{key}: the CRI path records its image in the store: "
                                     "the agent needs --store")
            st = store.open_store(agent.store_url)
            epoch = entry.get("epoch")
            agent.journal("snapshot_started", key=key, job=entry["job"], kind="pod", image=None)
            published = _cri.snapshot_pod(
                cri_socket=entry["cri_socket"], container_id=entry["container"], job=entry["job"], store=st,
                epoch=st.current_epoch(entry["job"]) if epoch is None else int(epoch),
                registry_url=entry["registry_url"], repository=entry["repository"],
                workdir=os.path.join(agent.dir, _CRI_WORKDIR), deadline_s=left if left is not None else 120.0)
        except Exception as e:
            failure = failure_from(e)
            agent.journal("snapshot_failed", key=key, job=entry["job"], kind="pod", record=failure.to_dict())
            return failure
        agent.journal("published", key=key, job=entry["job"], reference=published.reference,
                      digest=published.digest, epoch=published.epoch)
        agent.registry.update(key, state="snapshotted", uploaded=True, reference=published.reference)
        return None
    return run


def target_for(agent: Any, key: str, entry: dict[str, Any], deadline: float | None,
               snapshot: Callable[[float | None], Failure | None]) -> Target:
    """The Target of registry entry `entry` for a notice with `deadline`; `snapshot` is the
    agent's own run for bare and runc workloads."""
    run = _pod_run(agent, key, entry) if entry.get("kind") == "pod" else snapshot
    return Target(key=key, job=str(entry["job"]), kind=str(entry.get("kind")), size_bytes=size_of(agent.config, entry),
                  deadline=deadline, run=run, fallback=fallback_for(entry, agent.store_url))
