"""Issue 5 on the lent GPUs: 2 ranks (torch.distributed with gloo; on one GPU they share it, on two
each has its own), held at one common step by the take point, locked and checkpointed together by
the executor (every rank locked before any is checkpointed), dumped by CRIU as one tree, restored,
and compared bit for bit with an uninterrupted reference run. With --nccl also a 2-rank NCCL job,
which preflight must refuse with NCCL_UNSUPPORTED."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from snapguard.config import load
from snapguard.pipeline import checkpoint_pid, restore_images
from snapguard_lab.ddp import DdpJob


def main() -> int:
    out, base = Path(sys.argv[1]), Path(f"/tmp/ranks-{int(time.time())}")
    config = load()
    take_dir = f"{config.state_dir}/take"
    import torch

    ref = DdpJob(base / "reference", 2, 60, device="cuda")
    report: dict = {"gpus": torch.cuda.device_count()}
    if "--nccl-only" not in sys.argv:
        report["reference_results"] = ref.run_uninterrupted().results()
    if "--nccl" in sys.argv:
        from snapguard.preflight import pid_report

        nccl = DdpJob(base / "nccl", 2, 400, device="cuda", backend="nccl")
        launcher = nccl.start(take_dir)
        try:
            nccl.wait_step(5)
            pre = pid_report(launcher.pid, config, tcp_established=True)
            report["nccl"] = {"verdict": pre.verdict, "blockers": [b.to_dict() for b in pre.blockers]}
            try:  # the executor refuses it before anything is frozen, and the job trains on
                checkpoint_pid(launcher.pid, str(base / "nccl.img"), config, leave_running=True,
                               tcp_established=True)
                report["nccl"]["checkpoint"] = "not refused"
            except Exception as e:
                report["nccl"]["checkpoint"] = str(e)
            n = max(nccl.rows(0))
            nccl.wait_step(n + 5)
            report["nccl"]["still_training"] = True
        finally:
            subprocess.run(["pkill", "-9", "-s", str(launcher.pid)], check=False)
        print("nccl", json.dumps(report["nccl"], default=str), flush=True)
    for leave_running in (() if "--nccl-only" in sys.argv else (True, False)):
        name = "leave-running" if leave_running else "stop-restore"
        job = DdpJob(base / name, 2, 60, device="cuda")
        launcher = job.start(take_dir)
        try:
            job.wait_step(20)
            ck = checkpoint_pid(launcher.pid, str(base / f"{name}.img"), config, leave_running=leave_running,
                                tcp_established=True)
            arm = {"take_point": ck["take_point"], "cuda_pids": ck["cuda_pids"], "image_bytes": ck["image_bytes"],
                   "checkpoint": ck["timings"]}
            if not leave_running:
                launcher.wait(timeout=60)
                rs = restore_images(str(base / f"{name}.img"), config, tcp_established=True)
                arm.update(restore=rs["timings"], cuda_states=rs["cuda_states"])
            arm["mismatches"] = job.mismatches(ref)
            arm["bit_identical"] = not arm["mismatches"]
        except Exception as e:  # record and go on to the next arm
            arm = {"error": f"{type(e).__name__}: {e}"}
        finally:
            subprocess.run(["pkill", "-9", "-s", str(launcher.pid)], check=False)
        report[name] = arm
        print(name, json.dumps(arm, default=str), flush=True)
    suffix = "-nccl" if "--nccl-only" in sys.argv else ""
    (out / f"ranks-{report['gpus']}gpu{suffix}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    ok = all(report[a].get("bit_identical") and len(report[a].get("cuda_pids", [])) == 2
             for a in ("leave-running", "stop-restore") if a in report)
    if "nccl" in report:
        ok = ok and any(b["reason"] == "NCCL_UNSUPPORTED" for b in report["nccl"]["blockers"])
    print(f"two ranks on {report['gpus']} GPU(s):", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
