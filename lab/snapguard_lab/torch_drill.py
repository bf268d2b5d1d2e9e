"""`snapguard-lab drill --workload torch`: snapshots of a live PyTorch trainer, compared bit for bit.

The torch workload's trainer (package data, `workloads/torch/train.py`) runs uninterrupted as the reference. Then the arms, each a fresh run:
  snapshots   leave-running and stop + restore snapshots, each untrimmed and trimmed (the take
              point releases PyTorch's free reserve at a step boundary first)
  expandable  the trimmed arms with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, whose
              emptied cache gives back partly used segments too
  file        the baseline: torch.save + fsync + rename, and a cold resume from it
  container   the trainer in a runc container (host directories bound, the GPU's device files
              bound), a stop snapshot through snapguard-runc and a restore through it
  compile     the trainer under torch.compile: a stop snapshot restored, against file resumes that
              compile again (cold caches) and that find the reference's caches (warm)
Loss bits are compared at every step and digests of parameters, optimizer and RNG state at the end.
Needs root, an NVIDIA GPU, CRIU with its CUDA plugin and a cuda-checkpoint (NVIDIA's or snapguard's);
the container arm needs snapguard-runc and the pinned runc.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapguard.config import Config
from snapguard.takepoint import SPILL_TMPFS, node_spill_dir, site_dir
from snapguard.pipeline import checkpoint_pid, restore_images
from snapguard.reasons import SnapguardError

from . import workloads
from .arms import DEFAULT_TORCH_ARMS, TORCH_ARMS
from .bundles import host_bundle, release_mounts
from .testbed import product_root, snapguard_runc_path

__all__ = ["DEFAULT_TORCH_ARMS", "TORCH_ARMS", "TRAIN", "Trainer", "compare", "run_torch_drill"]

TRAIN = workloads.path("torch", "train.py")


# Every trainer's environment. oneDNN (PyTorch's CPU matmuls: the trainer's bf16 autocast with
# --device cpu) runs Intel AMX tile instructions where the CPU has them, after asking the kernel for
# AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM). That permission belongs to the process and CRIU
# (4.2.1: x86 state up to AVX-512 and PKRU) saves neither it nor the tile registers: a process it
# restores is killed with SIGILL at its next AMX instruction, before its next step. Capped below
# AMX, every arm and the reference alike, so their loss bits still compare.
TRAINER_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}

@dataclass
class Trainer:
    """One run of the torch workload's train.py, started in its own session, logging to files."""

    workdir: Path
    name: str
    steps: int
    trimmed: bool = False
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    launched_at: float = 0.0
    restored_pid: int | None = None

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
        env = {**os.environ, **TRAINER_ENV, **self.env}
        if self.trimmed and take_dir:
            # the take point: no change to the trainer, only its environment
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [site_dir(), product_root(),
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

    def kill(self) -> None:
        """After a failed arm: nothing of it keeps running into the next."""
        kills = [(os.killpg, self.proc.pid)] if self.proc else []  # our child leads its own session
        kills += [(os.kill, self.restored_pid)] if self.restored_pid else []
        for kill, pid in kills:
            try:
                kill(pid, 9)
            except OSError:
                pass
        if self.proc is not None:
            self.proc.wait(timeout=60)

    def first_step_after(self, moment: float, timeout: float = 300) -> tuple[int, str, float, int]:
        """The first step logged after a moment (a restore's start), waited for."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            new = [r for r in self.rows() if r[2] > moment]
            if new:
                return new[0]
            if self.restored_pid and not os.path.exists(f"/proc/{self.restored_pid}"):
                raise RuntimeError(f"{self.name}: restored pid {self.restored_pid} exited without a new step")
            time.sleep(0.005)
        raise TimeoutError(f"{self.name} logged no step after the restore")

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
            if self.restored_pid and not os.path.exists(f"/proc/{self.restored_pid}") and not self.result.exists():
                raise RuntimeError(f"{self.name} (pid {self.restored_pid}) exited; see {self.name}.out or .err")
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


def _image_figures(images: str) -> dict[str, Any]:
    """What the manifest says went into an image: per-process host and GPU memory, and the GPU."""
    try:
        manifest = json.loads((Path(images) / "snapguard-manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    procs = [p for p in manifest.get("processes", []) if isinstance(p, dict)]
    gpu = manifest.get("gpu") or {}
    return {"host_rss_bytes": sum(p.get("rss_bytes", 0) for p in procs),
            "gpu_memory_bytes": sum(p.get("gpu_memory_bytes", 0) for p in procs),
            "driver": gpu.get("driver_version"), "gpus": [g.get("name") for g in gpu.get("gpus", [])]}


def _arm_name(stop: bool, trimmed: bool, prefix: str = "") -> str:
    return f"{prefix}{'stop' if stop else 'leave-running'}-{'trimmed' if trimmed else 'untrimmed'}"


def snapshot_run(base: Path, config: Config, ref: Trainer, ref_result: dict[str, Any], *, steps: int, at: int,
                 stop: bool, trimmed: bool, prefix: str = "", extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    run = Trainer(base, _arm_name(stop, trimmed, prefix), steps, trimmed=trimmed, extra=list(extra), env=env or {})
    pid = run.start(os.path.join(config.state_dir, "take"))
    try:
        return _snapshot(run, pid, base, config, ref, ref_result, at=at, stop=stop)
    except BaseException:
        run.kill()
        raise


def _snapshot(run: Trainer, pid: int, base: Path, config: Config, ref: Trainer, ref_result: dict[str, Any], *,
              at: int, stop: bool) -> dict[str, Any]:
    run.wait_step(at)
    images = str(base / f"{run.name}.img")
    t_request = time.time()
    ck = checkpoint_pid(pid, images, config, leave_running=not stop, take_wait_s=10.0)
    t_image = time.time()
    out: dict[str, Any] = {"arm": run.name, "snapshot_at_step": at, "image_bytes": ck["image_bytes"],
                           "checkpoint": ck["timings"], "dump_marks": ck["criu_marks"],
                           "request_to_complete_image_s": t_image - t_request, **_image_figures(images),
                           "take_point": ck["take_point"], "warnings": [w["reason"] for w in ck["warnings"]]}
    if stop:
        assert run.proc is not None
        run.proc.wait(timeout=60)  # CRIU killed it; reap so its pid is free for the restore
        last_before = run.rows()[-1][0]
        t_restore = time.time()
        rs = restore_images(images, config)
        run.restored_pid = rs["pid"]
        first_new = run.first_step_after(t_restore)
        out.update(restore=rs["timings"], restore_marks=rs["criu_marks"],
                   restore_to_first_new_step_s=first_new[2] - t_restore, first_new_step=first_new[0],
                   last_step_before=last_before)
        result = run.wait_done(pid=rs["pid"])
    else:
        result = run.wait_done()
        out["stall_s"] = _stall(run, t_request)  # after the run: the first step after the hold is logged
    out.update(compare(ref, run, ref_result, result))
    out["step_time_s"] = _step_time(run)
    return out


def file_checkpoint_run(base: Path, ref: Trainer, ref_result: dict[str, Any], *, steps: int, at: int,
                        prefix: str = "", extra: tuple[str, ...] = (), save_env: dict[str, str] | None = None,
                        resumes: dict[str, dict[str, str]] | None = None,
                        before_resume: Callable[[str], float] | None = None) -> list[dict[str, Any]]:
    """The baseline: a run that saves after step `at`, then one resume per entry of `resumes`
    ({arm name: environment}); the first is the arm that carries the save's stall. `before_resume`,
    given an arm's name, runs just before that resume launches (a page cache drop: its seconds are
    returned and kept as the row's `before_resume_s`, outside the resume's figures)."""
    path = base / f"{prefix}file-ckpt.pt"
    save = Trainer(base, f"{prefix}file-save", steps, extra=[*extra, "--save-at", str(at), "--save-path", str(path)],
                   env=save_env or {})
    save.start()
    save.wait_done()
    saved = [line.split() for line in save.log.read_text().splitlines() if line.startswith("saved ")]
    rows: list[dict[str, Any]] = []
    for arm, env in (resumes or {f"{prefix}file-checkpoint": {}}).items():
        before = before_resume(arm) if before_resume is not None else None
        resume = Trainer(base, f"{arm}-resume", steps, extra=[*extra, "--resume", str(path)], env=env)
        resume.start()
        result = resume.wait_done()
        first = next(r for r in resume.rows() if r[0] == at + 1)
        cmp = compare(ref, resume, ref_result, result)
        cmp["missing_steps"] = []  # steps before the checkpoint belong to the saving run
        cmp["bit_identical"] = not cmp["loss_mismatches"] and cmp["digests_equal"]
        row = {"arm": arm, "snapshot_at_step": at, "image_bytes": path.stat().st_size,
               "resume_to_first_new_step_s": first[2] - resume.launched_at, **cmp}
        if before is not None:
            row["before_resume_s"] = before
        if not rows:
            row["stall_s"] = float(saved[0][2])
        rows.append(row)
    return rows


def _caches(base: Path, tag: str) -> dict[str, str]:
    """Inductor's and Triton's caches of one run: a new tag is a cold compile."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(base / "caches" / tag / "inductor"),
            "TRITON_CACHE_DIR": str(base / "caches" / tag / "triton")}


