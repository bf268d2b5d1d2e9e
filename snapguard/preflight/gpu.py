"""GPU facts (NVML) and the GPU checks of a node and of an image against a node."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..reasons import Finding, Reason, Severity

__all__ = ["gpu_facts", "check_driver", "check_gpu_handles", "compare_gpu", "device_map"]

NVIDIA_DRIVER = "/proc/driver/nvidia/version"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_facts() -> dict[str, Any] | None:
    """Driver and GPU inventory from NVML; None where there is no NVIDIA driver."""
    if not os.path.exists(NVIDIA_DRIVER):
        return None
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                mig = pynvml.nvmlDeviceGetMigMode(h)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:
                mig = False  # not MIG-capable
            try:
                persistence = pynvml.nvmlDeviceGetPersistenceMode(h) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError:
                persistence = None
            procs = {p.pid: p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
            gpus.append({
                "index": i,
                "name": _text(pynvml.nvmlDeviceGetName(h)),
                "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                "pci_bus_id": _text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                "minor": pynvml.nvmlDeviceGetMinorNumber(h),
                "compute_capability": ".".join(map(str, pynvml.nvmlDeviceGetCudaComputeCapability(h))),
                "memory_total": mem.total,
                "memory_free": mem.free,
                "persistence_mode": persistence,
                "mig_mode": mig,
                "processes": procs,
            })
        return {
            "driver_version": _text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver_version": pynvml.nvmlSystemGetCudaDriverVersion_v2(),
            "gpus": gpus,
        }
    finally:
        pynvml.nvmlShutdown()


def check_driver(facts: dict[str, Any] | None, libcuda: str | None,
                 symbols: Callable[[str], dict[str, bool]] | None = None) -> list[Finding]:
    """Node: the driver exports the checkpoint API (`symbols` reads it: default
    cuda.libcuda_checkpoint_symbols); persistence mode; MIG."""
    if facts is None:
        return []
    findings = []
    if libcuda is None:
        findings.append(Finding(Reason.DRIVER_TOO_OLD, "no libcuda.so.1 found in the driver's library paths"))
    else:
        from ..cuda import libcuda_checkpoint_symbols

        missing = [s for s, ok in (symbols or libcuda_checkpoint_symbols)(libcuda).items() if not ok]
        if missing:
            findings.append(Finding(Reason.DRIVER_TOO_OLD,
                                    f"driver {facts['driver_version']}: {libcuda} lacks {', '.join(missing)}",
                                    evidence={"libcuda": libcuda, "missing": missing}))
    for g in facts["gpus"]:
        if g["mig_mode"]:
            findings.append(Finding(Reason.MIG_UNSUPPORTED, f"GPU {g['index']} ({g['uuid']}) is in MIG mode",
                                    evidence={"gpu": g["uuid"]}))
        if g["persistence_mode"] is False:
            findings.append(Finding(Reason.PERSISTENCE_MODE_OFF,
                                    f"GPU {g['index']} has persistence mode off: restores rely on cuInit "
                                    "in the restoring tool, and driver start-up adds to every restore",
                                    Severity.WARNING, {"gpu": g["uuid"]}))
    return findings


def check_gpu_handles(facts: dict[str, Any] | None, proc: str | None = None) -> list[Finding]:
    """Node: processes that hold /dev/nvidia* with no CUDA context (NVML users, monitors,
    forked workers): harmless until they are in a snapshotted tree, where they block it."""
    if facts is None:
        return []
    from . import scan  # the C helper loads only where a node scan runs

    cuda_pids = {pid for g in facts["gpus"] for pid in g["processes"]}
    holders: dict[int, set[str]] = {}
    for m in scan.scan(prefixes=("/dev/nvidia",), majors=(scan.NVIDIA_MAJOR,), proc=proc):
        if m.pid != os.getpid():
            holders.setdefault(m.pid, set()).add(m.path)
    return [Finding(Reason.STRAY_GPU_DEVICE_HANDLE,
                    f"pid {pid} holds {', '.join(sorted(paths)[:3])} without a CUDA context: a snapshot of a "
                    "tree holding it would fail", Severity.WARNING, {"pid": pid, "paths": sorted(paths)})
            for pid, paths in sorted(holders.items()) if pid not in cuda_pids]


def image_gpu_facts(facts: dict[str, Any], pids: list[int]) -> dict[str, Any]:
    """What the manifest keeps: the node's GPUs and the GPU memory of the snapshotted pids."""
    wanted = set(pids)
    return {
        "driver_version": facts["driver_version"],
        "cuda_driver_version": facts["cuda_driver_version"],
        "gpus": [{k: g[k] for k in ("index", "name", "uuid", "pci_bus_id", "minor", "compute_capability",
                                    "memory_total")}
                 | {"used_by_image": sum(m for p, m in g["processes"].items() if p in wanted)}
                 for g in facts["gpus"]],
    }


def device_map(image: dict[str, Any], host: dict[str, Any]) -> list[tuple[str, str]]:
    """Pairs (old UUID, new UUID) by index, for images whose GPUs are not all here."""
    return [(old["uuid"], new["uuid"]) for old, new in zip(image["gpus"], host["gpus"])]


def compare_gpu(image: dict[str, Any] | None, host: dict[str, Any] | None) -> list[Finding]:
    """Can GPU state from `image` (the manifest's gpu section) be restored on `host`?"""
    if not image:
        return []
    if host is None:
        return [Finding(Reason.GPU_COUNT_MISMATCH, f"image used {len(image['gpus'])} GPU(s), this host has no "
                        "NVIDIA driver", evidence={"image_gpus": len(image["gpus"]), "host_gpus": 0})]
    findings = []
    if image["driver_version"] != host["driver_version"]:
        findings.append(Finding(Reason.DRIVER_VERSION_MISMATCH,
                                f"image taken under driver {image['driver_version']}, this host has "
                                f"{host['driver_version']}",
                                evidence={"image_driver": image["driver_version"], "host_driver": host["driver_version"]}))
    if len(host["gpus"]) < len(image["gpus"]):
        findings.append(Finding(Reason.GPU_COUNT_MISMATCH,
                                f"image used {len(image['gpus'])} GPU(s), this host has {len(host['gpus'])}",
                                evidence={"image_gpus": len(image["gpus"]), "host_gpus": len(host["gpus"])}))
    for old, new in zip(image["gpus"], host["gpus"]):
        if old["name"] != new["name"]:
            findings.append(Finding(Reason.GPU_MODEL_MISMATCH,
                                    f"image taken on {old['name']}, this host has {new['name']}",
                                    evidence={"index": old["index"], "image_gpu": old["name"], "host_gpu": new["name"]}))
            break
        if old["used_by_image"] > new["memory_free"]:
            findings.append(Finding(Reason.GPU_MEMORY_INSUFFICIENT,
                                    f"GPU {new['index']} has {new['memory_free'] >> 20} MiB free, the image needs "
                                    f"{old['used_by_image'] >> 20} MiB",
                                    evidence={"gpu": new["uuid"], "free": new["memory_free"],
                                              "needed": old["used_by_image"]}))
    here = {g["uuid"] for g in host["gpus"]}
    moved = [g["uuid"] for g in image["gpus"] if g["uuid"] not in here]
    if moved and not findings:
        findings.append(Finding(Reason.GPU_IDENTITY_MISMATCH,
                                f"{len(moved)} GPU(s) of the image are not on this host; same model and count, "
                                "so they are mapped by index",
                                Severity.WARNING, {"device_map": device_map(image, host)}))
    return findings
