"""`snapguard drill --workload torch`: snapshots of a live PyTorch trainer, compared bit for bit.

The examples/torch trainer runs uninterrupted as the reference; then with leave-running snapshots
and with stop snapshots that are restored, each untrimmed and trimmed (the take point releases
PyTorch's free reserve at a step boundary first); then the file-checkpoint baseline (torch.save +
fsync + rename, and a cold resume from it). Loss bits are compared at every step and digests of
parameters, optimizer and RNG state at the end. Needs root, an NVIDIA GPU, CRIU with its CUDA plugin
and a cuda-checkpoint (NVIDIA's or snapguard's).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._config import Config
from .bare import checkpoint_pid, restore_images
from .hooks import site_dir
from .reasons import SnapguardError

__all__ = ["Trainer", "run_torch_drill"]

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "torch" / "train.py"


@dataclass
class Trainer:
    """One run of examples/torch/train.py, started in its own session, logging to files."""

    workdir: Path
    name: str
    steps: int
    trimmed: bool = False
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    launched_at: float = 0.0

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def result(self) -> Path:
        return self.workdir / f"{self.name}.result.json"

    def start(self, take_dir: str | None = None) -> int:
        for stale in (self.log, self.result, self.workdir / f"{self.name}.out"):
            if stale.exists():
                raise RuntimeError(f"{stale} exists: a drill needs a fresh working directory")
        env = dict(os.environ)
        if self.trimmed and take_dir:
            # the take point: no change to the trainer, only its environment
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [site_dir(), str(TRAIN.parent.parent.parent),
                                                              env.get("PYTHONPATH")]))
            env["SNAPGUARD_TAKE_DIR"] = take_dir
        out = open(self.workdir / f"{self.name}.out", "ab")  # O_APPEND: restorable after growth
        self.launched_at = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, str(TRAIN), "--steps", str(self.steps), "--log", str(self.log),
             "--result", str(self.result), *self.extra],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True)
        out.close()
        return self.proc.pid

    def rows(self) -> list[tuple[int, str, float, int]]:
        """(step, loss bits, time, reserved bytes) per logged step."""
        out = []
        try:
            lines = self.log.read_text().splitlines()
        except FileNotFoundError:
            return []
        for line in lines:
            parts = line.split()
            if len(parts) == 5 and parts[0] == "step":
                out.append((int(parts[1]), parts[2], float(parts[3]), int(parts[4])))
        return out

    def wait_step(self, step: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.rows()
            if rows and rows[-1][0] >= step:
                return
            if self.proc is not None and self.proc.poll() is not None and not self.result.exists():
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}; see {self.name}.out")
            time.sleep(0.01)
        raise TimeoutError(f"{self.name} did not reach step {step}")

    def wait_done(self, timeout: float = 900, pid: int | None = None) -> dict[str, Any]:
        """The run's result; `pid` names a restored process (not our child) to watch instead."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.result.exists():
                if self.proc is not None and pid is None:
                    self.proc.wait(timeout=60)
                return json.loads(self.result.read_text())
            gone = (self.proc.poll() is not None) if pid is None and self.proc else \
                (pid is not None and not os.path.exists(f"/proc/{pid}"))
            if gone and not self.result.exists():
                raise RuntimeError(f"{self.name} exited without a result; see {self.name}.out")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not finish")