def compile_arms(base: Path, config: Config, *, steps: int, at: int, extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """torch.compile: restore to the first new step against file resumes that compile again."""
    extra = (*extra, "--compile")
    ref = Trainer(base, "compiled-reference", steps, extra=list(extra), env=_caches(base, "reference"))
    ref.start()
    ref_result = ref.wait_done()
    first = ref.rows()[0]
    rows: list[dict[str, Any]] = [{"arm": "compiled-reference", "image_bytes": 0, "bit_identical": True,
                                   "launch_to_first_step_s": first[2] - ref.launched_at,
                                   "step_time_s": _step_time(ref)}]
    # One compile thread: inductor's worker pool would be processes of the snapshot's tree
    snap_env = {**_caches(base, "snapshot"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    rows.append(snapshot_run(base, config, ref, ref_result, steps=steps, at=at, stop=True, trimmed=True,
                             prefix="compiled-", extra=extra, env=snap_env))
    rows += file_checkpoint_run(base, ref, ref_result, steps=steps, at=at, prefix="compiled-", extra=extra,
                                save_env=_caches(base, "save"),
                                resumes={"compiled-file-checkpoint": _caches(base, "resume-cold"),
                                         "compiled-file-resume-warm-cache": _caches(base, "reference")})
    return rows


CONTAINER_ENV_PREFIXES = ("LD_LIBRARY_PATH", "CUDA_", "NVIDIA_", "NCCL_", "TORCH_", "NVSHMEM_")


def container_run(base: Path, config: Config, ref: Trainer, ref_result: dict[str, Any], *, steps: int,
                  at: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The trainer in a runc container, a stop snapshot and a restore, both through snapguard-runc."""
    import glob
    import stat

    executor = snapguard_runc_path()
    out = base / "container-out"
    out.mkdir()
    run = Trainer(out, "container", steps, trimmed=True)
    repo = product_root()
    devices = [d for d in sorted(glob.glob("/dev/nvidia*")) if stat.S_ISCHR(os.stat(d).st_mode)]
    env = [f"{k}={v}" for k, v in os.environ.items() if k.startswith(CONTAINER_ENV_PREFIXES)]
    env += [f"{k}={v}" for k, v in TRAINER_ENV.items()]
    env += ["PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root", "PYTHONUNBUFFERED=1",
            f"PYTHONPATH={site_dir()}:{repo}", "SNAPGUARD_TAKE_DIR=/run/snapguard/take"]
    args = [sys.executable, str(TRAIN), "--steps", str(steps), "--log", "/out/container.log",
            "--result", "/out/container.result.json", "--stderr", "/out/container.err", *extra]
    # the trainer's own directory too: the lab may be installed apart from snapguard
    host_dirs = ["/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", sys.base_prefix, sys.prefix, repo,
                 str(TRAIN.parent)]
    # the node's spill tmpfs bound in (a directory of its own in it, or in /dev/shm where the node
    # mounts none), as a pod would by a hostPath: the take point's moved bytes go there, not into
    # the container's own /dev/shm, which CRIU dumps with the container
    spill_host = Path(tempfile.mkdtemp(prefix="drill-", dir=node_spill_dir()))
    root, cid = str(base / "runc-root"), "snapguard-torch-drill"
    sg = [executor, "--root", root]

    def call(*argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*sg, *argv], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=300, check=False, **kw)
        if done.returncode != 0:
            raise RuntimeError(f"snapguard-runc {argv[0]} exited {done.returncode}: {done.stderr.strip()[-800:]}")
        return done

    bundle: Path | None = None
    try:
        spill_host.chmod(0o1777)  # the trainer may run as any user
        bundle = host_bundle(base / "bundle", args, env, host_dirs, devices=devices, runc=config.runc,
                             writable={"/out": str(out), SPILL_TMPFS: str(spill_host)})
        # stdio /dev/null, as containerd's null IO: a file opened on the host is outside the container's
        # mounts and CRIU cannot dump it; the trainer opens its own stderr file in /out
        run.launched_at = time.time()
        runc_log = base / "runc-run.log"
        rc = subprocess.run([*sg, "--log", str(runc_log), "run", "--detach", "--bundle", str(bundle), cid],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            timeout=120, check=False).returncode
        if rc != 0:
            tail = runc_log.read_text(errors="replace")[-800:] if runc_log.exists() else ""
            raise RuntimeError(f"snapguard-runc run exited {rc}: {tail.strip()}")
        run.restored_pid = int(json.loads(call("state", cid).stdout)["pid"])
        run.wait_step(at)
        t_request = time.time()
        call("checkpoint", "--image-path", str(base / "container.img"), "--work-path", str(base / "container-dump"),
             cid)
        t_image = time.time()
        ck = json.loads((base / "container-dump" / "snapguard-result.json").read_text())
        last_before = run.rows()[-1][0]
        t_restore = time.time()
        call("restore", "--image-path", str(base / "container.img"), "--work-path",
             str(base / "container-restore"), "--bundle", str(bundle), "--detach", cid)
        rs = json.loads((base / "container-restore" / "snapguard-result.json").read_text())
        run.restored_pid = rs["pid"]
        first_new = run.first_step_after(t_restore)
        result = run.wait_done(pid=rs["pid"])
    finally:
        if bundle is not None:
            subprocess.run([config.runc, "--root", root, "delete", "--force", cid], capture_output=True, check=False)
            release_mounts(bundle)
        left = sorted(p.name for p in spill_host.iterdir()) if spill_host.is_dir() else []
        shutil.rmtree(spill_host, ignore_errors=True)
    spills = [((f or {}).get("offload") or {}).get("spill") for f in (ck.get("take_point") or {}).values()]
    row = {"arm": "container-stop-trimmed", "snapshot_at_step": at, "image_bytes": ck["image_bytes"],
           "spill_bytes": sum(int(x.get("bytes") or 0) for x in spills if isinstance(x, dict)),
           "spills_left": left,
           "request_to_complete_image_s": t_image - t_request, "dump_marks": ck.get("criu_marks"),
           "take_point": ck["take_point"], "warnings": [w["reason"] for w in ck["warnings"]],
           **_image_figures(str(base / "container.img")),
           "restore_marks": rs.get("criu_marks"), "restore_to_first_new_step_s": first_new[2] - t_restore,
           "first_new_step": first_new[0], "last_step_before": last_before, "devices": devices}
    row.update(compare(ref, run, ref_result, result))
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'arm':<32} {'image GB':>8} {'stall s':>8} {'req->image s':>12} {'restore->step s':>15} "
            f"{'bit-identical':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        def fmt(key: str, width: int) -> str:
            v = r.get(key)
            return f"{v:>{width}.2f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"
        first = r.get("restore_to_first_new_step_s", r.get("resume_to_first_new_step_s"))
        lines.append(f"{r['arm']:<32} {r.get('image_bytes', 0) / 1e9:>8.2f} {fmt('stall_s', 8)} "
                     f"{fmt('request_to_complete_image_s', 12)} "
                     f"{(f'{first:>15.2f}' if isinstance(first, float) else f'{chr(45):>15}')} "
                     f"{'yes' if r.get('bit_identical') else 'NO':>13}")
    return "\n".join(lines)


def _arm_failure(arm: str, e: BaseException) -> dict[str, Any]:
    failure = e.failure.to_dict() if isinstance(e, SnapguardError) else {"error": f"{type(e).__name__}: {e}"}
    print(f"torch drill: {arm}: {e}", file=sys.stderr)
    return {"arm": arm, "failed": True, "failure": failure}


def run_torch_drill(config: Config, workdir: str, *, steps: int = 200, at: int = 80,
                    json_path: str | None = None, arms: tuple[str, ...] = DEFAULT_TORCH_ARMS,
                    trainer_args: tuple[str, ...] = ()) -> int:
    """Run the arms; `trainer_args` go to every trainer (the tests' small CPU model)."""
    base = Path(workdir)
    base.mkdir(parents=True, exist_ok=True)
    if any(base.iterdir()):
        print(f"snapguard-lab USAGE_ERROR: {base} is not empty: earlier logs would be read as this drill's",
              file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []

    def record(new: dict[str, Any] | list[dict[str, Any]]) -> None:
        for row in new if isinstance(new, list) else [new]:
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)

    runs: list[tuple[str, Any]] = []
    if any(a != "compile" for a in arms):
        ref = Trainer(base, "reference", steps, extra=list(trainer_args))
        ref.start()
        ref_result = ref.wait_done()
        record({"arm": "reference", "image_bytes": 0, "bit_identical": True, "step_time_s": _step_time(ref),
                "launch_to_first_step_s": ref.rows()[0][2] - ref.launched_at})
        expandable = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        if "snapshots" in arms:
            runs += [(_arm_name(stop, trim),
                      lambda stop=stop, trim=trim: snapshot_run(base, config, ref, ref_result, steps=steps, at=at,
                                                                stop=stop, trimmed=trim, extra=trainer_args))
                     for stop in (False, True) for trim in (False, True)]
        if "expandable" in arms:
            runs += [(_arm_name(stop, True, "expandable-"),
                      lambda stop=stop: snapshot_run(base, config, ref, ref_result, steps=steps, at=at, stop=stop,
                                                     trimmed=True, prefix="expandable-", env=expandable,
                                                     extra=trainer_args))
                     for stop in (False, True)]
        if "file" in arms:
            runs.append(("file-checkpoint", lambda: file_checkpoint_run(base, ref, ref_result, steps=steps, at=at,
                                                                          extra=trainer_args)))
        if "container" in arms:
            runs.append(("container-stop-trimmed",
                         lambda: container_run(base, config, ref, ref_result, steps=steps, at=at,
                                               extra=trainer_args)))
    if "compile" in arms:
        runs.append(("compile", lambda: compile_arms(base, config, steps=steps, at=at, extra=trainer_args)))
    for arm, go in runs:
        try:
            record(go())
        except (SnapguardError, RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
            record(_arm_failure(arm, e))
    print(_table([r for r in rows if not r.get("failed")]))
    for r in rows:
        if r.get("failed"):
            why = " ".join(str(r["failure"].get(k, "")) for k in ("reason", "message", "error")).split()
            print(f"{r['arm']}: FAILED: {' '.join(why)[:400]}")
    summary = _compile_summary(rows)
    if summary:
        print(f"torch.compile: restore to first new step {summary['restore_s']:.2f} s; file resume that compiles "
              f"again {summary['cold_resume_s']:.2f} s ({summary['speedup_cold']:.1f}x), with warm caches "
              f"{summary['warm_resume_s']:.2f} s ({summary['speedup_warm']:.1f}x)")
    ok = all(r.get("bit_identical") for r in rows)
    if json_path:
        Path(json_path).write_text(json.dumps({"ok": ok, "steps": steps, "snapshot_at": at, "arms": list(arms),
                                               "compile": summary, "rows": rows}, indent=2, default=str) + "\n")
    print("torch drill: PASS" if ok else "torch drill: FAIL")
    return 0 if ok else 1


def _compile_summary(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    by_arm = {r["arm"]: r for r in rows if not r.get("failed")}
    try:
        restore = by_arm["compiled-stop-trimmed"]["restore_to_first_new_step_s"]
        cold = by_arm["compiled-file-checkpoint"]["resume_to_first_new_step_s"]
        warm = by_arm["compiled-file-resume-warm-cache"]["resume_to_first_new_step_s"]
    except KeyError:
        return None
    return {"restore_s": restore, "cold_resume_s": cold, "warm_resume_s": warm,
            "speedup_cold": cold / restore, "speedup_warm": warm / restore}
