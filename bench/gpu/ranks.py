"""Issue 5 on the single lent GPU: 2 ranks sharing GPU 0 (torch.distributed with gloo), held at one
common step by the take point, locked and checkpointed together by CRIU's CUDA plugin as one tree,
restored, and compared bit for bit with an uninterrupted reference run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from snapguard._config import load
from snapguard.bare import checkpoint_pid, restore_images
from snapguard.testbed import DdpJob


def main() -> int:
    out, base = Path(sys.argv[1]), Path(f"/tmp/ranks-{int(time.time())}")
    config = load()
    take_dir = f"{config.state_dir}/take"
    ref = DdpJob(base / "reference", 2, 60, device="cuda")
    ref.start(None).wait(timeout=300)
    report: dict = {"reference_results": ref.results()}
    for leave_running in (True, False):
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
    (out / "ranks.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    ok = all(report[a].get("bit_identical") and len(report[a].get("cuda_pids", [])) == 2
             for a in ("leave-running", "stop-restore"))
    print("two ranks on one GPU:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
