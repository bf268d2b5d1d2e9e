"""Issue 4, nothing wedged: faults injected past the lock on a live trainer, which must finish
bit-identical to an uninterrupted reference run.

Faults, in one trainer run:
  1. copy fails: the image directory is a 64 MiB tmpfs, CRIU's page dump hits ENOSPC after the
     executor locked and checkpointed the process -> CRIU_DUMP_FAILED, process recovered;
  2. the driver-API path fails after checkpoint: lock + checkpoint through cuda-checkpoint, then
     the (simulated) copy fails -> snapguard.cuda.recover restores and unlocks;
  3. CRIU killed (SIGKILL) once the GPU state is checkpointed, the process left behind checkpointed
     and seized -> recover restores and unlocks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from snapguard import criu, cuda
from snapguard.config import load
from snapguard.pipeline import checkpoint_pid
from snapguard.gpu_suspend import resume as recover_cuda
from snapguard.reasons import SnapguardError
from snapguard_lab.torch_drill import Trainer, compare


def main() -> int:
    out = Path(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 150
    base = Path("/tmp/faults")
    base.mkdir(parents=True, exist_ok=True)
    config = load()
    ref = Trainer(base, "reference", steps)
    ref.start()
    ref_result = ref.wait_done()
    run = Trainer(base, "faulted", steps)
    pid = run.start()
    driver = cuda.load()
    faults = []

    # 1. copy fails
    run.wait_step(30)
    tiny = base / "tiny"
    tiny.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(tiny)], check=True)
    try:
        checkpoint_pid(pid, str(tiny / "img"), config, leave_running=True)
        faults.append({"fault": "copy fails (ENOSPC)", "refused": False})
    except SnapguardError as e:
        faults.append({"fault": "copy fails (ENOSPC)", "reason": e.reason.name,
                       "workload_intact": e.failure.workload_intact,
                       "recovery": e.failure.evidence.get("cuda_recovery"), "state_after": driver.state(pid),
                       "criu_errors": [x["message"] for x in e.failure.evidence.get("errors", [])][:2]})
    finally:
        subprocess.run(["umount", str(tiny)], check=False)

    # 2. driver-API path: lock + checkpoint, then the copy "fails"
    run.wait_step(60)
    cli = ["/usr/local/bin/cuda-checkpoint"]
    subprocess.run([*cli, "--action", "lock", "--pid", str(pid), "--timeout", "10000"], check=True)
    subprocess.run([*cli, "--action", "checkpoint", "--pid", str(pid)], check=True)
    held = subprocess.run([*cli, "--get-state", "--pid", str(pid)], capture_output=True, text=True).stdout.strip()
    time.sleep(1.0)
    outcome = recover_cuda([pid])
    faults.append({"fault": "failure after driver checkpoint", "state_held": held, "recovery": outcome,
                   "state_after": driver.state(pid)})

    # 3. CRIU killed once the GPU state is checkpointed
    run.wait_step(90)
    img = base / "killed.img"
    img.mkdir(exist_ok=True)
    argv = criu.dump_argv(config.criu, pid, str(img), str(img), leave_running=True, tcp_established=False,
                          libdir=config.criu_libdir)
    dumper = subprocess.Popen(argv, env=criu.prepare_environment(config, config.criu))
    seen = "running"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and dumper.poll() is None:
        try:
            seen = driver.state(pid)
        except cuda.CudaError:
            seen = "error"
        if seen == "checkpointed":
            dumper.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    dumper.wait()
    time.sleep(0.5)
    outcome = recover_cuda([pid])
    faults.append({"fault": "criu SIGKILLed after GPU checkpoint", "state_when_killed": seen,
                   "criu_exit": dumper.returncode, "recovery": outcome,
                   "state_after": driver.state(pid) if os.path.exists(f"/proc/{pid}") else "gone"})

    result = run.wait_done(timeout=600)
    verdict = compare(ref, run, ref_result, result)
    report = {"steps": steps, "faults": faults, **verdict}
    (out / "faults.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report, indent=1, default=str))
    ok = verdict["bit_identical"] and all(f.get("state_after") == "running" for f in faults)
    print("faults:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
