"""Where one cuda-checkpoint run's time goes, on a live CUDA process (run on the GPU machine).

CRIU's CUDA plugin runs `cuda-checkpoint` eight times per leave-running snapshot (restore thread id
three times, state, lock, checkpoint, restore, unlock) while the trainer is stalled, so each run's
fixed cost counts eight times. This measures, against the same live process:
  the interpreter's start (python3 -c pass, and with -S),
  a whole `cuda-checkpoint --get-state` and `--get-restore-tid` run,
  the driver calls in-process: the first call without cuInit, cuInit, and each action,
  each action through the tool (lock, checkpoint, restore, unlock, three cycles),
and checks that the process's GPU data survived every cycle. Prints a table, writes JSON.

    python3 bench/gpu/cuda_tool.py OUT.json
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time

from snapguard.cuda import Driver

WORKER = r"""
import sys, time, torch
x = torch.arange(64 << 20, device="cuda", dtype=torch.float32)  # 256 MiB
want = float(x.sum())
print("ready", flush=True)
for line in sys.stdin:  # one line per check: answers whether the data is intact
    torch.cuda.synchronize()
    print("intact" if float(x.sum()) == want else "CHANGED", flush=True)
"""


def wall(argv: list[str], n: int = 5) -> tuple[float, str]:
    times, out = [], ""
    for _ in range(n):
        t0 = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - t0)
        out = (done.stdout or done.stderr).strip()
        if done.returncode != 0:
            raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr.strip()}")
    return statistics.median(times), out


def timed(fn, *args):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> int:
    tool = shutil.which("cuda-checkpoint") or sys.exit("no cuda-checkpoint on PATH")
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert worker.stdin and worker.stdout
    assert worker.stdout.readline().strip() == "ready"
    pid = str(worker.pid)

    def intact() -> bool:
        worker.stdin.write("check\n")
        worker.stdin.flush()
        return worker.stdout.readline().strip() == "intact"

    rows: dict[str, float | str | bool] = {}
    rows["python3 -c pass"], _ = wall([sys.executable, "-c", "pass"])
    rows["python3 -S -c pass"], _ = wall([sys.executable, "-S", "-c", "pass"])
    rows["tool --get-state"], rows["state"] = wall([tool, "--get-state", "--pid", pid])
    rows["tool --get-restore-tid"], _ = wall([tool, "--get-restore-tid", "--pid", pid])

    t0 = time.perf_counter()
    driver = Driver()
    rows["in-process: load libcuda + cdef"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows["in-process: state"] = driver.state(worker.pid)
    rows["in-process: first state call"] = time.perf_counter() - t0
    rows["in-process: needed cuInit"] = driver._initialised
    if not driver._initialised:
        rows["in-process: cuInit"] = timed(driver.init)

    cycles = []
    for _ in range(3):
        c = {"tool lock": wall([tool, "--action", "lock", "--pid", pid, "--timeout", "10000"], 1)[0],
             "tool checkpoint": wall([tool, "--action", "checkpoint", "--pid", pid], 1)[0],
             "tool restore": wall([tool, "--action", "restore", "--pid", pid], 1)[0],
             "tool unlock": wall([tool, "--action", "unlock", "--pid", pid], 1)[0]}
        c["intact"] = intact()
        c["driver lock"] = timed(driver.lock, worker.pid, 10000)
        c["driver checkpoint"] = timed(driver.checkpoint, worker.pid)
        c["driver restore"] = timed(driver.restore, worker.pid)
        c["driver unlock"] = timed(driver.unlock, worker.pid)
        c["intact after driver cycle"] = intact()
        cycles.append(c)
    for key in cycles[0]:
        vals = [c[key] for c in cycles]
        rows[f"cycle: {key}"] = all(vals) if isinstance(vals[0], bool) else statistics.median(vals)
    worker.stdin.close()
    worker.wait(timeout=60)

    for key, v in rows.items():
        print(f"{key:<40} {v:.4f} s" if isinstance(v, float) else f"{key:<40} {v}")
    with open(sys.argv[1], "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "tool": tool, "rows": rows, "cycles": cycles}, f, indent=2)
    ok = all(c["intact"] and c["intact after driver cycle"] for c in cycles)
    print("cuda tool: PASS" if ok else "cuda tool: FAIL (GPU data changed)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
