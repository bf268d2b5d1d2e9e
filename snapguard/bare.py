"""Snapshots of bare process trees (jobs not in containers): `snapguard checkpoint --pid` and
`snapguard restore --images`, with the executor's guards, driving CRIU and its CUDA plugin directly.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from . import criu, gpu_suspend, image
from .config import Config
from .files import ensure_private_dir
from ._host import process_state
from .hooks import take
from .preflight import gpu, host_checks, manifest_report, workload
from .preflight import host as host_checks_module
from .preflight._report import Report
from .reasons import Finding, Reason, SnapguardError

__all__ = ["checkpoint_pid", "restore_images"]


def _env(config: Config, device_map: list[tuple[str, str]] | None = None) -> dict[str, str]:
    return criu.prepare_environment(config, config.criu, device_map)


def _device_map(report: Report, config: Config) -> list[tuple[str, str]] | None:
    """The GPU remapping a restore needs, checked to be one the cuda-checkpoint in use applies."""
    from .config import resolve_cuda_checkpoint

    pairs = next((f.evidence["device_map"] for f in report.findings
                  if f.reason is Reason.GPU_IDENTITY_MISMATCH and "device_map" in f.evidence), None)
    if not pairs:
        return None
    tool = resolve_cuda_checkpoint(config)
    helps = subprocess.run([tool, "-h"], capture_output=True, text=True, timeout=30, check=False).stdout if tool else ""
    if "SNAPGUARD_DEVICE_MAP" not in helps:
        raise SnapguardError(Reason.GPU_IDENTITY_MISMATCH,
                             f"the image's GPUs are not here and {tool} cannot take a device map from CRIU's "
                             "plugin; install snapguard-cuda-checkpoint at the pinned path",
                             evidence={"device_map": pairs, "cuda_checkpoint": tool})
    return [(old, new) for old, new in pairs]


def checkpoint_pid(pid: int, images: str, config: Config, *, leave_running: bool = False,
                   tcp_established: bool = False, take_wait_s: float = 10.0) -> dict[str, Any]:
    t_start = time.monotonic()
    tree = workload.process_tree(pid)
    inv = workload.inventory(tree)
    report = Report(f"--pid {pid}")
    own_netns = workload.own_netns(pid)
    host_checks(report, config, gpu_required=inv.uses_gpu, network_lock=own_netns)
    found = take.trainers(tree)
    workload.run_checks(report, inv, tcp_established, trainers=found)
    conns = workload.tree_tcp(inv) if tcp_established else []
    # CRIU locks host-netns connections with iptables; connections between processes of the tree
    # are frozen with it and need no lock (and GPU nodes often have no iptables).
    network_lock = "skip" if workload.internal_only(conns) else None
    if conns and not network_lock and not own_netns:
        report.run("network-lock", host_checks_module.check_network_lock)
    report.raise_blockers()
    cuda_pids = [p.pid for p in inv.cuda_processes()]
    preflight_s = time.monotonic() - t_start

    figures, warnings, take_s = take.hold(found, cuda_pids, take_wait_s)
    ensure_private_dir(images)
    t0 = time.monotonic()
    try:
        suspend_s = gpu_suspend.suspend(cuda_pids, config.criu_timeout_s)
    except SnapguardError:
        take.release_all(found)
        raise
    argv = criu.dump_argv(config.criu, pid, images, images, leave_running=leave_running,
                          tcp_established=tcp_established, libdir=config.criu_libdir, network_lock=network_lock)
    rc = subprocess.run(argv, env=_env(config), stdin=subprocess.DEVNULL, check=False).returncode
    dump_s = time.monotonic() - t0
    if rc != 0:
        errors = criu.read_log_errors(os.path.join(images, "dump.log"))
        outcomes = gpu_suspend.resume(cuda_pids)
        take.release_all(found)
        intact = os.path.exists(f"/proc/{pid}") and not gpu_suspend.wedged(outcomes)
        raise SnapguardError(Reason.CRIU_DUMP_FAILED,
                             "; ".join(str(e) for e in errors) or f"criu dump exited {rc}",
                             workload_intact=intact,
                             evidence={"pid": pid, "criu_exit": rc, "cuda_recovery": outcomes,
                                       "errors": [{"where": e.where, "message": e.message, "context": e.context}
                                                  for e in errors]},
                             warnings=report.warnings + warnings)
    if leave_running:
        outcomes = gpu_suspend.resume(cuda_pids)  # restore and unlock: the dump is on disk
        take.release_all(found)  # the trainer need not wait for the seal
        wedged = gpu_suspend.wedged(outcomes)
        if wedged:
            raise SnapguardError(Reason.CUDA_STATE_WEDGED, f"after the dump: {wedged}", workload_intact=False,
                                 evidence={"cuda_recovery": outcomes})
    t0 = time.monotonic()
    gpu_facts = report.facts.get("gpu")
    manifest = image.seal(images, {
        "root_pid": pid,
        "bare": True,
        "own_netns": own_netns,
        "network_lock": network_lock,
        "tcp_connections": len(conns),
        "leave_running": leave_running,
        "criu_version": report.facts["criu_version"],
        "host": report.facts["host"],
        "processes": inv.summary(),
        "gpu": gpu.image_gpu_facts(gpu_facts, [p.pid for p in inv.procs]) if gpu_facts and cuda_pids else None,
        "take_point": {str(p): f for p, f in figures.items()},
    })
    seal_s = time.monotonic() - t0
    return {
        "ok": True, "operation": "checkpoint", "pid": pid, "images": images, "leave_running": leave_running,
        "cuda_pids": cuda_pids, "image_bytes": manifest["image_bytes"],
        "timings": {"preflight_s": preflight_s, "take_s": take_s, "cuda_suspend_s": suspend_s, "dump_s": dump_s,
                    "seal_s": seal_s,
                    "total_s": time.monotonic() - t_start},
        "criu_marks": criu.log_marks(os.path.join(images, "dump.log")),
        "take_point": figures, "warnings": [w.to_dict() for w in report.warnings + warnings],
    }


def _pid_conflicts(manifest: dict[str, Any], grace_s: float = 5.0) -> list[Finding]:
    """Pids of the image in use here. The processes a stop snapshot killed may still be zombies
    waiting for their new parent to reap them: those are given a few seconds to go."""
    wanted = [p["pid"] for p in manifest.get("processes", []) if isinstance(p, dict) and isinstance(p.get("pid"), int)]
    deadline = time.monotonic() + grace_s
    while any(process_state(p) == "Z" for p in wanted) and time.monotonic() < deadline:
        time.sleep(0.02)
    taken = [p for p in wanted if os.path.exists(f"/proc/{p}")]
    if not taken:
        return []
    return [Finding(Reason.PID_CONFLICT, f"pid(s) {', '.join(map(str, taken))} of the image are in use here",
                    evidence={"pids": taken})]


def restore_images(images: str, config: Config, *, tcp_established: bool = False) -> dict[str, Any]:
    t_start = time.monotonic()
    report = manifest_report(images, config)
    if "manifest" in report.facts:
        report.run("pid-conflicts", lambda: _pid_conflicts(report.facts["manifest"]))
    report.raise_blockers()
    manifest = report.facts["manifest"]
    preflight_s = time.monotonic() - t_start
    pidfile = os.path.join(images, "restored.pid")
    if os.path.exists(pidfile):
        os.unlink(pidfile)
    t0 = time.monotonic()
    argv = criu.restore_argv(config.criu, images, images, pidfile, tcp_established=tcp_established,
                             libdir=config.criu_libdir,
                             network_lock="skip" if manifest.get("network_lock") == "skip" else None)
    rc = subprocess.run(argv, env=_env(config, _device_map(report, config)), stdin=subprocess.DEVNULL,
                        check=False).returncode
    restore_s = time.monotonic() - t0
    if rc != 0:
        errors = criu.read_log_errors(os.path.join(images, "restore.log"))
        raise SnapguardError(Reason.CRIU_RESTORE_FAILED, "; ".join(str(e) for e in errors) or f"criu exited {rc}",
                             evidence={"images": images, "criu_exit": rc,
                                       "errors": [{"where": e.where, "message": e.message} for e in errors]},
                             warnings=report.warnings)
    with open(pidfile) as f:
        pid = int(f.read().strip())
    cuda_pids = [p["pid"] for p in manifest["processes"] if isinstance(p, dict) and p.get("gpu")]
    states = {}
    if cuda_pids:
        from . import cuda

        driver = cuda.load()
        states = {p: driver.state(p) for p in cuda_pids}
        if any(s != "running" for s in states.values()):
            raise SnapguardError(Reason.CUDA_RESTORE_FAILED, f"restored CUDA processes are not running: {states}",
                                 workload_intact=False, evidence={"states": states})
    if not os.path.exists(f"/proc/{pid}"):
        raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"restored pid {pid} is gone", workload_intact=False,
                             evidence={"pid": pid})
    if manifest.get("take_point"):
        take.release_all(take.trainers(workload.process_tree(pid)))
    return {"ok": True, "operation": "restore", "pid": pid, "images": images, "cuda_states": states,
            "timings": {"preflight_s": preflight_s, "restore_s": restore_s, "total_s": time.monotonic() - t_start},
            "criu_marks": criu.log_marks(os.path.join(images, "restore.log")),
            "warnings": [w.to_dict() for w in report.warnings]}
