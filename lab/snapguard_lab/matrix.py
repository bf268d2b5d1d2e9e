"""The workload matrix: the trainers people run, each snapshotted through snapguard's pipeline and
compared bit for bit with an uninterrupted run of the same workload.

A row is one script of `workloads/matrix` (package data). `run_row` runs it three times:
  reference      uninterrupted, without the take-point hook
  leave-running  with the hook; after step `at`, `checkpoint_pid(..., leave_running=True)`; the run
                 finishes and is compared; its stall is the longest gap between steps around the
                 snapshot, less the median step time
  stop           with the hook; a stop snapshot after step `at`, the page cache dropped (`sync`, then
                 3 into /proc/sys/vm/drop_caches), `restore_images`; restore to first step is the
                 time from the restore's start to the first step logged after it
Loss bits are compared at every step and the digests of parameters, optimizer and RNG state at the
end (torch_drill's Trainer and compare). A snapshot snapguard refuses is recorded with its typed
reason; the refused run must still finish bit-identical (nothing was frozen). Any other failure of an
arm is recorded, its processes are killed, and the next arm runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapguard.config import Config
from snapguard.takepoint import site_dir
from snapguard.pipeline import checkpoint_pid, restore_images
from snapguard.reasons import Phase, SnapguardError

from . import workloads
from .testbed import product_root
from .torch_drill import TRAINER_ENV, Trainer, _stall, _step_time, compare

__all__ = ["ROWS", "Row", "drop_page_cache", "refusal_check", "run_matrix", "run_row", "table"]

MATRIX = workloads.path("matrix")


@dataclass(frozen=True)
class Row:
    """One workload: its script, its arguments, where it makes sense, what it needs installed."""

    name: str
    script: str
    what: str
    args: tuple[str, ...] = ()
    cpu_args: tuple[str, ...] = ()
    cuda_args: tuple[str, ...] = ()
    gpu_only: bool = False
    needs: tuple[tuple[str, ...], ...] = ()  # each: modules of which one must import
    steps: int = 60
    at: int = 25
    mid_accumulation: bool = False
    compile_caches: bool = False
    min_step_s: float | None = None  # the row's own pace (else MIN_STEP_S of the device)
    env: dict[str, str] = field(default_factory=dict)


ROWS: dict[str, Row] = {r.name: r for r in [
    Row("plain", "plain.py", "plain PyTorch loop (AdamW)"),
    Row("dataloader", "dataloader.py", "DataLoader: 4 forked workers, pin_memory, persistent_workers",
        args=("--workers", "4")),
    # the pool goes when compilation has been idle a few steps; its shutdown (5.2 s on the H200)
    # runs beside training, so the snapshot comes later than in the other rows
    Row("compile", "compile.py", "torch.compile, default mode and worker pool",
        args=("--mode", "default"), cpu_args=("--warm-pool", "--recompile-at", "80"),
        cuda_args=("--recompile-at", "85"), steps=90, at=60, compile_caches=True),
    Row("compile-reduce-overhead", "compile.py", "torch.compile mode=reduce-overhead (CUDA graphs)",
        args=("--mode", "reduce-overhead"), gpu_only=True, steps=90, at=60,
        compile_caches=True),
    Row("amp", "amp.py", "fp16 autocast + GradScaler", gpu_only=True),
    Row("hf-trainer", "hf_trainer.py", "Hugging Face Trainer, GPT-2 from its config",
        needs=(("transformers",), ("accelerate",))),
    Row("lightning", "lightning_trainer.py", "PyTorch Lightning Trainer, one device",
        needs=(("lightning", "pytorch_lightning"),)),
    # slow micro-batches (0.1 s each): the take request, which reaches the trainer after the
    # preflight, lands among them, not in the optimizer step's few milliseconds
    Row("accumulation", "accumulation.py", "gradient accumulation, 4 micro-batches, snapshot asked mid-accumulation",
        args=("--micro", "4"), mid_accumulation=True, steps=30, at=10, min_step_s=0.4),
]}

# pace per device: every step lasts at least this long, so a snapshot asked after step `at` finds
# the run going (preflight and take take up to ~1.5 s on the H200)
MIN_STEP_S = {"cuda": 0.08, "cpu": 0.05}


@dataclass
class RowTrainer(Trainer):
    """torch_drill's Trainer, running a matrix script instead of the drill's train.py."""

    script: Path = MATRIX

    def start(self, take_dir: str | None = None) -> int:
        for stale in (self.log, self.result, self.workdir / f"{self.name}.out"):
            if stale.exists():
                raise RuntimeError(f"{stale} exists: a matrix row needs a fresh working directory")
        env = {**os.environ, **TRAINER_ENV, **self.env}
        if self.trimmed and take_dir:
            # the take point (and with it the blockers' resolution): only the environment changes
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [site_dir(), product_root(), env.get("PYTHONPATH")]))
            env["SNAPGUARD_TAKE_DIR"] = take_dir
        out = open(self.workdir / f"{self.name}.out", "ab")  # O_APPEND: restorable after growth
        self.launched_at = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, str(self.script), "--steps", str(self.steps), "--log", str(self.log),
             "--result", str(self.result), *self.extra],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True)
        out.close()
        return self.proc.pid

    def micro_rows(self) -> list[tuple[int, int, float]]:
        """(step, micro-batch, time) of the accumulation row's `micro` lines."""
        try:
            lines = self.log.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [(int(p[1]), int(p[2]), float(p[3])) for p in (line.split() for line in lines)
                if len(p) == 4 and p[0] == "micro"]


