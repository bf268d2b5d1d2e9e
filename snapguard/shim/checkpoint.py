"""`snapguard-runc checkpoint`: check first, then the real runc checkpoint, then seal the image."""

from __future__ import annotations

import os
from typing import Any

from .. import criu, gpu_suspend, image
from ..config import Config
from ..files import ensure_private_dir
from ..hooks import take
from ..preflight import gpu, workload
from ..preflight._report import Report
from ..reasons import Reason, SnapguardError
from ._argv import GlobalOptions, SubcommandArgs
from ..preflight import host_checks
from ._runc import criu_path, prepared_env, run_real, runc_command, runc_state

__all__ = ["checkpoint"]


def checkpoint(runc: str, args: list[str], opts: GlobalOptions, sub: SubcommandArgs, config: Config) -> dict[str, Any]:
    state = runc_state(runc, opts, sub.container_id)
    if state.get("status") not in ("running", "paused"):
        raise SnapguardError(Reason.CONTAINER_NOT_FOUND,
                             f"container {sub.container_id} is {state.get('status')}, not running",
                             evidence={"container": sub.container_id, "status": state.get("status")})
    tree = workload.process_tree(int(state["pid"]))
    found = take.trainers(tree)
    criu_bin = criu_path(opts, config)
    report = Report(f"container {sub.container_id}")
    inventory = workload.inventory(tree)
    own_netns = workload.own_netns(int(state["pid"]))
    # CRIU locks a namespace of the container's own, or each established connection in the host's,
    # with iptables; a container in the host's namespace with no connections needs no lock
    tcp = workload.tree_tcp(inventory) if sub.flag("tcp-established") else []
    host_checks(report, config, gpu_required=inventory.uses_gpu, criu=criu_bin, network_lock=own_netns or bool(tcp))
    workload.run_checks(report, inventory, tcp_established=sub.flag("tcp-established"), trainers=found)
    report.raise_blockers()
    cuda_pids = [p.pid for p in inventory.cuda_processes()]
    figures, take_warnings, _ = take.hold(found, cuda_pids, config.take_wait_s)

    ensure_private_dir(sub.image_path)
    os.makedirs(sub.work_path, mode=0o700, exist_ok=True)
    try:
        gpu_suspend.suspend(cuda_pids, config.criu_timeout_s)
    except SnapguardError:
        take.release_all(found)
        raise
    rc = run_real(runc_command(runc, args, opts, config), prepared_env(config, criu_bin))
    goes_on = rc != 0 or sub.flag("leave-running")  # the image is on disk, or there is none
    outcomes = gpu_suspend.resume(cuda_pids) if goes_on else {}
    if goes_on:
        take.release_all(found)
    if rc != 0:
        log = os.path.join(sub.work_path, "dump.log")
        errors = criu.read_log_errors(log)
        alive = os.path.exists(f"/proc/{state['pid']}") and not gpu_suspend.wedged(outcomes)
        quoted = "; ".join(str(e) for e in errors) or f"runc exited {rc}, no CRIU error in {log}"
        raise SnapguardError(Reason.CRIU_DUMP_FAILED, quoted, workload_intact=alive,
                             evidence={"container": sub.container_id, "runc_exit": rc, "log": log,
                                       "cuda_recovery": outcomes,
                                       "errors": [{"where": e.where, "message": e.message, "context": e.context}
                                                  for e in errors]},
                             warnings=report.warnings + take_warnings)
    wedged = gpu_suspend.wedged(outcomes)
    if wedged:
        raise SnapguardError(Reason.CUDA_STATE_WEDGED, f"after the dump: {wedged}", workload_intact=False,
                             evidence={"container": sub.container_id, "cuda_recovery": outcomes})
    try:
        manifest = image.seal(sub.image_path, {
            "container_id": sub.container_id,
            "leave_running": sub.flag("leave-running"),
            "own_netns": own_netns,
            "tcp_connections": len(tcp),
            "criu_version": report.facts["criu_version"],
            "host": report.facts["host"],
            "processes": inventory.summary(),
            "take_point": {str(p): f for p, f in figures.items()},
            "gpu": gpu.image_gpu_facts(report.facts["gpu"], [p.pid for p in inventory.procs])
            if report.facts.get("gpu") and inventory.uses_gpu else None,
        })
    except OSError as e:
        raise SnapguardError(Reason.IMAGE_WRITE_FAILED, f"sealing {sub.image_path}: {e}",
                             workload_intact=sub.flag("leave-running"),
                             evidence={"image": sub.image_path}) from None
    return {
        "ok": True,
        "operation": "checkpoint",
        "container": sub.container_id,
        "image": sub.image_path,
        "image_bytes": manifest["image_bytes"],
        "files": len(manifest["files"]),
        "take_point": figures,
        "criu_marks": criu.log_marks(os.path.join(sub.work_path, "dump.log")),
        "warnings": [w.to_dict() for w in report.warnings + take_warnings],
    }
