"""Why does a restored trainer step slower than a fresh one when several share a GPU?

The goodput drill on the H200 (bench/results/h200x2/goodput-h200-2026-11-30.json) saw every arm
that had been restored step at 0.126-0.129 s against 0.087-0.089 s for the arms never restored, five
trainers sharing one GPU; alone on the GPU a restored trainer steps like a fresh one
(step-rate-*.json). This probe separates the candidate causes, each phase measuring for --phase-s:

  alone     one trainer with a GPU-bound batch (--alone-batch), by itself: before, after a
            leave-running snapshot (the driver's checkpoint + restore inside the same process, CRIU
            dumps only) and after a stop + restore (CRIU rebuilds the process). A GPU-side cause
            (the restored device memory mapped differently) shows here, where a small batch hides
            it behind the CPU.
  shared    --shared trainers with the drill's batch on one GPU (five, as in the goodput drill):
            all fresh; then --restore of them (R*) stopped and restored while the others (F*) run
            on; then R1 moves its tensors into fresh device allocations (train.py's SIGUSR2: a restored
            mapping that costs more on every context switch would show); then F1 snapshotted
            leave-running. nvidia-smi pmon samples each window.
  parity    --shared fresh trainers; then --restore of them (T*) put through the driver's checkpoint
            and restore in place (lock, checkpoint, restore, unlock: the goodput drill's context
            parity) while the others (F*) run on.

Per trainer and window: steps, median step time, CPU seconds per step (utime + stime from
/proc/PID/stat), context switches per step, and the process's placement: CPU affinity, nice and
policy, cgroup, timer slack, threads, anonymous and transparent-huge-page memory (smaps_rollup).
Writes OUT_DIR/share-probe.json and prints a table.

    source bench/gpu/setup.sh && python3 bench/gpu/share_probe.py OUT_DIR
    python3 bench/gpu/share_probe.py OUT_DIR --trainer-args "--device cpu --width 64 --layers 2"  # no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from snapguard import gpu_suspend
from snapguard.config import load
from snapguard.pipeline import checkpoint_pid, restore_images
from snapguard_lab.torch_drill import Trainer

BASE = Path("/root/sg-share-probe")


def _read(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_text()
    except OSError:
        return ""


def placement(pid: int) -> dict[str, Any]:
    """Where the kernel runs the process and what backs its memory."""
    status = dict(line.split(":", 1) for line in _read(pid, "status").splitlines() if ":" in line)
    rollup = dict(line.split(":", 1) for line in _read(pid, "smaps_rollup").splitlines()[1:] if ":" in line)
    stat = _read(pid, "stat")
    fields = stat[stat.rfind(")") + 2:].split() if stat else []
    kb = lambda d, k: int(d.get(k, "0 kB").split()[0])  # noqa: E731
    return {
        "cpus_allowed": status.get("Cpus_allowed_list", "").strip(),
        "threads": int(status.get("Threads", "0")),
        "nice": int(fields[16]) if len(fields) > 16 else None,
        "policy": int(fields[38]) if len(fields) > 38 else None,
        "cgroup": _read(pid, "cgroup").strip(),
        "timerslack_ns": _read(pid, "timerslack_ns").strip(),
        "anon_kb": kb(rollup, "Anonymous"), "anon_huge_kb": kb(rollup, "AnonHugePages"),
        "rss_kb": kb(rollup, "Rss"),
        "thp_setting": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
        "numa_maps_huge": sum(1 for line in _read(pid, "numa_maps").splitlines() if "huge" in line),
    }


def counters(pid: int) -> tuple[float, int]:
    """(CPU seconds used, context switches) of the whole process, its threads included."""
    stat = _read(pid, "stat")
    fields = stat[stat.rfind(")") + 2:].split() if stat else []
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick if len(fields) > 12 else 0.0
    status = dict(line.split(":", 1) for line in _read(pid, "status").splitlines() if ":" in line)
    switches = int(status.get("voluntary_ctxt_switches", "0")) + int(status.get("nonvoluntary_ctxt_switches", "0"))
    return cpu, switches


def pmon() -> list[str]:
    """nvidia-smi's per-process SM and memory utilisation, three one-second samples."""
    try:
        done = subprocess.run(["/usr/bin/nvidia-smi", "pmon", "-c", "3", "-s", "u"], capture_output=True,
                              text=True, timeout=30)
        return done.stdout.splitlines()
    except (OSError, subprocess.SubprocessError) as e:
        return [f"{type(e).__name__}: {e}"]


