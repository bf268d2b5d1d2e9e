"""Which GPU pairs does the driver's restore accept for a remap onto the other GPU (two GPUs)?

A live CUDA worker (64 Mi floats on its device 0) is locked and checkpointed, then restored
through cuCheckpointProcessRestore with a map, for each variant: the worker started with
CUDA_VISIBLE_DEVICES=0 or seeing both GPUs, the map naming GPU 0 -> 1 alone or the swap 0 <-> 1.
Reports the driver's answer, the state after, whether the data survived and the GPU (NVML) the
worker's memory is on afterwards. Prints one JSON line per case and writes them to OUT.

    python3 bench/gpu/remap_probe.py OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from snapguard.cuda import CudaError, Driver, recover
from snapguard.preflight.gpu import gpu_facts

WORKER = r"""
import sys, torch
x = torch.arange(64 << 20, device="cuda", dtype=torch.float32)
want = float(x.sum())
print("ready", flush=True)
for line in sys.stdin:
    torch.cuda.synchronize()
    y = x * 1  # new work on the (possibly new) GPU
    print("intact" if float(y.sum()) == want else "CHANGED", flush=True)
"""


def gpus_of(pid: int) -> list[int]:
    return [int(g["index"]) for g in (gpu_facts() or {}).get("gpus", []) if pid in g.get("processes", {})]


def main() -> int:
    facts = gpu_facts() or {}
    uuids = [g["uuid"] for g in facts.get("gpus", [])]
    if len(uuids) < 2:
        sys.exit("remap_probe.py: needs two GPUs")
    g0, g1 = uuids[0], uuids[1]
    driver = Driver()
    rows = []
    variants = [("visible 0, map 0->1", {"CUDA_VISIBLE_DEVICES": "0"}, [(g0, g1)]),
                ("visible 0,1, map 0->1", {}, [(g0, g1)]),
                ("visible 0,1, map 0<->1", {}, [(g0, g1), (g1, g0)]),
                ("visible 0, map 0<->1", {"CUDA_VISIBLE_DEVICES": "0"}, [(g0, g1), (g1, g0)])]
    for name, env, pairs in variants:
        w = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **env})
        assert w.stdin and w.stdout and w.stdout.readline().strip() == "ready"
        before = gpus_of(w.pid)
        t0 = time.perf_counter()
        try:
            driver.lock(w.pid, 10000)
            driver.checkpoint(w.pid)
            driver.restore(w.pid, pairs)
            driver.unlock(w.pid)
            answer = "ok"
        except CudaError as e:
            answer = f"{type(e).__name__}: {e}"
        state = driver.state(w.pid)
        if state != "running":
            recover(driver, w.pid)
            state += " (recovered: " + driver.state(w.pid) + ")"
        w.stdin.write("check\n")
        w.stdin.flush()
        data = w.stdout.readline().strip()
        row = {"case": name, "answer": answer, "state_after": state, "data": data, "gpus_before": before,
               "gpus_after": gpus_of(w.pid), "seconds": round(time.perf_counter() - t0, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        w.stdin.close()
        w.wait(timeout=60)
    with open(sys.argv[1], "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "driver": facts.get("driver_version"), "gpus": uuids,
                   "cases": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