def missing(row: Row) -> list[str]:
    """What the row needs that this interpreter cannot import."""
    return [" or ".join(alts) for alts in row.needs if not any(importlib.util.find_spec(m) for m in alts)]


def drop_page_cache() -> bool:
    """`sync` and drop clean pages, dentries and inodes: the restore reads its image (and the
    libraries it maps) from the disk. False where the kernel does not let us."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc/PID/task/*/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                pass
    return out


def _kill_tree(pid: int | None) -> None:
    """A restored tree (not our child, so not in our child's process group), leaves first."""
    if not pid:
        return
    for p in reversed(_tree(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _failure(e: BaseException) -> dict[str, Any]:
    if isinstance(e, SnapguardError):
        f = e.failure
        return {"reason": f.reason.name, "phase": f.reason.phase.value, "detail": f.detail,
                "workload_intact": f.workload_intact, "evidence": f.evidence,
                "refused_before_freeze": f.reason.phase is Phase.PREFLIGHT and f.workload_intact}
    return {"error": f"{type(e).__name__}: {e}"}


def _criu_tail(images: Path, name: str, limit: int = 30) -> list[str]:
    """CRIU's error lines of a failed arm (its full logs stay in the working directory)."""
    path = images / name
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if "Error" in line or "error" in line][-limit:]


def _request_point(run: RowTrainer, row: Row, at: int, timeout: float) -> dict[str, Any]:
    """Wait for where the snapshot is asked: after step `at`, or (accumulation) inside the
    micro-batches of step at + 1."""
    if not row.mid_accumulation:
        run.wait_step(at, timeout)
        return {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        micro = [m for m in run.micro_rows() if m[0] == at + 1]
        if micro and micro[-1][1] < 4:
            return {"asked_in_micro": list(micro[-1][:2])}
        if run.proc is not None and run.proc.poll() is not None:
            raise RuntimeError(f"{run.name} exited {run.proc.returncode} before step {at + 1}")
        time.sleep(0.002)
    raise TimeoutError(f"{run.name} did not reach the micro-batches of step {at + 1}")


def _accumulation_figures(run: RowTrainer, take: dict[str, Any]) -> dict[str, Any]:
    """Where the take request reached the trainer (the last micro-batch or optimizer step logged
    before it) and where the trainer held: at the end of the first optimizer step after it."""
    figures = next(iter(take.values()), {}) if take else {}
    asked = figures.get("requested_at")
    if not isinstance(asked, (int, float)):
        return {}
    micro = run.micro_rows()
    per_step = max((k for _, k, _ in micro), default=0)
    events = sorted([(t, "micro", s, k) for s, k, t in micro] + [(t, "step", s, 0) for s, _, t, _ in run.rows()])
    before = [e for e in events if e[0] <= asked]
    out: dict[str, Any] = {"held_at_step": figures.get("step")}
    if not before:
        return out
    _, kind, step, k = before[-1]
    out["take_arrived_after"] = [kind, step, k] if kind == "micro" else [kind, step]
    out["take_arrived_mid_accumulation"] = kind == "micro" and k < per_step
    # the first optimizer step to end after the request; after the last micro-batch, the step's own
    # end may already have passed (its log line comes a moment later): then the next one
    expected = step if kind == "micro" else step + 1
    out["held_at_the_next_optimizer_step"] = figures.get("step") == expected or (
        kind == "micro" and k == per_step and figures.get("step") == expected + 1)
    return out


def _arm(row: Row, base: Path, config: Config, ref: RowTrainer, ref_result: dict[str, Any], *, stop: bool,
         steps: int, at: int, extra: list[str], env: dict[str, str], take_wait_s: float,
         timeout: float) -> dict[str, Any]:
    name = "stop" if stop else "leave-running"
    run = RowTrainer(base, name, steps, trimmed=True, extra=extra, env=env, script=MATRIX / row.script)
    images = base / f"{name}.img"
    out: dict[str, Any] = {"arm": name}
    pid = run.start(os.path.join(config.state_dir, "take"))
    try:
        out.update(_request_point(run, row, at, timeout))
        t_request = time.time()
        try:
            ck = checkpoint_pid(pid, str(images), config, leave_running=not stop, take_wait_s=take_wait_s)
        except SnapguardError as e:
            out["failure"] = _failure(e)
            out["dump_errors"] = _criu_tail(images, "dump.log")
            if e.failure.workload_intact and run.proc is not None and run.proc.poll() is None:
                # refused or failed with the trainer left running: it must still finish exactly
                result = run.wait_done(timeout)
                out["after_failure"] = compare(ref, run, ref_result, result)
            return out
        t_image = time.time()
        out.update(image_bytes=ck["image_bytes"], request_to_complete_image_s=t_image - t_request,
                   checkpoint=ck["timings"], take_point=ck["take_point"],
                   processes_dumped=len(list(images.glob("mm-*.img"))),  # CRIU's image of each live process
                   warnings=sorted({w["reason"] for w in ck["warnings"]}))
        if row.mid_accumulation:
            out.update(_accumulation_figures(run, ck["take_point"]))
        if stop:
            assert run.proc is not None
            run.proc.wait(timeout=60)  # CRIU killed it; reaped, its pid is free for the restore
            out["last_step_before"] = run.rows()[-1][0] if run.rows() else None
            out["page_cache_dropped"] = drop_page_cache()
            t_restore = time.time()
            try:
                rs = restore_images(str(images), config)
            except SnapguardError as e:
                out["failure"] = _failure(e)
                out["restore_errors"] = _criu_tail(images, "restore.log")
                return out
            run.restored_pid = rs["pid"]
            first = run.first_step_after(t_restore, timeout)
            out.update(restore=rs["timings"], restore_to_first_step_s=first[2] - t_restore,
                       first_new_step=first[0])
            result = run.wait_done(timeout, pid=rs["pid"])
        else:
            result = run.wait_done(timeout)
            out["stall_s"] = _stall(run, t_request)
        out.update(compare(ref, run, ref_result, result))
        out["step_time_s"] = _step_time(run)
        out["result"] = _extras(result)
        return out
    finally:
        _kill_tree(run.restored_pid)  # the restored tree first: it is not in our child's process group
        run.kill()


def _extras(result: dict[str, Any]) -> dict[str, Any]:
    """What a run's result says besides its digests (the compile row's pool pids, say)."""
    return {k: v for k, v in result.items() if k not in ("params", "optimizer", "rng")}


def run_row(row: Row, workdir: str | Path, config: Config, *, device: str = "cuda", steps: int | None = None,
            at: int | None = None, take_wait_s: float = 60.0, timeout: float = 300.0,
            keep_images: bool = False, extra: tuple[str, ...] = (),
            modes: tuple[str, ...] = ("leave-running", "stop"), logs_to: str | Path | None = None,
            caches: str | Path | None = None) -> dict[str, Any]:
    """The row's reference, then its leave-running and stop + restore runs (`modes`); a JSON-able
    record. `extra` goes to the row's script after the row's own arguments; `logs_to`: a directory
    that gets each run's step log and output, and CRIU's logs of an arm that failed; `caches`: where
    compile caches go (per row below it; default: the row's directory)."""
    base = Path(workdir) / row.name
    base.mkdir(parents=True, exist_ok=False)
    steps = steps or row.steps
    at = at or row.at
    out: dict[str, Any] = {"row": row.name, "what": row.what, "device": device, "steps": steps, "snapshot_after": at}
    if row.gpu_only and device != "cuda":
        return {**out, "skipped": "needs a GPU"}
    absent = missing(row)
    if absent:
        return {**out, "skipped": f"not installed: {', '.join(absent)}"}
    args = [*row.args, *(row.cuda_args if device == "cuda" else row.cpu_args), "--device", device,
            "--min-step-s", str(row.min_step_s or MIN_STEP_S[device]), "--workdir", str(base), *extra]
    env = {**row.env, **_cache_env(row, Path(caches) if caches else base)}
    out["args"] = args
    t0 = time.monotonic()
    ref = RowTrainer(base, "reference", steps, extra=args, env=env, script=MATRIX / row.script)
    try:
        ref.start()
        ref_result = ref.wait_done(timeout)
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
        ref.kill()
        return {**out, "failure": {"error": f"reference: {type(e).__name__}: {e}"}, "tail": _tail(base, "reference")}
    rows = ref.rows()
    out["reference"] = {"step_time_s": _step_time(ref), "launch_to_first_step_s": rows[0][2] - ref.launched_at
                        if rows else None, "result": _extras(ref_result)}
    for name in modes:
        stop = name == "stop"
        try:
            out[name] = _arm(row, base, config, ref, ref_result, stop=stop, steps=steps, at=at, extra=args, env=env,
                             take_wait_s=take_wait_s, timeout=timeout)
        except (SnapguardError, RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
            out[name] = {"arm": name, "failure": _failure(e), "tail": _tail(base, name)}
        if logs_to:
            _copy_logs(base, Path(logs_to) / row.name, name, criu=bool(out[name].get("failure")))
        if not keep_images:
            shutil.rmtree(base / f"{name}.img", ignore_errors=True)
    if logs_to:
        _copy_logs(base, Path(logs_to) / row.name, "reference", criu=False)
    out["seconds"] = time.monotonic() - t0
    out["ok"] = all(out[a].get("bit_identical") for a in modes)
    return out


def _cache_env(row: Row, root: Path) -> dict[str, str]:
    """One compile cache for all runs of a row: the first compiles, the others find it."""
    if not row.compile_caches:
        return {}
    d = root / row.name if root.name != row.name else root
    return {"TORCHINDUCTOR_CACHE_DIR": str(d / "inductor-cache"), "TRITON_CACHE_DIR": str(d / "triton-cache")}


def _copy_logs(base: Path, to: Path, name: str, *, criu: bool, limit: int = 4 << 20) -> None:
    """A run's step log and output (and CRIU's logs of its image), each cut to its last `limit` bytes."""
    to.mkdir(parents=True, exist_ok=True)
    sources = [base / f"{name}.log", base / f"{name}.out"]
    if criu:
        sources += [base / f"{name}.img" / n for n in ("dump.log", "restore.log")]
    for src in sources:
        try:
            with open(src, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
                (to / (f"{name}-{src.name}" if src.parent != base else src.name)).write_bytes(f.read())
        except OSError:
            pass


def refusal_check(row: Row, workdir: str | Path, config: Config, *, device: str = "cuda", hooked: bool = True,
                  resolve: bool = False, steps: int | None = None, at: int | None = None,
                  timeout: float = 300.0, caches: str | Path | None = None) -> dict[str, Any]:
    """The row's trainer without the blockers' resolution (the hook with SNAPGUARD_RESOLVE_BLOCKERS=0,
    or no hook at all): a leave-running snapshot must be refused before anything is frozen, with the
    processes named, and the trainer must go on to its last step."""
    from snapguard.takepoint import RESOLVE_ENV

    label = f"{row.name}-{'hook-resolve-off' if hooked and not resolve else 'hooked' if hooked else 'no-hook'}"
    base = Path(workdir) / label
    base.mkdir(parents=True, exist_ok=False)
    steps, at = steps or row.steps, at or row.at
    args = [*row.args, *(row.cuda_args if device == "cuda" else row.cpu_args), "--device", device,
            "--min-step-s", str(row.min_step_s or MIN_STEP_S[device]), "--workdir", str(base)]
    env = {**row.env, **({RESOLVE_ENV: "0"} if not resolve else {}), **_cache_env(row, Path(caches) if caches else base)}
    out: dict[str, Any] = {"check": label, "row": row.name, "hooked": hooked, "resolve": resolve}
    run = RowTrainer(base, "run", steps, trimmed=hooked, extra=args, env=env, script=MATRIX / row.script)
    pid = run.start(os.path.join(config.state_dir, "take") if hooked else None)
    try:
        run.wait_step(at, timeout)
        t0 = time.monotonic()
        try:
            ck = checkpoint_pid(pid, str(base / "run.img"), config, leave_running=True, take_wait_s=60.0)
            out.update(refused=False, image_bytes=ck["image_bytes"])
        except SnapguardError as e:
            ev = e.failure.evidence
            pids = [ev.get("pid"), *[(b.get("evidence") or {}).get("pid") for b in ev.get("other_blockers", [])]]
            out.update(refused=True, failure=_failure(e), seconds_to_refusal=time.monotonic() - t0,
                       refused_pids=[p for p in pids if p is not None])
        run.wait_done(timeout)
        rows = run.rows()
        out["trainer_finished"] = bool(rows) and rows[-1][0] == steps
        out["ok"] = out["refused"] and out["failure"].get("refused_before_freeze") and out["trainer_finished"]
        return out
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
        return {**out, "ok": False, "error": f"{type(e).__name__}: {e}", "tail": _tail(base, "run")}
    finally:
        run.kill()
        shutil.rmtree(base / "run.img", ignore_errors=True)


def _tail(base: Path, name: str, lines: int = 15) -> list[str]:
    try:
        return (base / f"{name}.out").read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _verdict(arm: dict[str, Any] | None) -> str:
    if not arm:
        return "-"
    if arm.get("bit_identical"):
        return "yes"
    f = arm.get("failure")
    if f:
        if f.get("refused_before_freeze"):
            return f"refused {f['reason']}"
        return f.get("reason") or "failed"
    return "NO"


def table(rows: list[dict[str, Any]]) -> str:
    """The matrix as text: one line per row, both arms."""
    head = (f"{'row':<24} {'LR stall s':>10} {'LR image MB':>11} {'LR exact':>9} {'stop image MB':>13} "
            f"{'restore->step s':>15} {'stop exact':>10}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        lr, st = r.get("leave-running") or {}, r.get("stop") or {}

        def num(arm: dict[str, Any], key: str, width: int, scale: float = 1.0) -> str:
            v = arm.get(key)
            return f"{v / scale:>{width}.2f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"

        note = r.get("skipped") or (r.get("failure") or {}).get("error") or ""
        for arm in (lr, st):
            f = arm.get("failure") or {}
            if f:
                note += f" {arm['arm']}: {f.get('reason') or ''} {f.get('detail') or f.get('error') or ''}".rstrip()
        lines.append(f"{r['row']:<24} {num(lr, 'stall_s', 10)} {num(lr, 'image_bytes', 11, 1e6)} "
                     f"{_verdict(lr) if lr else '-':>9} {num(st, 'image_bytes', 13, 1e6)} "
                     f"{num(st, 'restore_to_first_step_s', 15)} {_verdict(st) if st else '-':>10}  {note.strip()[:300]}")
    return "\n".join(lines)


# what a row takes on the H200, about (three runs, two snapshots, a restore): what the budget plans with
ROW_SECONDS = {"compile": 150, "compile-reduce-overhead": 110, "hf-trainer": 90, "lightning": 90, "accumulation": 70}
DEFAULT_ROW_SECONDS = 60


def run_matrix(config: Config, workdir: str | Path, *, device: str = "cuda", rows: list[str] | None = None,
               json_path: str | Path | None = None, budget_s: float | None = None, steps: int | None = None,
               at: int | None = None, meta: dict[str, Any] | None = None, logs_to: str | Path | None = None,
               started: float | None = None, caches: str | Path | None = None) -> list[dict[str, Any]]:
    """Every row (or those named) in turn; the JSON is rewritten after each row, so a run cut short
    keeps what it measured. A row that would end past `budget_s` (counted from `started`, a
    time.monotonic(); by default now) is recorded as skipped, with the command that runs it."""
    names = rows or list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    t0 = time.monotonic() if started is None else started
    done: list[dict[str, Any]] = []
    for name in names:
        planned = ROW_SECONDS.get(name, DEFAULT_ROW_SECONDS)
        if budget_s is not None and time.monotonic() - t0 + planned > budget_s:
            done.append({"row": name, "what": ROWS[name].what,
                         "skipped": f"time budget: {time.monotonic() - t0:.0f} s spent of {budget_s:g} s, "
                                    f"the row takes about {planned} s (run it with --rows {name})"})
        else:
            try:
                done.append(run_row(ROWS[name], workdir, config, device=device, steps=steps, at=at, logs_to=logs_to,
                                    caches=caches))
            except Exception as e:  # one row's surprise must not cost the others
                done.append({"row": name, "what": ROWS[name].what, "failure": {"error": f"{type(e).__name__}: {e}"}})
        print(table(done[-1:]).splitlines()[-1], flush=True)  # the whole record is in the JSON
        if json_path:
            Path(json_path).write_text(json.dumps({"device": device, "meta": meta or {}, "rows": done,
                                                   "seconds": time.monotonic() - t0}, indent=2, default=str) + "\n")
    return done
