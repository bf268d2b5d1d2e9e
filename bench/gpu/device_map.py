"""The device map against the real driver, as far as one GPU allows (run on the GPU machine).

A restore onto other GPUs passes CUcheckpointGpuPair entries in the restore arguments. With one
GPU the only valid map is the GPU onto itself, which still checks the struct layout and the
gating on the driver version against the real driver; a map naming a GPU that is not there must
fail typed and leave the process recoverable. Each case runs on a live CUDA process whose GPU
data is checked afterwards:
  1. driver: lock, checkpoint, restore with the identity pair, unlock
  2. cuda-checkpoint --action restore --device-map OLD=NEW (the CLI flag)
  3. cuda-checkpoint --action restore with SNAPGUARD_DEVICE_MAP (how CRIU's plugin gets it)
  4. a pair onto a UUID no GPU has: an error, then recovery to running
Prints one line per case, writes JSON.

    python3 bench/gpu/device_map.py OUT.json
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from snapguard.cuda import CudaError, recover
from snapguard.cuda import Driver
from snapguard.preflight.gpu import gpu_facts

WORKER = r"""
import sys, torch
x = torch.arange(64 << 20, device="cuda", dtype=torch.float32)
want = float(x.sum())
print("ready", flush=True)
for line in sys.stdin:
    torch.cuda.synchronize()
    print("intact" if float(x.sum()) == want else "CHANGED", flush=True)
"""
ABSENT_GPU = "GPU-00000000-1111-2222-3333-444444444444"


def main() -> int:
    tool = shutil.which("cuda-checkpoint") or sys.exit("no cuda-checkpoint on PATH")
    facts = gpu_facts()
    uuid = facts["gpus"][0]["uuid"] if facts and facts.get("gpus") else sys.exit("no GPU facts (NVML)")
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert worker.stdin and worker.stdout and worker.stdout.readline().strip() == "ready"
    pid = worker.pid
    driver = Driver()

    def intact() -> bool:
        worker.stdin.write("check\n")
        worker.stdin.flush()
        return worker.stdout.readline().strip() == "intact"

    def suspended() -> None:
        driver.lock(pid, 10000)
        driver.checkpoint(pid)

    def run_tool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([tool, *args], capture_output=True, text=True, check=False,
                              env={**os.environ, **(env or {})})

    cases = []

    def case(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            detail = fn()
            ok = True
        except (CudaError, AssertionError) as e:
            detail, ok = f"{type(e).__name__}: {e}", False
        state = driver.state(pid)
        if state != "running":  # a failed case must not leave the worker blocked for the next
            recover(driver, pid)
        row = {"case": name, "ok": ok and state == "running" and intact(), "detail": detail, "state_after": state,
               "seconds": round(time.perf_counter() - t0, 3)}
        cases.append(row)
        print(json.dumps(row), flush=True)

    def identity_by_driver() -> str:
        suspended()
        driver.restore(pid, [(uuid, uuid)])
        driver.unlock(pid)
        return "restored with the pair"

    def identity_by_flag() -> str:
        suspended()
        done = run_tool("--action", "restore", "--pid", str(pid), "--device-map", f"{uuid}={uuid}")
        assert done.returncode == 0, done.stderr
        driver.unlock(pid)
        return "cuda-checkpoint --device-map restored"

    def identity_by_env() -> str:
        suspended()
        done = run_tool("--action", "restore", "--pid", str(pid), env={"SNAPGUARD_DEVICE_MAP": f"{uuid}={uuid}"})
        assert done.returncode == 0, done.stderr
        driver.unlock(pid)
        return "SNAPGUARD_DEVICE_MAP restored"

    def absent_gpu_refused() -> str:
        suspended()
        done = run_tool("--action", "restore", "--pid", str(pid), "--device-map", f"{uuid}={ABSENT_GPU}")
        found, _ = recover(driver, pid)
        assert done.returncode != 0, "a map onto an absent GPU was accepted"
        return f"refused ({done.stderr.strip()}); recovered from {found}"

    case("identity pair through the driver API", identity_by_driver)
    case("identity pair through --device-map", identity_by_flag)
    case("identity pair through SNAPGUARD_DEVICE_MAP", identity_by_env)
    case("pair onto an absent GPU", absent_gpu_refused)
    worker.stdin.close()
    worker.wait(timeout=60)
    ok = all(c["ok"] for c in cases)
    with open(sys.argv[1], "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "gpu": uuid, "driver_api": driver.version(), "cases": cases,
                   "ok": ok}, f, indent=2)
    print("device map: PASS" if ok else "device map: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