def window(label: str, runs: dict[str, tuple[Trainer, int]], seconds: float) -> dict[str, Any]:
    """Every trainer's steps and costs over the next `seconds`."""
    start = {name: counters(pid) for name, (_, pid) in runs.items()}
    t0 = time.time()
    time.sleep(seconds)
    t1 = time.time()
    out: dict[str, Any] = {"window": label, "seconds": seconds, "trainers": {}, "pmon": pmon()}
    for name, (run, pid) in runs.items():
        cpu, sw = counters(pid)
        times = sorted(t for _, _, t, _ in run.rows() if t0 <= t <= t1)
        gaps = [b - a for a, b in zip(times, times[1:])]
        steps = max(len(times) - 1, 1)
        out["trainers"][name] = {
            "pid": pid, "steps": len(times),
            "median_step_s": statistics.median(gaps) if gaps else None,
            "mean_step_s": (times[-1] - times[0]) / steps if len(times) > 1 else None,
            "cpu_s_per_step": (cpu - start[name][0]) / steps,
            "switches_per_step": (sw - start[name][1]) / steps,
            "placement": placement(pid),
        }
    line = "  ".join(f"{n}: {t['median_step_s'] * 1000 if t['median_step_s'] else 0:7.1f} ms "
                     f"cpu {t['cpu_s_per_step'] * 1000:6.1f} ms/step thp {t['placement']['anon_huge_kb'] >> 10} MiB"
                     for n, t in out["trainers"].items())
    print(f"{label:<34} {line}", flush=True)
    for row in out["pmon"]:
        print(f"    {row}", flush=True)
    return out


