"""Issue 12, item 2: how the cost of a snapshot grows with the training state, against the raw stack
and the file checkpoints a user has today, all in one run.

The torch workload's trainer (lab/snapguard_lab/workloads/torch/train.py: a GPT, bf16 autocast,
AdamW, deterministic) at about 85 M, 350 M and 1.2 B parameters; per size, side by side:

  snapguard  snapguard.pipeline's checkpoint_pid / restore_images with the take point (trimmed). One
             trainer: a leave-running snapshot (the stall: the longest gap between step timestamps
             less the median step), a stop snapshot (request -> image complete) and a restore with
             the page cache warm (restore -> first new step), then a stop snapshot of the restored
             trainer and a restore after `sync; echo 3 > /proc/sys/vm/drop_caches` (cold).
  raw        the stack under it, no snapguard: `criu dump/restore` run directly with CRIU's CUDA
             plugin (the config's criu and criu_libdir, the config's cuda-checkpoint first on PATH)
             and the flags snapguard gives CRIU (--shell-job, --network-lock skip, its -v level, --timeout;
             --leave-running; restore --restore-detached --pidfile), without snapguard's own steps
             (no take point, so untrimmed; no in-process CUDA lock; no preflight, digests or
             manifest). The same four measurements.
  torch.save torch.save + fsync + rename (train.py --save-at): the stall it logs, the file's bytes,
             and a resume after dropping the page cache -> first step (a new process: it includes
             Python's, torch's and CUDA's start; launch_to_first_step_s of a fresh trainer is given
             beside it).
  dcp        torch.distributed.checkpoint.async_save (train.py --dcp-at) in the same trainer, a few
             steps after the torch.save: the stall (the call: the state staged to host memory) and
             the call -> write complete (DCP fsyncs its files), bytes.

Costs are also given in seconds per GB of each arm's own bytes, and, between sizes, the marginal
seconds per GB (how the cost grows with the state), beside the ceilings measured on the H200. Every
arm records its own failure and the next runs; every wait has a deadline; the JSON is rewritten after
every arm; arms whose estimate (from the previous size) would end past --budget-s, and sizes after
the budget, are skipped and recorded so; every trainer is killed at the end.

    source bench/gpu/setup.sh && python3 bench/gpu/scaling.py bench/results/h200/scaling-DATE.json
    python3 bench/gpu/scaling.py OUT.json --sizes 85m,350m --arms snapguard,file
    SNAPGUARD_TAKE_DROP_GRADS=1 python3 bench/gpu/scaling.py OUT.json --arms snapguard  # grads dropped
    SNAPGUARD_TAKE_SPILL=0 python3 bench/gpu/scaling.py OUT.json --arms snapguard  # moved bytes kept in the
                                                    # trainer (CRIU writes them), against the spill
    SNAPGUARD_TAKE_SPILL_DIR=/dev/shm python3 bench/gpu/scaling.py OUT.json --arms snapguard  # the spill in
                                                    # 4 KiB pages, against setup.sh's huge-page tmpfs
    .venv/bin/python bench/gpu/scaling.py /tmp/s.json --sizes 48x1,96x2 --steps 60 \\
        --trainer-args "--device cpu --batch 1"                     # the machinery on a CPU
    python3 bench/gpu/scaling.py OUT.json --merge A.json B.json     # one table from runs that each
                                                    # ran every arm of their sizes (a device call's limit)

Sizes: 85m (768x12), 350m (1152x22), 1.2b (2040x24), or WIDTHxLAYERS. train.py's GPT has 12 heads,
so the width must be a multiple of 12 (2048, the issue's 1.2 B width, is not: 2040 is used).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from snapguard import criu as sg_criu
from snapguard.config import Config, load, resolve_cuda_checkpoint
from snapguard.pipeline import checkpoint_pid, restore_images
from snapguard.reasons import SnapguardError
from snapguard_lab.torch_drill import Trainer

import image_parts  # bench/gpu/image_parts.py, beside this script

SIZES = {"85m": (768, 12), "350m": (1152, 22), "1.2b": (2040, 24)}
HEADS = 12  # train.py's GPT(heads=12): no flag changes it
ARMS = ("snapguard", "raw", "file")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# measured on the H200 (issue 12): what the bytes could move at, at best
CEILINGS_GB_S = {"pinned device-to-host copy": 55.0, "tmpfs write": 2.9, "disk write with fsync": 1.3}
# a trainer's start on the H200 (python, torch, CUDA context): the part of an arm that does not grow
FIXED_S = 20.0
# the take point's opt-in (snapguard/takepoint/workload/env.py): the stepped optimizer's gradients dropped at
# the hold; set in this script's environment, every snapguard-arm trainer inherits it
DROP_GRADS = os.environ.get("SNAPGUARD_TAKE_DROP_GRADS", "0").strip().lower() in ("1", "true", "yes", "on")
# the take point's move of the tensors' bytes to host memory for the hold: on unless set to 0 here
OFFLOAD = os.environ.get("SNAPGUARD_TAKE_OFFLOAD", "1").strip().lower() not in ("0", "false", "no", "off")


def image_parts_of(img: Path, pid: int) -> dict[str, Any]:
    """image_parts.account of a leave-running image, the trainer still running (which of the dumped
    VMAs are still mapped); the error where it cannot be read (the arm goes on)."""
    try:
        return image_parts.account(str(img), pid, top=16)
    except (OSError, ValueError, IndexError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def loss_bits(run: Trainer) -> dict[str, str]:
    """{step: the loss's float32 bits} as the trainer (and the trainers restored from it) logged them."""
    return {str(step): bits for step, bits, _, _ in run.rows()}


def same_losses(arms: dict[str, Any]) -> dict[str, Any]:
    """The snapguard arm's losses against every other arm's, step by step (the trainer is
    deterministic: a snapshot and a restore, the move of the tensors and their halves included,
    must leave every bit as an arm that never moved them): per arm the steps both logged, whether
    every one is the same and the first that is not."""
    mine = (arms.get("snapguard") or {}).get("loss_bits") or {}
    out: dict[str, Any] = {}
    for name, arm in arms.items():
        theirs = arm.get("loss_bits") if isinstance(arm, dict) and name != "snapguard" else None
        if not mine or not theirs:
            continue
        common = sorted(set(mine) & set(theirs), key=int)
        differ = [s for s in common if mine[s] != theirs[s]]
        out[name] = {"steps": len(common), "same": bool(common) and not differ,
                     "first_different": int(differ[0]) if differ else None}
    return out


def say(msg: str) -> None:
    print(f"scaling: {msg}", flush=True)


def param_count(width: int, layers: int) -> int:
    """train.py's GPT: per block 12 d^2 + 13 d; embeddings, final norm and head 770 d (VOCAB=CTX=256)."""
    return layers * (12 * width * width + 13 * width) + 770 * width


def parse_sizes(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in (s.strip().lower() for s in text.split(",") if s.strip()):
        if item in SIZES:
            w, layers = SIZES[item]
        else:
            try:
                w_s, l_s = item.split("x")
                w, layers = int(w_s), int(l_s)
            except ValueError:
                raise ValueError(f"size {item!r}: one of {', '.join(SIZES)} or WIDTHxLAYERS") from None
        if w <= 0 or layers <= 0 or w % HEADS:
            raise ValueError(f"size {item!r}: the width must be a positive multiple of {HEADS} "
                             f"(train.py's heads), the layers positive")
        out.append((item, w, layers))
    return out


# -- processes ---------------------------------------------------------------------------------

def _subreaper(on: bool) -> None:
    """Restored trainers are CRIU's orphans: made this process's children, so one that a stop
    snapshot ended is reaped here at once (its pid must be free before its image is restored)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def gone(pid: int) -> bool:
    """Whether a process is gone; reaps it where it is our child (or orphan, as subreaper)."""
    try:
        got, _ = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return True
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def reap(run: Trainer, pid: int, timeout: float = 60) -> None:
    """After a stop snapshot: the trainer CRIU ended is reaped, so the restore can take its pid."""
    if run.proc is not None and run.proc.pid == pid:
        run.proc.wait(timeout=timeout)
        run.proc = None  # from here on the trainer is the restored process
        return
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} did not go after the stop snapshot")
        time.sleep(0.01)


def out_tail(run: Trainer, n: int = 600) -> str:
    try:
        return " ".join((run.workdir / f"{run.name}.out").read_text(errors="replace")[-n:].split())
    except OSError:
        return ""


def running_pid(run: Trainer) -> int | None:
    if run.restored_pid:
        return run.restored_pid
    return run.proc.pid if run.proc is not None else None


def check_alive(run: Trainer, what: str) -> None:
    if run.proc is not None and run.restored_pid is None:
        if run.proc.poll() is not None:
            raise RuntimeError(f"{run.name} exited {run.proc.returncode} {what}"
                               f"{' (its --steps reached: raise --steps)' if run.result.exists() else ''}; "
                               f"its output ends: {out_tail(run)}")
    elif run.restored_pid and gone(run.restored_pid):
        raise RuntimeError(f"{run.name} (restored pid {run.restored_pid}) is gone {what}"
                           f"{' (its --steps reached: raise --steps)' if run.result.exists() else ''}; "
                           f"its output ends: {out_tail(run)}")


def wait_step(run: Trainer, step: int, timeout: float) -> tuple[int, str, float, int]:
    deadline = time.monotonic() + timeout
    while True:
        rows = run.rows()
        if rows and rows[-1][0] >= step:
            return rows[-1]
        check_alive(run, f"before step {step}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run.name} did not reach step {step} in {timeout:.0f} s")
        time.sleep(0.01)


def first_step_after(run: Trainer, moment: float, timeout: float) -> tuple[int, str, float, int]:
    deadline = time.monotonic() + timeout
    while True:
        new = [r for r in run.rows() if r[2] > moment]
        if new:
            return new[0]
        check_alive(run, "without a new step after the restore")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run.name} logged no step in {timeout:.0f} s after the restore")
        time.sleep(0.005)


def wait_line(run: Trainer, prefixes: tuple[str, ...], timeout: float) -> list[str]:
    """The first log line starting with one of the prefixes, split."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for line in run.log.read_text().splitlines():
                if line.startswith(prefixes):
                    return line.split()
        except FileNotFoundError:
            pass
        check_alive(run, f"before a {'/'.join(p.strip() for p in prefixes)} line")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run.name} logged no {'/'.join(p.strip() for p in prefixes)} line in {timeout:.0f} s")
        time.sleep(0.02)


def logged_params(run: Trainer) -> int | None:
    try:
        for line in run.log.read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == "start" and len(parts) >= 5:
                return int(parts[4])
    except (OSError, ValueError):
        pass
    return None


def stall(rows: list[tuple[int, str, float, int]], t_from: float, t_to: float) -> float | None:
    """torch_drill._stall over [t_from, t_to]: the longest gap between consecutive steps that spans
    part of it, less the median gap. Read before the next event, so no later gap is in the window."""
    times = [r[2] for r in rows]
    gaps = [b - a for a, b in zip(times, times[1:])]
    window = [b - a for a, b in zip(times, times[1:]) if b >= t_from and a <= t_to]
    if not gaps or not window:
        return None
    return max(window) - statistics.median(gaps)


def step_gap_after(rows: list[tuple[int, str, float, int]], step: int) -> float | None:
    """The gap from a step to the next, less the median gap: what a save after that step cost it."""
    times = {r[0]: r[2] for r in rows}
    order = [r[2] for r in rows]
    gaps = [b - a for a, b in zip(order, order[1:])]
    if step not in times or step + 1 not in times or not gaps:
        return None
    return times[step + 1] - times[step] - statistics.median(gaps)


def median_step(rows: list[tuple[int, str, float, int]]) -> float | None:
    times = [r[2] for r in rows]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def drop_caches() -> dict[str, Any]:
    """sync + drop the page cache: the restore reads its image, libraries included, from disk."""
    t = time.monotonic()
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        return {"page_cache": f"NOT dropped ({type(e).__name__}: {e}): warm", "dropped": False,
                "drop_s": time.monotonic() - t}
    return {"page_cache": "cold (sync; echo 3 > /proc/sys/vm/drop_caches just before the restore)",
            "dropped": True, "drop_s": time.monotonic() - t}


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# -- the arms ----------------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace, config: Config, base: Path) -> None:
        self.args, self.config, self.base = args, config, base
        self.extra = shlex.split(args.trainer_args)
        self.trainers: list[Trainer] = []
        self.timeout = float(args.child_timeout_s)
        bindir = base / "raw-bin"  # the raw arm's PATH: criu and cuda-checkpoint as snapguard resolves them
        bindir.mkdir(mode=0o700)
        self.cuda_checkpoint = resolve_cuda_checkpoint(config)
        for name, target in (("criu", config.criu), ("cuda-checkpoint", self.cuda_checkpoint)):
            if target:
                os.symlink(target, bindir / name)
        self.raw_env = {**os.environ, "PATH": f"{bindir}:{SYSTEM_PATH}"}

    def trainer(self, name: str, w: int, layers: int, *, trimmed: bool = False, more: tuple[str, ...] = ()) -> Trainer:
        run = Trainer(self.base, name, self.args.steps, trimmed=trimmed,
                      extra=[*self.extra, "--width", str(w), "--layers", str(layers), *more])
        self.trainers.append(run)
        return run

    def kill_all(self) -> None:
        for run in list(self.trainers):
            self.finish(run)

    def finish(self, run: Trainer) -> None:
        """Kill a trainer (launched or restored) and reap it."""
        try:
            run.kill()
        except (OSError, subprocess.SubprocessError):
            pass
        if run.restored_pid:
            deadline = time.monotonic() + 30
            while not gone(run.restored_pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        if run in self.trainers:
            self.trainers.remove(run)

    # a stop snapshot and a restore, for either stack
    def stop_restore(self, run: Trainer, pid: int, dump: Callable[[], dict[str, Any]],
                     restore: Callable[[], dict[str, Any]], *, cold: bool) -> dict[str, Any]:
        gap = self.args.gap
        t_req = time.time()
        dumped = dump()
        t_image = time.time()
        reap(run, pid)
        last_before = run.rows()[-1][0]
        cache = drop_caches() if cold else {"page_cache": "warm (the image as just written)", "dropped": False}
        t_restore = time.time()
        restored = restore()
        t_back = time.time()
        run.restored_pid = restored["pid"]
        first = first_step_after(run, t_restore, self.timeout)
        then = wait_step(run, first[0] + gap, self.timeout)  # it goes on stepping
        return {**dumped, "stop_to_image_s": t_image - t_req, **cache, **restored,
                "restore_call_s": t_back - t_restore, "restore_to_first_new_step_s": first[2] - t_restore,
                "last_step_before": last_before, "first_new_step": first[0], "stepped_on_to": then[0]}

    def snapshots(self, run: Trainer, pid: int, label: str, stack: str, out: dict[str, Any],
                  dump: Callable[[int, Path, bool], dict[str, Any]],
                  restore: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        """For either stack: a leave-running snapshot (its stall), then a stop + warm restore and a
        stop of the restored trainer + cold restore. `dump(pid, images, leave_running)` and
        `restore(images)` are the stack's; the run is finished either way."""
        a, gap = self.args, self.args.gap
        try:
            wait_step(run, a.at, self.timeout)
            out.update(launch_to_first_step_s=run.rows()[0][2] - run.launched_at, params_logged=logged_params(run))
            img = self.base / f"{label}-{stack}-lr.img"
            t_req = time.time()
            d = dump(pid, img, True)
            t_done = time.time()
            wait_step(run, run.rows()[-1][0] + gap, self.timeout)
            out["leave_running"] = {"stall_s": stall(run.rows(), t_req, t_done),
                                    "request_to_complete_image_s": t_done - t_req, **d,
                                    "image_parts": image_parts_of(img, pid)}
            shutil.rmtree(img, ignore_errors=True)
            say(f"{label} {stack} leave-running: stall {_f(out['leave_running']['stall_s'])} s, "
                f"image {d['image_bytes'] / 1e9:.2f} GB")
            for key, cold in (("stop_warm", False), ("stop_cold", True)):
                if cold and a.no_cold:
                    break
                wait_step(run, run.rows()[-1][0] + gap, self.timeout)
                target = running_pid(run)
                assert target is not None
                img = self.base / f"{label}-{stack}-{key}.img"
                out[key] = self.stop_restore(run, target, partial(dump, target, img, False), partial(restore, img),
                                             cold=cold)
                shutil.rmtree(img, ignore_errors=True)
                say(f"{label} {stack} {key}: stop->image {out[key]['stop_to_image_s']:.2f} s, "
                    f"image {out[key]['image_bytes'] / 1e9:.2f} GB, restore->first step "
                    f"{out[key]['restore_to_first_new_step_s']:.2f} s ({out[key]['page_cache'].split(' (')[0]})")
            out["step_time_s"] = median_step(run.rows())
            return _summary(out)
        finally:
            out["loss_bits"] = loss_bits(run)
            self.finish(run)

    def snapguard(self, label: str, w: int, layers: int) -> dict[str, Any]:
        config = self.config
        run = self.trainer(f"{label}-snapguard", w, layers, trimmed=True)
        pid = run.start(os.path.join(config.state_dir, "take"))

        def dump(target: int, img: Path, leave_running: bool) -> dict[str, Any]:
            before, samples, stop = vm_counters(), [], threading.Event()

            def sample() -> None:  # dirty and writeback pages through the dump, every half second
                t0 = time.monotonic()
                while not stop.wait(0.5):
                    c = vm_counters()
                    samples.append((round(time.monotonic() - t0, 1), c.get("nr_dirty"), c.get("nr_writeback")))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                out = _sg_dump(checkpoint_pid(target, str(img), config, leave_running=leave_running,
                                              take_wait_s=10.0))
            finally:
                stop.set()
                sampler.join()
            return {**out, "vm": {**vm_delta(before, vm_counters()), "dirty_writeback_samples": samples}}

        def restore(img: Path) -> dict[str, Any]:
            t0 = time.time()
            rs = restore_images(str(img), config)
            t1 = time.time()
            # the log: when its last line was written (the file's mtime), less that line's time since
            # CRIU's start, is when CRIU started logging; so the log says whether a restore's time
            # goes before its first line (exec, loading its libraries) or after its last (exit). On
            # the H200 a cold restore's went before it (run 11b: the digest check's reads beside it)
            log = img / "restore.log"
            lines = _read(log).splitlines()
            try:
                last_rel = float(lines[-1].split(")", 1)[0].strip("( "))
                mtime = log.stat().st_mtime
                edges = {"call_to_log_start_s": mtime - last_rel - t0, "log_end_to_return_s": t1 - mtime}
            except (IndexError, ValueError, OSError):
                edges = {}
            return {"pid": rs["pid"], "restore_timings": rs["timings"], "restore_marks": rs["criu_marks"],
                    "restore_counts": rs.get("counts", {}), "restore_checks_s": rs.get("preflight_checks_s"),
                    "restore_log_edges": edges,
                    "restore_log_head": lines[:12], "restore_log_tail": lines[-40:]}

        return self.snapshots(run, pid, label, "snapguard", {}, dump, restore)

    # the raw stack: criu dump/restore with its CUDA plugin, run here
    def _criu(self, argv: list[str], images: Path, log: str) -> float:
        t = time.monotonic()
        try:
            done = subprocess.run(argv, env=self.raw_env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=self.timeout, cwd=str(images))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{' '.join(argv[:2])} ran past {self.timeout:.0f} s (killed)") from None
        if done.returncode != 0:
            errors = [ln.strip() for ln in _read(images / log).splitlines() if "Error" in ln][-4:]
            raise RuntimeError(f"{' '.join(argv[:2])} exited {done.returncode}: "
                               f"{' | '.join(errors) or done.stderr.strip()[-600:]}")
        return time.monotonic() - t

    def _common(self, images: Path, log: str) -> list[str]:
        return ["--images-dir", str(images), "--work-dir", str(images), "--log-file", log,
                f"-v{sg_criu.CriuOptions.log_level}",
                "--libdir", self.config.criu_libdir, "--timeout", str(int(self.config.criu_timeout_s)),
                "--network-lock", "skip", "--shell-job"]

    def raw_dump(self, pid: int, images: Path, leave_running: bool) -> dict[str, Any]:
        images.mkdir(mode=0o700)
        argv = [self.config.criu, "dump", "--tree", str(pid), *self._common(images, "dump.log")]
        if leave_running:
            argv.append("--leave-running")
        secs = self._criu(argv, images, "dump.log")
        return {"image_bytes": dir_bytes(images), "criu_dump_s": secs,
                "dump_marks": sg_criu.log_marks(str(images / "dump.log"))}

    def raw_restore(self, images: Path) -> dict[str, Any]:
        pidfile = images / "restored.pid"
        argv = [self.config.criu, "restore", *self._common(images, "restore.log"), "--restore-detached",
                "--pidfile", str(pidfile)]
        secs = self._criu(argv, images, "restore.log")
        return {"pid": int(pidfile.read_text().strip()), "criu_restore_s": secs,
                "restore_marks": sg_criu.log_marks(str(images / "restore.log"))}

    def raw(self, label: str, w: int, layers: int) -> dict[str, Any]:
        run = self.trainer(f"{label}-raw", w, layers)
        pid = run.start()
        out: dict[str, Any] = {"cuda_checkpoint": self.cuda_checkpoint, "criu": self.config.criu,
                               "criu_libdir": self.config.criu_libdir}
        return self.snapshots(run, pid, label, "raw", out, self.raw_dump, self.raw_restore)

    def file(self, label: str, w: int, layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """torch.save + fsync after step `at`, DCP async_save `gap` steps later, in one trainer; then a
        cold resume from the torch.save file."""
        a, gap = self.args, self.args.gap
        path = self.base / f"{label}-ckpt.pt"
        dcp_dir = self.base / f"{label}-dcp"
        dcp_at = a.at + gap
        run = self.trainer(f"{label}-file", w, layers,
                           more=("--save-at", str(a.at), "--save-path", str(path),
                                 "--dcp-at", str(dcp_at), "--dcp-path", str(dcp_dir)))
        run.start()
        ts: dict[str, Any] = {}
        dc: dict[str, Any] = {}
        try:
            saved = wait_line(run, ("saved ",), self.timeout)
            wait_step(run, a.at + 1, self.timeout)
            fresh = run.rows()[0][2] - run.launched_at
            ts = {"stall_s": float(saved[2]), "step_gap_stall_s": step_gap_after(run.rows(), a.at),
                  "bytes": path.stat().st_size, "save_at_step": a.at, "fresh_launch_to_first_step_s": fresh,
                  "params_logged": logged_params(run), "what": "torch.save + flush + fsync + rename, in the step loop"}
            say(f"{label} torch.save: stall {ts['stall_s']:.2f} s, {ts['bytes'] / 1e9:.2f} GB")
            try:
                staged = wait_line(run, ("dcp-staged ", "dcp-failed "), self.timeout)
                if staged[0] == "dcp-failed":
                    raise RuntimeError(f"async_save: {' '.join(staged[2:])}")
                done = wait_line(run, ("dcp-done ", "dcp-failed "), self.timeout)
                if done[0] == "dcp-failed":
                    raise RuntimeError(f"async_save's write: {' '.join(done[2:])}")
                wait_step(run, dcp_at + 1, self.timeout)
                rows = run.rows()
                t_call = float(staged[3]) - float(staged[2])
                during = [b[2] - a_[2] for a_, b in zip(rows, rows[1:]) if a_[0] > dcp_at and b[2] <= float(done[3])]
                dc = {"stall_s": float(staged[2]), "step_gap_stall_s": step_gap_after(rows, dcp_at),
                      "write_done_s": float(done[2]), "bytes": dir_bytes(dcp_dir), "save_at_step": dcp_at,
                      "median_step_while_writing_s": statistics.median(during) if during else None,
                      "median_step_s": median_step(rows), "call_at": t_call,
                      "what": "torch.distributed.checkpoint.async_save, defaults (no process group, thread "
                              "executor, DefaultStager: unpinned host copy), FileSystemWriter fsyncs"}
                say(f"{label} dcp async_save: stall {dc['stall_s']:.2f} s, write done {dc['write_done_s']:.2f} s, "
                    f"{dc['bytes'] / 1e9:.2f} GB")
            except (RuntimeError, TimeoutError, OSError) as e:
                dc = _failed(e)
            ts["loss_bits"] = loss_bits(run)
            self.finish(run)
            shutil.rmtree(dcp_dir, ignore_errors=True)
            # the resume, from a cold page cache
            cache = drop_caches()
            resume = self.trainer(f"{label}-resume", w, layers, more=("--resume", str(path)))
            resume.start()
            wait_step(resume, a.at + 1, self.timeout)
            first = next(r for r in resume.rows() if r[0] == a.at + 1)
            ts.update(cache, resume_to_first_new_step_s=first[2] - resume.launched_at,
                      resume_first_step=first[0])
            say(f"{label} torch.save resume ({cache['page_cache'].split(' (')[0]}): launch -> first step "
                f"{ts['resume_to_first_new_step_s']:.2f} s (a fresh start: {fresh:.2f} s)")
            self.finish(resume)
            return ts, dc
        except (RuntimeError, TimeoutError, OSError, StopIteration, subprocess.SubprocessError) as e:
            if not ts:
                ts = _failed(e)
            else:
                ts.update(resume_failed=True, resume_error=f"{type(e).__name__}: {e}"[-2000:])
            return ts, dc or _failed(e)
        finally:
            self.finish(run)
            for r in list(self.trainers):
                if r.name == f"{label}-resume":
                    self.finish(r)
            path.unlink(missing_ok=True)
            shutil.rmtree(dcp_dir, ignore_errors=True)


VM_LEVELS = ("nr_dirty", "nr_writeback", "nr_dirty_threshold", "nr_dirty_background_threshold", "nr_free_pages")
VM_EVENTS = ("pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct", "compact_stall",
             "thp_fault_alloc", "thp_split_page", "thp_file_alloc", "thp_file_fallback", "allocstall_normal", "allocstall_movable", "pgmajfault")
VM_COUNTERS = VM_LEVELS + VM_EVENTS


def vm_counters() -> dict[str, int]:
    """The kernel's memory counters (/proc/vmstat, in pages or events) a large dump may be slowed by:
    the dirty page limits and writeback, reclaim and compaction, huge pages made (thp_file_alloc: a
    tmpfs's, the take point's spill) or split."""
    out: dict[str, int] = {}
    for line in _read(Path("/proc/vmstat")).splitlines():
        key, _, value = line.partition(" ")
        if key in VM_COUNTERS and value.strip().isdigit():
            out[key] = int(value)
    return out


def vm_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """Levels before and after (dirty, writeback, thresholds, free) and the events' counts between."""
    return {**{f"{k}_before": before.get(k) for k in VM_LEVELS}, **{f"{k}_after": after.get(k) for k in VM_LEVELS},
            **{k: after[k] - before[k] for k in VM_EVENTS if k in before and k in after}}


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _sg_dump(ck: dict[str, Any]) -> dict[str, Any]:
    return {"image_bytes": ck["image_bytes"], "checkpoint_timings": ck["timings"], "dump_marks": ck["criu_marks"],
            "preflight_checks_s": ck.get("preflight_checks_s", {}),
            "take_point": ck["take_point"], "warnings": [w["reason"] for w in ck["warnings"]],
            "checkpoint_counts": ck.get("counts", {})}


def _summary(out: dict[str, Any]) -> dict[str, Any]:
    """The figures the table shows, lifted out of the phases."""
    lr, warm, cold = out.get("leave_running", {}), out.get("stop_warm", {}), out.get("stop_cold", {})
    out["summary"] = {
        "stall_s": lr.get("stall_s"), "leave_running_request_to_image_s": lr.get("request_to_complete_image_s"),
        "stop_to_image_s": warm.get("stop_to_image_s"), "bytes": warm.get("image_bytes", lr.get("image_bytes")),
        "restore_warm_s": warm.get("restore_to_first_new_step_s"),
        "restore_cold_s": cold.get("restore_to_first_new_step_s"),
        "cold_dropped": cold.get("dropped"),
    }
    return out


def _failed(e: BaseException) -> dict[str, Any]:
    if isinstance(e, SnapguardError):
        return {"failed": True, "error": f"{e.failure.reason.name}: {e.failure.message}"[-3000:],
                "failure": e.failure.to_dict()}
    return {"failed": True, "error": f"{type(e).__name__}: {e}"[-3000:]}


def _f(v: Any, width: int = 0, prec: int = 2) -> str:
    if not isinstance(v, (int, float)):
        return f"{'-':>{width}}"
    if width and abs(v) >= 10 ** (width - prec - 3):  # keep a space between columns
        return f"{v:>{width}.3g}"
    return f"{v:>{width}.{prec}f}"


# -- the report --------------------------------------------------------------------------------

def arm_rows(size: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(arm, {stall, stop_to_image, bytes, warm, cold, note}) per arm of a size, for the tables."""
    arms = size.get("arms", {})
    rows = []
    sg_name = "snapguard (no grads)" if DROP_GRADS else "snapguard (trimmed)"
    for key, name in (("snapguard", sg_name), ("raw", "raw CRIU + plugin"),
                      ("torch_save", "torch.save + fsync"), ("dcp", "DCP async_save")):
        arm = arms.get(key)
        if arm is None:
            continue
        if arm.get("failed") or arm.get("skipped"):
            rows.append((name, {"note": ("SKIPPED: " + arm.get("why", "")) if arm.get("skipped")
                                else "FAILED: " + " ".join(str(arm.get("error", "")).split())[:160]}))
            continue
        if key in ("snapguard", "raw"):
            s = arm["summary"]
            note = "" if s.get("cold_dropped") or s.get("restore_cold_s") is None else "cold: page cache NOT dropped"
            rows.append((name, {"stall": s["stall_s"], "stop": s["stop_to_image_s"], "bytes": s["bytes"],
                                "warm": s["restore_warm_s"], "cold": s["restore_cold_s"], "note": note}))
        elif key == "torch_save":
            note = "cold = launch -> first step (process start included; fresh start " \
                f"{_f(arm.get('fresh_launch_to_first_step_s'))} s)"
            if arm.get("resume_failed"):
                note = "resume FAILED: " + arm.get("resume_error", "")[:120]
            elif arm.get("dropped") is False:
                note += "; page cache NOT dropped"
            rows.append((name, {"stall": arm.get("stall_s"), "stop": arm.get("stall_s"), "bytes": arm.get("bytes"),
                                "cold": arm.get("resume_to_first_new_step_s"), "note": note}))
        else:
            rows.append((name, {"stall": arm.get("stall_s"), "stop": arm.get("write_done_s"), "bytes": arm.get("bytes"),
                                "note": "stop->image = call -> write complete (training went on); step gap "
                                        f"at the call {_f(arm.get('step_gap_stall_s'))} s over the median; median "
                                        f"step while writing {_f(arm.get('median_step_while_writing_s'), 0, 3)} s vs "
                                        f"{_f(arm.get('median_step_s'), 0, 3)} s"}))
    return rows


def per_gb(cost: Any, nbytes: Any) -> float | None:
    if not isinstance(cost, (int, float)) or not isinstance(nbytes, (int, float)) or nbytes <= 0:
        return None
    return cost / (nbytes / 1e9)


def marginal(sizes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Between consecutive sizes: d(cost) / d(GB of the arm's bytes), how each cost grows with the state."""
    out = []
    done = [s for s in sizes if s.get("arms")]
    for lo, hi in zip(done, done[1:]):
        a_lo, a_hi = dict(arm_rows(lo)), dict(arm_rows(hi))
        for arm in a_hi:
            x, y = a_lo.get(arm, {}), a_hi[arm]
            if not isinstance(x.get("bytes"), (int, float)) or not isinstance(y.get("bytes"), (int, float)):
                continue
            db = (y["bytes"] - x["bytes"]) / 1e9
            if db < 0.1:  # under 100 MB apart (the CPU check's models): noise, not a slope
                continue
            row: dict[str, Any] = {"from": lo["size"], "to": hi["size"], "arm": arm, "delta_gb": db}
            for k in ("stall", "stop", "warm", "cold"):
                if isinstance(x.get(k), (int, float)) and isinstance(y.get(k), (int, float)) and db > 0:
                    row[f"{k}_s_per_gb"] = (y[k] - x[k]) / db
            out.append(row)
    return out


def render(report: dict[str, Any]) -> str:
    lines = []
    head = (f"{'arm':<22}{'stall s':>9}{'stop->image s':>15}{'GB':>8}{'restore warm s':>16}{'restore cold s':>16}"
            f"  note")
    for size in report["sizes"]:
        p = size.get("params_logged") or size["params"]
        lines.append(f"\n{size['size']}: {size['width']}x{size['layers']}, {p / 1e6:.1f} M parameters"
                     + (f" -- SKIPPED: {size['why']}" if size.get("skipped") else ""))
        if size.get("skipped"):
            continue
        lines += [head, "-" * len(head)]
        for name, r in arm_rows(size):
            gb = r.get("bytes") / 1e9 if isinstance(r.get("bytes"), (int, float)) else None
            lines.append(f"{name:<22}{_f(r.get('stall'), 9)}{_f(r.get('stop'), 15)}{_f(gb, 8)}{_f(r.get('warm'), 16)}"
                         f"{_f(r.get('cold'), 16)}  {r.get('note', '')}")
    lines.append("\nseconds per GB of the arm's own bytes (stall, stop->image, restore warm, restore cold)")
    head = f"{'size':<8}{'arm':<22}{'stall':>9}{'stop':>9}{'warm':>9}{'cold':>9}"
    lines += [head, "-" * len(head)]
    for size in report["sizes"]:
        if size.get("skipped"):
            continue
        for name, r in arm_rows(size):
            if "bytes" not in r:
                continue
            lines.append(f"{size['size']:<8}{name:<22}" + "".join(_f(per_gb(r.get(k), r.get("bytes")), 9, 3)
                                                                   for k in ("stall", "stop", "warm", "cold")))
    if report.get("marginal"):
        lines.append("\nmarginal seconds per GB between sizes (d cost / d bytes: how each cost grows with the state)")
        head = f"{'sizes':<16}{'arm':<22}{'stall':>9}{'stop':>9}{'warm':>9}{'cold':>9}"
        lines += [head, "-" * len(head)]
        for m in report["marginal"]:
            lines.append(f"{m['from'] + '->' + m['to']:<16}{m['arm']:<22}"
                         + "".join(_f(m.get(f"{k}_s_per_gb"), 9, 3) for k in ("stall", "stop", "warm", "cold")))
    lines.append("\nceilings on the H200 (s per GB): " + ", ".join(f"{k} {1 / v:.3f} ({v} GB/s)"
                                                            for k, v in CEILINGS_GB_S.items()))
    return "\n".join(lines)


def merge(out: Path, runs: list[Path]) -> int:
    """One report from several runs (each ran every arm of its sizes in one command; a device call's
    limit keeps all three sizes from one): their sizes in order, the marginal costs between them,
    and each size's source run, date and versions."""
    merged: dict[str, Any] = {"merged_from": [], "sizes": [], "notes": []}
    for path in runs:
        try:
            report = json.loads(path.read_text())
            sizes = report["sizes"]
            if not isinstance(sizes, list):
                raise TypeError("sizes is not a list")
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"scaling.py: --merge {path}: not a scaling.py report: {e}", file=sys.stderr)
            return 2
        done = [s for s in sizes if isinstance(s, dict) and s.get("arms") and not s.get("skipped")]
        names = [s["size"] for s in done]
        if dup := [n for n in names if n in {s["size"] for s in merged["sizes"]}]:
            print(f"scaling.py: --merge {path}: size {dup[0]} is in an earlier run too", file=sys.stderr)
            return 2
        merged["merged_from"].append({"path": str(path), "date": report.get("date"), "argv": report.get("argv"),
                                      "versions": report.get("versions"), "sizes": names})
        merged["sizes"] += [{**s, "run": str(path)} for s in done]
        for note in report.get("notes", []):
            if note not in merged["notes"]:
                merged["notes"].append(note)
    merged["marginal"] = marginal(merged["sizes"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2, default=str) + "\n")
    text = render(merged)
    out.with_suffix(".txt").write_text(text + "\n")
    print(text)
    return 0


# -- main --------------------------------------------------------------------------------------

class _Terminated(Exception):
    pass


def _on_term(signum: int, frame: object) -> None:
    raise _Terminated(f"signal {signum}")


def versions(config: Config) -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "kernel": os.uname().release}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = None
    try:
        out["criu"] = subprocess.run([config.criu, "--version"], capture_output=True, text=True,
                                     timeout=30).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        out["criu"] = None
    try:
        from snapguard.preflight.gpu import gpu_facts

        facts = gpu_facts() or {}
        out["driver"] = facts.get("driver_version")
        out["gpus"] = [g.get("name") for g in facts.get("gpus", [])]
    except Exception as e:  # NVML missing or broken: the run goes on
        out["gpus"] = f"unknown: {type(e).__name__}: {e}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON results path (OUT with .txt beside it gets the table)")
    ap.add_argument("--sizes", default="85m,350m,1.2b", help="comma-separated: 85m, 350m, 1.2b or WIDTHxLAYERS")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, in order, of: {', '.join(ARMS)} "
                    "(file: torch.save + DCP async_save in one trainer, then the torch.save resume)")
    ap.add_argument("--trainer-args", default="", help="extra train.py arguments (the CPU check: "
                    "\"--device cpu --batch 1\")")
    ap.add_argument("--trainer", choices=("drill", "host-data"), default="drill",
                    help="drill: the torch workload's train.py; host-data: bench/gpu/host_data_trainer.py, the same "
                         "model reading its batches from a tokenized dataset held in CPU memory (give its size in "
                         "--trainer-args \"--host-data-gb N\")")
    ap.add_argument("--steps", type=int, default=100000,
                    help="train.py --steps of every trainer: a cap, each is killed when its arm is done")
    ap.add_argument("--at", type=int, default=15, help="the first snapshot or save after this step")
    ap.add_argument("--gap", type=int, default=6, help="steps between one event and the next")
    ap.add_argument("--no-cold", action="store_true", help="skip the second stop snapshot and the cold restore")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="skip sizes, and arms whose estimate from the previous size would end, past this many "
                         "seconds from the start (default 480: with setup.sh, inside one 570 s device call)")
    ap.add_argument("--child-timeout-s", type=float, default=300.0, help="deadline on every wait and CRIU run")
    ap.add_argument("--workdir", help="images and files (default: a new directory in /var/tmp, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="run nothing: write OUT (and its table) from these runs' sizes, in order, with the "
                         "marginal costs between them; each size must come from one run")
    args = ap.parse_args()
    if args.merge:
        return merge(Path(args.out), [Path(p) for p in args.merge])
    t0 = time.monotonic()
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as e:
        print(f"scaling.py: --sizes: {e}", file=sys.stderr)
        return 2
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        print(f"scaling.py: --arms: of {', '.join(ARMS)}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("scaling.py: must run as root (CRIU)", file=sys.stderr)
        return 2
    if args.trainer == "host-data":  # torch_drill.Trainer starts whatever its module's TRAIN names
        import snapguard_lab.torch_drill as drill
        drill.TRAIN = Path(__file__).resolve().with_name("host_data_trainer.py")
    config = load()
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(
        prefix="snapguard-scaling-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    base.mkdir(parents=True, exist_ok=True)
    if any(base.iterdir()):
        print(f"scaling.py: {base} is not empty: earlier logs would be read as this run's", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "versions": versions(config),
        "workdir": str(base), "budget_s": args.budget_s, "at": args.at, "gap": args.gap, "arms": arms,
        "trainer": args.trainer, "trainer_args": args.trainer_args, "take_drop_grads": DROP_GRADS, "take_offload": OFFLOAD, "ceilings_gb_s": CEILINGS_GB_S,
        "sizes": [],
        "notes": ["stall: longest gap between step timestamps spanning the snapshot (or save), less the median step",
                  "restore: restore call -> first new step logged; torch.save resume: process launch -> first step",
                  "raw: criu + its CUDA plugin, with cuda-checkpoint resolved as snapguard does (the H200 "
                  "machine has no NVIDIA binary: snapguard's own tool); no take point, so untrimmed"]}
    say(json.dumps(report["versions"], default=str))
    say(f"workdir {base}; disk free {shutil.disk_usage(base).free / 1e9:.0f} GB")

    def save() -> None:
        report["seconds"] = time.monotonic() - t0
        report["marginal"] = marginal(report["sizes"])
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    _subreaper(True)
    old_term = signal.signal(signal.SIGTERM, _on_term)
    bench = Bench(args, config, base)
    took: dict[str, tuple[int, float]] = {}  # arm -> (params, seconds) of its last run
    try:
        for label, w, layers in sizes:
            params = param_count(w, layers)
            size: dict[str, Any] = {"size": label, "width": w, "layers": layers, "params": params, "arms": {}}
            report["sizes"].append(size)
            if time.monotonic() - t0 > args.budget_s:
                size.update(skipped=True, why=f"past --budget-s {args.budget_s:.0f} s")
                say(f"{label}: skipped ({size['why']})")
                save()
                continue
            say(f"{label}: {w}x{layers}, {params / 1e6:.1f} M parameters")
            for arm in arms:
                keys = ["torch_save", "dcp"] if arm == "file" else [arm]
                elapsed = time.monotonic() - t0
                est = None
                if arm in took:
                    p0, s0 = took[arm]
                    est = FIXED_S + max(s0 - FIXED_S, 0.0) * params / p0
                if elapsed > args.budget_s or (est is not None and elapsed + est > args.budget_s):
                    why = (f"past --budget-s {args.budget_s:.0f} s" if est is None else
                           f"estimated {est:.0f} s from the previous size, {elapsed:.0f} s gone of "
                           f"--budget-s {args.budget_s:.0f}")
                    for k in keys:
                        size["arms"][k] = {"skipped": True, "why": why, "estimate_s": est}
                    say(f"{label} {arm}: skipped ({why})")
                    save()
                    continue
                t_arm = time.monotonic()
                say(f"{label} {arm}: start")
                try:
                    if arm == "file":
                        size["arms"]["torch_save"], size["arms"]["dcp"] = bench.file(label, w, layers)
                    else:
                        size["arms"][arm] = getattr(bench, arm)(label, w, layers)
                except (SnapguardError, RuntimeError, TimeoutError, OSError, AssertionError, ValueError,
                        subprocess.SubprocessError) as e:
                    for k in keys:
                        size["arms"][k] = _failed(e)
                    say(f"{label} {arm}: FAILED: {' '.join(str(size['arms'][keys[0]]['error']).split())[:600]}")
                finally:
                    bench.kill_all()
                secs = time.monotonic() - t_arm
                for k in keys:
                    size["arms"][k]["arm_seconds"] = secs
                took[arm] = (params, secs)
                say(f"{label} {arm}: {secs:.0f} s")
                save()
            size["params_logged"] = next((a.get("params_logged") for a in size["arms"].values()
                                          if isinstance(a, dict) and a.get("params_logged")), None)
            size["snapguard_losses_vs"] = same_losses(size["arms"])
            save()
    except (_Terminated, KeyboardInterrupt) as e:
        report["interrupted"] = str(e) or type(e).__name__
        say(f"interrupted ({report['interrupted']}): trainers killed, results so far written")
    finally:
        bench.kill_all()
        signal.signal(signal.SIGTERM, old_term)
        _subreaper(False)
        save()
        if not args.keep and not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    text = render(report)
    failed = [f"{s['size']} {k}" for s in report["sizes"] for k, a in s.get("arms", {}).items() if a.get("failed")]
    skipped = [s["size"] for s in report["sizes"] if s.get("skipped")] + \
        [f"{s['size']} {k}" for s in report["sizes"] for k, a in s.get("arms", {}).items() if a.get("skipped")]
    text += (f"\n\nscaling: {len(report['sizes'])} size(s) in {time.monotonic() - t0:.0f} s; "
             f"failed: {', '.join(failed) or 'none'}; skipped: {', '.join(skipped) or 'none'}")
    out.with_suffix(".txt").write_text(text + "\n")
    print(text, flush=True)
    return 1 if failed or report.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
