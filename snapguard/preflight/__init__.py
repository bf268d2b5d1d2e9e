"""Preflight: every snapshot blocker seen before the workload is touched.

Public API: `node_report`, `pid_report`, `container_report`, `manifest_report`; each returns a
Report whose `exit_code` is 0 (ready), 1 (blocked) or 2 (could not check).
"""

from __future__ import annotations

import os

from .. import image
from ..config import Config
from .._host import host_facts, mem_available_bytes
from ..reasons import Finding, SnapguardError
from . import gpu, host, workload
from ._report import EXIT_BLOCKED, EXIT_READY, EXIT_UNCHECKED, CheckResult, Report

__all__ = ["EXIT_BLOCKED", "EXIT_READY", "EXIT_UNCHECKED", "Report", "container_report", "manifest_report",
           "host_checks", "node_report", "pid_report"]


def host_checks(report: Report, config: Config, gpu_required: bool, criu: str | None = None,
                network_lock: bool = True) -> None:
    """The checks every snapshot and restore needs from the host; `criu` overrides the pinned one.
    `network_lock`: the tree has a network namespace of its own, which CRIU locks with iptables."""
    report.facts["host"] = host_facts()
    report.run("privileges", host.check_privileges)
    report.run("criu", lambda: host.check_criu(criu or config.criu, config.state_dir, report.facts))
    if network_lock:
        report.run("network-lock", host.check_network_lock)
    report.run("cuda-plugin", lambda: host.check_cuda_plugin(config, gpu_required))
    report.run("nvidia-driver", lambda: _driver_checks(report))


def _driver_checks(report: Report) -> list[Finding]:
    report.facts["gpu"] = facts = gpu.gpu_facts()
    if facts is None:
        return []  # no NVIDIA driver: nothing to check, and nothing of the driver API to load
    from ..cuda._symbols import find_libcuda

    return gpu.check_driver(facts, find_libcuda())


def node_report(config: Config) -> Report:
    report = Report("--node")
    host_checks(report, config, gpu_required=os.path.exists(gpu.NVIDIA_DRIVER))
    report.run("gpu-handles", lambda: gpu.check_gpu_handles(report.facts.get("gpu")))
    return report


def pid_report(pid: int, config: Config, tcp_established: bool = False) -> Report:
    report = Report(f"--pid {pid}")
    try:
        inv = workload.inventory(workload.process_tree(pid))
    except SnapguardError as e:
        report.checks.append(CheckResult("process-tree", error=e.failure.detail))
        return report
    host_checks(report, config, gpu_required=inv.uses_gpu, network_lock=workload.own_netns(pid))
    from ..hooks import take

    workload.run_checks(report, inv, tcp_established, trainers=take.trainers([p.pid for p in inv.procs]))
    return report


def container_report(container_id: str, runc_root: str | None, config: Config) -> Report:
    from ..shim._argv import GlobalOptions
    from ..shim._runc import runc_state

    opts = GlobalOptions()
    if runc_root:
        opts.values["root"] = runc_root
    try:
        state = runc_state(config.runc, opts, container_id)
    except SnapguardError as e:
        report = Report(f"--container {container_id}")
        report.checks.append(CheckResult("runc-state", error=e.failure.detail))
        return report
    report = pid_report(int(state["pid"]), config)
    report.target = f"--container {container_id}"
    return report


def manifest_report(path: str, config: Config, criu: str | None = None) -> Report:
    """Can this host restore the image whose manifest (or image directory) is at `path`?

    The image is verified first (marker, manifest, checksums); its manifest lands in
    `report.facts["manifest"]`.
    """
    image_dir = path if os.path.isdir(path) else os.path.dirname(path) or "."
    report = Report(f"--manifest {path}")
    try:
        manifest = image.verify(image_dir)
    except SnapguardError as e:
        report.checks.append(CheckResult("image", findings=[
            Finding(e.reason, e.failure.detail, evidence=e.failure.evidence)]))
        return report
    report.checks.append(CheckResult("image"))
    report.facts["manifest"] = manifest
    uses_gpu = any(p.get("gpu") for p in manifest.get("processes", []) if isinstance(p, dict))
    # a tree dumped in the host's network namespace needs a lock only for its TCP connections
    needs_lock = manifest.get("own_netns") is not False or (
        bool(manifest.get("tcp_connections")) and manifest.get("network_lock") != "skip")
    host_checks(report, config, gpu_required=uses_gpu, criu=criu, network_lock=needs_lock)
    report.run("image-vs-host", lambda: image.compare_with_host(
        manifest, {**report.facts["host"], "mem_available": mem_available_bytes()},
        str(report.facts.get("criu_version", "unknown"))))
    report.run("gpu-vs-host", lambda: gpu.compare_gpu(manifest.get("gpu"), report.facts.get("gpu")))
    return report