def snapshot(run: Trainer, pid: int, config: Any, *, stop: bool) -> tuple[int, dict[str, Any]]:
    """A leave-running snapshot (same pid) or a stop + restore (the restored pid)."""
    images = str(BASE / f"{run.name}-{time.monotonic_ns()}.img")
    t0 = time.time()
    ck = checkpoint_pid(pid, images, config, leave_running=not stop, take_wait_s=10.0)
    info: dict[str, Any] = {"stop": stop, "image_bytes": ck["image_bytes"], "checkpoint_s": time.time() - t0}
    if stop:
        assert run.proc is not None
        run.proc.wait(timeout=60)
        t1 = time.time()
        rs = restore_images(images, config)
        pid = int(rs["pid"])
        run.restored_pid = pid
        info["restore_s"] = time.time() - t1
    shutil.rmtree(images, ignore_errors=True)
    return pid, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory for share-probe.json")
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds per measuring window (default 15)")
    ap.add_argument("--alone-batch", type=int, default=64, help="the GPU-bound batch of the alone phase")
    ap.add_argument("--trainer-args", default="", help="extra train.py arguments (the CPU check: --device cpu ...)")
    ap.add_argument("--phases", default="alone,shared", help="among alone, shared, parity (default alone,shared)")
    ap.add_argument("--shared", type=int, default=5, help="trainers sharing the GPU in the shared phase (default 5)")
    ap.add_argument("--restore", type=int, default=2, help="how many of them are stopped and restored (default 2)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("share_probe.py: run as root")
    # a timeout's SIGTERM ends the probe through the finally below: no trainer outlives it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("share_probe.py: terminated"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(BASE, ignore_errors=True)
    BASE.mkdir(mode=0o700, parents=True)
    config = load()
    take = os.path.join(config.state_dir, "take")
    extra = args.trainer_args.split()
    gpu_env = {"CUDA_VISIBLE_DEVICES": "0"}
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "phase_s": args.phase_s, "windows": [], "snapshots": []}
    phases = {p.strip() for p in args.phases.split(",")}
    trainers: list[Trainer] = []

    def start(name: str, batch: int) -> tuple[Trainer, int]:
        run = Trainer(BASE, name, 10 ** 7, trimmed=True, extra=["--batch", str(batch), *extra], env=gpu_env)
        trainers.append(run)
        return run, run.start(take)

    def settled(runs: dict[str, tuple[Trainer, int]]) -> dict[str, tuple[Trainer, int]]:
        for run, _ in runs.values():
            run.wait_step(30, timeout=300)
        return runs

    def save() -> None:
        (out_dir / "share-probe.json").write_text(json.dumps(report, indent=1, default=str) + "\n")

    try:
        if "alone" in phases:
            run, pid = settled({"alone": start("alone", args.alone_batch)})["alone"]
            report["windows"].append(window("alone: before", {"alone": (run, pid)}, args.phase_s))
            pid, info = snapshot(run, pid, config, stop=False)
            report["snapshots"].append({"trainer": "alone", **info})
            report["windows"].append(window("alone: after leave-running", {"alone": (run, pid)}, args.phase_s))
            pid, info = snapshot(run, pid, config, stop=True)
            report["snapshots"].append({"trainer": "alone", **info})
            report["windows"].append(window("alone: after stop + restore", {"alone": (run, pid)}, args.phase_s))
            os.kill(pid, 9)
            save()
        if "shared" in phases:
            # --shared trainers at the drill's batch; the first --restore of them are stopped and
            # restored (R*), the rest stay fresh (F*), and then one fresh one is snapshotted
            # leave-running: the driver's restore inside the same process, without CRIU's rebuild
            names = [f"R{i + 1}" if i < args.restore else f"F{i + 1 - args.restore}" for i in range(args.shared)]
            runs = settled({name: start(name, 16) for name in names})
            report["windows"].append(window("shared: all fresh", runs, args.phase_s))
            for name in [n for n in runs if n.startswith("R")]:
                run, pid = runs[name]
                pid, info = snapshot(run, pid, config, stop=True)
                runs[name] = (run, pid)
                report["snapshots"].append({"trainer": name, **info})
            time.sleep(3)
            report["windows"].append(window("shared: R* restored", runs, args.phase_s))
            if "R1" in runs:
                # the trainer's SIGUSR2: its tensors into fresh device allocations (train.py)
                os.kill(runs["R1"][1], signal.SIGUSR2)
                time.sleep(3)
                report["windows"].append(window("shared: R1 relocated", runs, args.phase_s))
            if "F1" in runs:
                run, pid = runs["F1"]
                pid, info = snapshot(run, pid, config, stop=False)
                runs["F1"] = (run, pid)
                report["snapshots"].append({"trainer": "F1", **info})
                report["windows"].append(window("shared: F1 after leave-running", runs, args.phase_s))
            save()
        if "parity" in phases:
            names = [f"T{i + 1}" if i < args.restore else f"F{i + 1 - args.restore}" for i in range(args.shared)]
            runs = settled({name: start(f"parity-{name}", 16) for name in names})
            report["windows"].append(window("parity: all fresh", runs, args.phase_s))
            for name in [n for n in runs if n.startswith("T")]:
                pid, t0 = runs[name][1], time.time()
                gpu_suspend.suspend([pid], 30.0)  # lock + checkpoint
                outcome = gpu_suspend.resume([pid])[pid]  # restore + unlock
                report["snapshots"].append({"trainer": name, "in_place_toggle_s": time.time() - t0,
                                            "outcome": outcome})
            time.sleep(3)
            report["windows"].append(window("parity: T* toggled in place", runs, args.phase_s))
            save()
    finally:
        for t in trainers:
            t.kill()
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
