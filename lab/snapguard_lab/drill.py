"""`snapguard-lab drill`: a real snapshot drill through containerd, snapguard-runc, runc and CRIU.

Two variants on the counter workload (package data, `workloads/counter`):
- leave-running: `ctr containers checkpoint --task` snapshots the running container, which goes on
  running; it is then killed, and `ctr containers restore --live` brings the snapshot back.
- exit: `ctr tasks checkpoint --exit --image-path` stops the container as it is dumped; the image is
  restored through `snapguard-runc restore` into the same bundle (containerd 1.6's ctr cannot restore
  from an image path), in containerd's environment: the same snapguard config and real runc.
Each restore must continue exactly: the first new line follows a value the workload had reached
at the snapshot, with the hash chain over every earlier value intact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .testbed import Containerd, CounterLog, snapguard_runc_path

__all__ = ["run_drill", "drill_leave_running", "drill_exit"]


def _rotate(log: CounterLog, suffix: str) -> CounterLog:
    before = log.path.with_name(log.path.name + suffix)
    log.path.rename(before)
    return CounterLog(before)


def _verdict(before: CounterLog, after: CounterLog, low: int, high: int) -> dict[str, Any]:
    """The restored run continued where the snapshot stopped if its first value k has
    low < k <= high + 1 and the hash chain holds across the restore."""
    first = after.values()[0] if after.values() else (0, 0)
    errors = after.chain_errors()
    continued = low < first[0] <= high + 1 and not errors
    return {"snapshot_between": [low, high], "last_before": before.last(), "first_after": first[0],
            "chain_errors": errors[:3], "continued": continued}


def drill_leave_running(ctd: Containerd, runc_binary: str, out_dir: Path, cid: str = "drill-lr") -> dict[str, Any]:
    log = CounterLog(out_dir / "counter.log")
    ctd.run_counter(cid, str(out_dir), runc_binary)
    log.wait_for(20)
    ref = f"snapguard.local/checkpoint-{cid}:1"
    low = log.last()
    t0 = time.monotonic()
    ctd.ctr("containers", "checkpoint", "--task", cid, ref)
    checkpoint_s = time.monotonic() - t0
    high = log.last()
    kept_running = ctd.task_status(cid) == "RUNNING" and log.wait_for(len(log.values()) + 5) > high
    ctd.remove(cid)
    before = _rotate(log, ".before")
    t0 = time.monotonic()
    ctd.ctr("containers", "restore", "--live", cid, ref)
    restore_s = time.monotonic() - t0
    log.wait_for(10)
    result = {"variant": "leave-running", "checkpoint_s": checkpoint_s, "restore_s": restore_s,
              "kept_running": kept_running, **_verdict(before, log, low, high)}
    ctd.remove(cid)
    return result


def drill_exit(ctd: Containerd, runc_binary: str, out_dir: Path, cid: str = "drill-exit") -> dict[str, Any]:
    log = CounterLog(out_dir / "counter.log")
    ctd.run_counter(cid, str(out_dir), runc_binary)
    log.wait_for(20)
    image_dir, work_dir = out_dir / "image", out_dir / "work"
    # containerd deletes the task's bundle when the task exits: keep its config to restore into.
    bundle = out_dir / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    shutil.copy(ctd.bundle_dir(cid) / "config.json", bundle / "config.json")
    t0 = time.monotonic()
    ctd.ctr("tasks", "checkpoint", "--exit", "--image-path", str(image_dir), "--work-path", str(work_dir), cid)
    checkpoint_s = time.monotonic() - t0
    high = log.last()
    time.sleep(0.3)
    stopped = log.last() == high and ctd.task_status(cid) in ("STOPPED", None)
    before = _rotate(log, ".before")
    ctd.mount_snapshot(cid, bundle / "rootfs")
    restored_id = f"{cid}-restored"
    t0 = time.monotonic()
    proc = subprocess.run([runc_binary, "--root", str(out_dir / "runc"), "restore", "--image-path", str(image_dir),
                           "--work-path", str(out_dir / "restore-work"), "--bundle", str(bundle), "--detach",
                           "--pid-file", str(out_dir / "restored.pid"), restored_id],
                          capture_output=True, text=True, timeout=120, check=False, env=ctd.env)
    restore_s = time.monotonic() - t0
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"snapguard-runc restore failed: {proc.stderr.strip()}")
        log.wait_for(10)
    finally:
        runc = [runc_binary, "--root", str(out_dir / "runc")]
        subprocess.run([*runc, "kill", restored_id, "KILL"], capture_output=True, check=False, env=ctd.env)
        time.sleep(0.2)
        subprocess.run([*runc, "delete", "--force", restored_id], capture_output=True, check=False, env=ctd.env)
        subprocess.run(["/usr/bin/umount", "-l", str(bundle / "rootfs")], capture_output=True, check=False)
    result = {"variant": "exit", "checkpoint_s": checkpoint_s, "restore_s": restore_s,
              "stopped_at_dump": stopped,
              "image_bytes": sum(p.stat().st_size for p in image_dir.iterdir() if p.is_file()),
              **_verdict(before, log, high, high)}
    ctd.remove(cid)
    return result


def _table(results: list[dict[str, Any]]) -> str:
    head = f"{'variant':<14} {'checkpoint s':>12} {'restore s':>9} {'snapshot at':>12} {'first after':>11}  continued"
    rows = [head, "-" * len(head)]
    for r in results:
        low, high = r["snapshot_between"]
        at = str(high) if low == high else f"{low}..{high}"
        rows.append(f"{r['variant']:<14} {r['checkpoint_s']:>12.2f} {r['restore_s']:>9.2f} {at:>12} "
                    f"{r['first_after']:>11}  {'yes' if r['continued'] else 'NO'}")
    return "\n".join(rows)


def run_drill(json_path: str | None = None, workdir: str | None = None, stack: str = "debian12") -> int:
    """The drill on one containerd/runc stack (testbed.STACKS)."""
    if os.geteuid() != 0:
        print("snapguard-lab INSUFFICIENT_PRIVILEGE: the drill runs containerd and CRIU and needs root",
              file=sys.stderr)
        return 1
    base = Path(workdir or tempfile.mkdtemp(prefix="snapguard-drill-"))
    runc_binary = snapguard_runc_path()
    ctd = Containerd(str(base / "containerd"), stack=stack)
    print(f"drill: containerd in {ctd.workdir} ({ctd.stack.containerd}), runc binary {runc_binary} "
          f"in front of {ctd.runc}")
    try:
        ctd.start()
        ctd.import_counter_image()
        results = [drill_leave_running(ctd, runc_binary, base / "leave-running"),
                   drill_exit(ctd, runc_binary, base / "exit")]
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
        print(f"drill: FAIL: {e}", file=sys.stderr)
        return 1
    finally:
        ctd.stop()
    print(_table(results))
    ok = all(r["continued"] for r in results)
    if json_path:
        Path(json_path).write_text(json.dumps({"ok": ok, "results": results}, indent=2) + "\n")
    if not workdir:
        shutil.rmtree(base, ignore_errors=True)
    print("drill: PASS" if ok else "drill: FAIL")
    return 0 if ok else 1