def compare(ref: Trainer, run: Trainer, ref_result: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    want = {s: bits for s, bits, _, _ in ref.rows()}
    got: dict[int, list[str]] = {}
    for s, bits, _, _ in run.rows():
        got.setdefault(s, []).append(bits)
    mismatched = sorted(s for s, b in want.items() if s in got and any(x != b for x in got[s]))
    missing = sorted(set(want) - set(got))
    digests = all(result.get(k) == ref_result[k] for k in ("params", "optimizer", "rng"))
    return {"steps_compared": len(set(want) & set(got)), "loss_mismatches": mismatched[:5],
            "missing_steps": missing[:5], "digests_equal": digests,
            "bit_identical": not mismatched and not missing and digests}


def _stall(run: Trainer, around: float) -> float:
    """Longest gap between consecutive steps around a moment, less the median step time."""
    times = [t for _, _, t, _ in run.rows()]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # the gap spanning the snapshot: it ends after the request and starts within a minute of it
    window = [b - a for a, b in zip(times, times[1:]) if b >= around and a <= around + 60]
    return max(window, default=0.0) - statistics.median(gaps) if gaps else 0.0


def _step_time(run: Trainer) -> float:
    times = [t for _, _, t, _ in run.rows()]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else 0.0


def snapshot_run(base: Path, config: Config, ref: Trainer, ref_result: dict[str, Any], *, steps: int, at: int,
                 stop: bool, trimmed: bool) -> dict[str, Any]:
    name = f"{'stop' if stop else 'leave-running'}-{'trimmed' if trimmed else 'untrimmed'}"
    run = Trainer(base, name, steps, trimmed=trimmed)
    pid = run.start(os.path.join(config.state_dir, "take"))
    run.wait_step(at)
    images = str(base / f"{name}.img")
    t_request = time.time()
    ck = checkpoint_pid(pid, images, config, leave_running=not stop, take_wait_s=10.0)
    t_image = time.time()
    out: dict[str, Any] = {"arm": name, "snapshot_at_step": at, "image_bytes": ck["image_bytes"],
                           "checkpoint": ck["timings"], "request_to_complete_image_s": t_image - t_request,
                           "take_point": ck["take_point"], "warnings": [w["reason"] for w in ck["warnings"]]}
    if stop:
        assert run.proc is not None
        run.proc.wait(timeout=60)  # CRIU killed it; reap so its pid is free for the restore
        last_before = run.rows()[-1][0]
        t_restore = time.time()
        rs = restore_images(images, config)
        while not [r for r in run.rows() if r[2] > t_restore]:
            time.sleep(0.005)
        first_new = next(r for r in run.rows() if r[2] > t_restore)
        out.update(restore=rs["timings"], restore_to_first_new_step_s=first_new[2] - t_restore,
                   first_new_step=first_new[0], last_step_before=last_before)
        result = run.wait_done(pid=rs["pid"])
    else:
        result = run.wait_done()
        out["stall_s"] = _stall(run, t_request)  # after the run: the first step after the hold is logged
    out.update(compare(ref, run, ref_result, result))
    out["step_time_s"] = _step_time(run)
    return out


def file_checkpoint_run(base: Path, ref: Trainer, ref_result: dict[str, Any], *, steps: int, at: int) -> dict[str, Any]:
    path = base / "file-ckpt.pt"
    save = Trainer(base, "file-save", steps, extra=["--save-at", str(at), "--save-path", str(path)])
    save.start()
    save.wait_done()
    saved = [line.split() for line in save.log.read_text().splitlines() if line.startswith("saved ")]
    resume = Trainer(base, "file-resume", steps, extra=["--resume", str(path)])
    resume.start()
    result = resume.wait_done()
    first = next(r for r in resume.rows() if r[0] == at + 1)
    cmp = compare(ref, resume, ref_result, result)
    cmp["missing_steps"] = []  # steps before the checkpoint belong to the saving run
    cmp["bit_identical"] = not cmp["loss_mismatches"] and cmp["digests_equal"]
    return {"arm": "file-checkpoint", "snapshot_at_step": at, "image_bytes": path.stat().st_size,
            "stall_s": float(saved[0][2]), "resume_to_first_new_step_s": first[2] - resume.launched_at, **cmp}


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'arm':<24} {'image GB':>8} {'stall s':>8} {'req->image s':>12} {'restore->step s':>15} "
            f"{'bit-identical':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        def fmt(key: str, width: int) -> str:
            v = r.get(key)
            return f"{v:>{width}.2f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"
        first = r.get("restore_to_first_new_step_s", r.get("resume_to_first_new_step_s"))
        lines.append(f"{r['arm']:<24} {r.get('image_bytes', 0) / 1e9:>8.2f} {fmt('stall_s', 8)} "
                     f"{fmt('request_to_complete_image_s', 12)} "
                     f"{(f'{first:>15.2f}' if isinstance(first, float) else f'{chr(45):>15}')} "
                     f"{'yes' if r.get('bit_identical') else 'NO':>13}")
    return "\n".join(lines)


def run_torch_drill(config: Config, workdir: str, *, steps: int = 200, at: int = 80,
                    json_path: str | None = None, arms: tuple[str, ...] = ("snapshots", "file")) -> int:
    base = Path(workdir)
    base.mkdir(parents=True, exist_ok=True)
    if any(base.iterdir()):
        print(f"snapguard USAGE_ERROR: {base} is not empty: earlier logs would be read as this drill's",
              file=sys.stderr)
        return 2
    ref = Trainer(base, "reference", steps)
    ref.start()
    ref_result = ref.wait_done()
    rows: list[dict[str, Any]] = [{"arm": "reference", "image_bytes": 0, "bit_identical": True,
                                   "step_time_s": _step_time(ref)}]
    try:
        if "snapshots" in arms:
            for stop in (False, True):
                for trimmed in (False, True):
                    rows.append(snapshot_run(base, config, ref, ref_result, steps=steps, at=at, stop=stop,
                                             trimmed=trimmed))
                    print(json.dumps(rows[-1], default=str), flush=True)
        if "file" in arms:
            rows.append(file_checkpoint_run(base, ref, ref_result, steps=steps, at=at))
            print(json.dumps(rows[-1], default=str), flush=True)
    except (SnapguardError, RuntimeError, TimeoutError) as e:
        failure = e.failure.to_dict() if isinstance(e, SnapguardError) else {"error": str(e)}
        print(f"torch drill: {e}", file=sys.stderr)
        rows.append({"arm": "failed", "failure": failure})
    print(_table([r for r in rows if r["arm"] != "failed"]))
    ok = all(r.get("bit_identical") for r in rows)
    if json_path:
        Path(json_path).write_text(json.dumps({"ok": ok, "steps": steps, "snapshot_at": at, "rows": rows},
                                              indent=2, default=str) + "\n")
    print("torch drill: PASS" if ok else "torch drill: FAIL")
    return 0 if ok else 1
