"""First look on the GPU machine: the driver API through snapguard-cuda-checkpoint on a small CUDA
process (state, restore tid, toggle out and back, data intact), then a bare CRIU+plugin snapshot of it,
leave-running, and a stop snapshot restored."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from snapguard.config import load
from snapguard.pipeline import checkpoint_pid, restore_images

WORKER = r"""
import sys, time, torch
x = torch.arange(64 << 20, device="cuda", dtype=torch.float32)
s0 = float(x.sum())
out = open(sys.argv[1], "a", buffering=1)
i = 0
while True:
    i += 1
    x.mul_(1.0000001); torch.cuda.synchronize()
    out.write(f"{i} {float(x[12345]):.9g} {time.time():.6f}\n")
    time.sleep(0.02)
"""


def cli(*args: str) -> str:
    r = subprocess.run(["/usr/local/bin/cuda-checkpoint", *args], capture_output=True, text=True)
    return f"rc={r.returncode} out={r.stdout.strip()!r} err={r.stderr.strip()[:200]!r}"


def last(log: Path) -> int:
    lines = log.read_text().splitlines()
    return int(lines[-1].split()[0]) if lines else 0


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/smoke")
    work.mkdir(exist_ok=True)
    log = work / "worker.log"
    p = subprocess.Popen([sys.executable, "-c", WORKER, str(log)], stdin=subprocess.DEVNULL,
                         stdout=open(work / "worker.out", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    while not log.exists() or last(log) < 20:
        time.sleep(0.05)
    res: dict = {"pid": p.pid}
    res["help_mentions_action"] = "--action" in subprocess.run(["/usr/local/bin/cuda-checkpoint", "-h"],
                                                               capture_output=True, text=True).stdout
    res["get_state"] = cli("--get-state", "--pid", str(p.pid))
    res["restore_tid"] = cli("--get-restore-tid", "--pid", str(p.pid))
    res["not_cuda_state"] = cli("--get-state", "--pid", "1")
    t0 = time.perf_counter(); res["toggle_out"] = cli("--toggle", "--pid", str(p.pid)); res["toggle_out_s"] = time.perf_counter() - t0
    res["state_out"] = cli("--get-state", "--pid", str(p.pid))
    n = last(log); time.sleep(0.5); res["progress_while_checkpointed"] = last(log) - n
    t0 = time.perf_counter(); res["toggle_back"] = cli("--toggle", "--pid", str(p.pid)); res["toggle_back_s"] = time.perf_counter() - t0
    time.sleep(0.5)
    res["progress_after"] = last(log) - n
    config = load()
    t0 = time.perf_counter()
    ck = checkpoint_pid(p.pid, str(work / "lr.img"), config, leave_running=True)
    res["leave_running"] = {k: ck[k] for k in ("image_bytes", "timings", "cuda_pids", "warnings")}
    n = last(log); time.sleep(0.5); res["leave_running"]["progress_after"] = last(log) - n
    print(json.dumps(res, indent=1, default=str), flush=True)
    ck = checkpoint_pid(p.pid, str(work / "stop.img"), config, leave_running=False)
    p.wait()
    before = last(log)
    res["stop"] = {k: ck[k] for k in ("image_bytes", "timings")}
    rs = restore_images(str(work / "stop.img"), config)
    time.sleep(1.0)
    lines = log.read_text().splitlines()
    after = [l for l in lines if int(l.split()[0]) == before + 1]
    res["restore"] = {"timings": rs["timings"], "cuda_states": rs["cuda_states"], "last_before": before,
                      "continued_with": after[:1], "progress": last(log) - before}
    subprocess.run(["kill", "-9", str(rs["pid"])])
    (out / "smoke.json").write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
