"""`snapguard-runc restore`: refuse a bad image first, then the real runc restore, then confirm."""

from __future__ import annotations

import os
from typing import Any

from .. import criu
from ..config import Config
from .._host import process_state
from ..reasons import Reason, SnapguardError
from ._argv import GlobalOptions, SubcommandArgs
from ..hooks import take
from ..preflight import manifest_report, workload
from ._runc import criu_path, prepared_env, run_real, runc_command, runc_state

__all__ = ["restore"]


def _restored_pid(runc: str, opts: GlobalOptions, sub: SubcommandArgs) -> int:
    pid_file = sub.value("pid-file")
    if pid_file:
        try:
            with open(pid_file) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            pass
    return int(runc_state(runc, opts, sub.container_id)["pid"])


def restore(runc: str, args: list[str], opts: GlobalOptions, sub: SubcommandArgs, config: Config) -> dict[str, Any]:
    criu_bin = criu_path(opts, config)
    report = manifest_report(sub.image_path, config, criu=criu_bin)
    report.raise_blockers()
    manifest = report.facts["manifest"]

    os.makedirs(sub.work_path, mode=0o700, exist_ok=True)
    rc = run_real(runc_command(runc, args, opts, config), prepared_env(config, criu_bin))
    if rc != 0:
        log = os.path.join(sub.work_path, "restore.log")
        errors = criu.read_log_errors(log)
        quoted = "; ".join(str(e) for e in errors) or f"runc exited {rc}, no CRIU error in {log}"
        raise SnapguardError(Reason.CRIU_RESTORE_FAILED, quoted,
                             evidence={"container": sub.container_id, "runc_exit": rc, "log": log,
                                       "errors": [{"where": e.where, "message": e.message, "context": e.context}
                                                  for e in errors]},
                             warnings=report.warnings)
    pid = _restored_pid(runc, opts, sub)
    status = process_state(pid)
    if status in ("gone", "Z", "X"):
        raise SnapguardError(Reason.CRIU_RESTORE_FAILED,
                             f"runc restore succeeded but restored pid {pid} is {status}",
                             evidence={"container": sub.container_id, "pid": pid})
    if manifest.get("take_point"):
        # the workload was held at its take point when dumped: let it go on
        take.release_all(take.trainers(workload.process_tree(pid)))
    return {
        "ok": True,
        "operation": "restore",
        "container": sub.container_id,
        "image": sub.image_path,
        "pid": pid,
        "criu_marks": criu.log_marks(os.path.join(sub.work_path, "restore.log")),
        "image_epoch": manifest["epoch"],
        "warnings": [w.to_dict() for w in report.warnings],
    }
