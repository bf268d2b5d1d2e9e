"""`snapguard-lab drill --workload torch --arms goodput`: a seeded reclaim schedule replayed against
the real trainer, four ways of protecting it, and what each kept (DESIGN.md, "Recovery economics";
issue 14; the reference's follow-up 2, Tables 10 and 11).

The schedule: noticed reclaims (a Poisson process, every 300 s on average, each with a lead drawn
uniformly from 30-120 s before the machine is taken) and unannounced kills (every 1800 s on
average), over a 1500 s window, with files every 60 s; all of it divided by `compress` (the CPU
test runs a short window). Seeded: one seed gives one schedule, the same for every arm.

The arms, each a fresh run of the torch workload's trainer (`workloads/torch/train.py`, its own
periodic and on-demand file checkpoints: --save-dir, --save-every, SIGUSR1 for an urgent file):
  A  files every `file_every` s plus an urgent file on notice; the process trains on until the
     machine is taken at the end of the lead, then a replacement starts cold from the newest file.
  B  A plus the snapshot on notice: after the urgent file, `snapguard notice` to the arm's agent,
     which takes one stopping snapshot and pushes it to the arm's file:// store; the replacement
     restores it with `restore_from` when it is whole before the lead runs out, else starts cold
     from the newest file.
  C  B with files at the planner's cadence (snapguard.plan: Young's period from the failures a
     notice does not cover, with the file stall, cold start and snapshot costs calibrated first).
  D  the snapshot on notice and no files at all.
An unannounced kill is SIGKILL of the trainer. Then A starts cold from its newest file, B and C
restore the paired snapshot while no newer file exists (else cold from the newest file), D
restores its newest snapshot (or starts again from step 0 when it has none).

Context parity (on by default where the trainer uses CUDA, off with --no-context-parity): every
trainer process a launch starts (the uninterrupted run's, each arm's first, a cold start's) has its
CUDA state checkpointed and restored in place by the driver (lock, checkpoint, restore, unlock) right
after its first step. Under time-slicing the driver gives a context that went through
cuCheckpointProcessRestore a smaller share of a shared GPU than a fresh one: five trainers on one
H200, two of them restored, stepped 161 ms restored against 90 ms fresh, the GPU's total throughput
unchanged, and a leave-running snapshot of a fresh one moved it to the slow side
(bench/results/h200/share-probe-*). A job that owns its GPUs never meets that asymmetry; parity
keeps the drill measuring recovery rather than the driver's scheduling. Its stalls are in the
arms' steps and reported (`context_parity`). The first launch's stall is in every run's window, the
uninterrupted run's too; what a cold start's parity took is credited back as the steps the arm's
median pace makes in that time (`parity_credit_s`, `parity_credit_steps`; `goodput_uncredited`
leaves them out), since a cold start outside the drill has none.

Reported per arm: goodput (steps at the end of the window over the uninterrupted run's steps in
the same window, each window counted from the run's first step), steps lost per event, time from
each reclaim (the notice, the kill) to the first new step, the planner's prediction of the goodput
from the costs measured in this run and the realised schedule, and the loss bits of every logged
step (replays included) against the uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from snapguard import gpu_suspend
from snapguard import plan as planner
from snapguard.config import Config, load
from snapguard.takepoint import site_dir
from snapguard.notice import Registry, agent_dir, post_notice, read_journal
from snapguard.pipeline import restore_from
from snapguard.reasons import SnapguardError, failure_from

from .testbed import product_root
from .torch_drill import TRAIN, TRAINER_ENV

__all__ = ["ARMS", "REFERENCE_SHAPE", "ArmSpec", "Event", "Shape", "make_schedule", "predict", "run_goodput_drill"]

# A trainer never ends by itself: the drill kills it at the end of its window.
ENDLESS_STEPS = 10**9
KEEP_FILES = 2
PARITY_LOCK_S = 30.0  # the lock waits for the trainer's queued GPU work

# The trainer's file checkpoints (train.py --save-dir): files every `file_every` s and an urgent one
# on SIGUSR1, each after a step and holding it, logged as
#   saved <step> <stall s> <start time> <periodic|urgent>
# (the drill's step parser skips it), each new file removing all but the newest KEEP_FILES.


# --- the schedule ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The schedule's shape in drill seconds (the reference's compressed seconds)."""

    notice_every_s: float = 300.0
    lead_lo_s: float = 30.0
    lead_hi_s: float = 120.0
    unannounced_every_s: float = 1800.0
    file_every_s: float = 60.0
    window_s: float = 1500.0

    def scaled(self, compress: float) -> Shape:
        return Shape(*(v / compress for v in asdict(self).values()))


REFERENCE_SHAPE = Shape()


@dataclass(frozen=True)
class Event:
    t: float  # seconds after the run's first step
    kind: str  # "notice" or "unannounced"
    id: str
    lead: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def make_schedule(seed: int, shape: Shape) -> list[Event]:
    """Poisson notices (leads uniform) and Poisson unannounced kills inside the window, in time
    order; each kind from its own stream of the seed, so changing one rate keeps the other's events."""
    events: list[Event] = []
    for kind, every in (("notice", shape.notice_every_s), ("unannounced", shape.unannounced_every_s)):
        if not every or every <= 0 or not math.isfinite(every):
            continue
        rng = random.Random(f"snapguard-goodput-{seed}-{kind}")
        t = rng.expovariate(1.0 / every)
        while t < shape.window_s:
            lead = rng.uniform(shape.lead_lo_s, shape.lead_hi_s) if kind == "notice" else None
            events.append(Event(t, kind, f"{kind[0]}{len([e for e in events if e.kind == kind]) + 1}", lead))
            t += rng.expovariate(1.0 / every)
    return sorted(events, key=lambda e: e.t)


# --- the arms --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmSpec:
    name: str
    title: str
    files: str  # "fixed": every shape.file_every_s; "planner": the planner's cadence; "none"
    urgent_file: bool
    snapshot: bool


ARMS = (
    ArmSpec("A", "files every {P} s + urgent file on notice, cold start", "fixed", True, False),
    ArmSpec("B", "A + snapshot on notice", "fixed", True, True),
    ArmSpec("C", "snapshot on notice + files every {P} s (planner)", "planner", True, True),
    ArmSpec("D", "snapshot on notice, no files", "none", False, True),
)


def _snapguard_exe() -> str:
    for d in (os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin"):
        p = os.path.join(d, "snapguard")
        if os.access(p, os.X_OK):
            return p
    raise RuntimeError("the snapguard command is not installed beside this interpreter")


def _rows(log: Path) -> list[tuple[int, str, float]]:
    """(step, loss bits, time) per logged step, in file order."""
    out = []
    try:
        text = log.read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        p = line.split()
        if len(p) == 5 and p[0] == "step":
            out.append((int(p[1]), p[2], float(p[3])))
    return out


def _saves(log: Path) -> list[tuple[int, float, float, str]]:
    """(step, stall s, start time, kind) per file checkpoint train.py --save-dir wrote."""
    out = []
    try:
        text = log.read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        p = line.split()
        if len(p) == 5 and p[0] == "saved":
            out.append((int(p[1]), float(p[2]), float(p[3]), p[4]))
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2:].split()[:1] in ([b"Z"], [b"X"])


def _wait(pred: Callable[[], Any], timeout: float, what: str, poll: float = 0.02) -> Any:
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(poll)


def _sleep_until(t: float) -> None:
    while True:
        left = t - time.time()
        if left <= 0:
            return
        time.sleep(min(left, 0.25))


class Proc:
    """One trainer process of an arm: launched (our child) or restored by CRIU (not our child)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None, how: str) -> None:
        self.pid, self.popen, self.how = pid, popen, how

    def kill(self) -> None:
        try:
            if self.popen is not None:
                os.killpg(self.popen.pid, signal.SIGKILL)  # it leads its own session
            else:
                os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self.reap()

    def reap(self, timeout: float = 60) -> None:
        if self.popen is not None:
            self.popen.wait(timeout=timeout)
            return
        try:
            os.waitpid(self.pid, 0)  # ours when this process is the restored tree's subreaper
        except ChildProcessError:
            pass
        _wait(lambda: _gone(self.pid), timeout, f"pid {self.pid} to go")


class Run:
    """One line of trainers logging into one file, with its checkpoints, agent and store."""

    def __init__(self, base: Path, name: str, trainer_args: tuple[str, ...], *, file_every: float = 0.0,
                 reset_on_urgent: bool = False, snapshot: bool = False, parity: bool = False,
                 say: Callable[[str], None] = print) -> None:
        self.name, self.dir = name, base / name
        self.parity = parity
        self.parity_stalls: list[dict[str, Any]] = []
        self.dir.mkdir(mode=0o700, parents=True)
        self.log = self.dir / "train.log"
        self.ckdir = self.dir / "checkpoints"
        self.ckdir.mkdir(mode=0o700)
        self.generation = 0  # one agent state per machine the arm lost with a snapshot in flight
        self.state = self.dir / "state"
        self.trainer_args = trainer_args
        self.file_every, self.reset_on_urgent, self.snapshot = file_every, reset_on_urgent, snapshot
        self.say = say
        self.env = {**os.environ, "SNAPGUARD_STATE_DIR": str(self.state)}
        self.config: Config = load(self.env)
        self.job = f"goodput-{name}"
        self.store_dir = self.dir / "store"
        self.store_url = f"file://{self.store_dir}"
        self.proc: Proc | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.launches = 0

    # -- trainers --
    def launch(self, resume: str | None = None) -> Proc:
        env = {**os.environ, **TRAINER_ENV}
        if "cpu" in self.trainer_args:
            env.setdefault("OMP_NUM_THREADS", "1")  # the arms share the cores: same threads for every run
        # the take point (as the torch drill's trimmed arms): the snapshot holds the trainer at a
        # step boundary and releases PyTorch's free reserve first; every run gets it, for parity
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site_dir(), product_root(), env.get("PYTHONPATH")]))
        env["SNAPGUARD_TAKE_DIR"] = str(self.state / "take")
        out = open(self.dir / "trainer.out", "ab")  # O_APPEND: restorable after growth
        self.launches += 1
        popen = subprocess.Popen(
            [sys.executable, str(TRAIN), "--steps", str(ENDLESS_STEPS), "--log", str(self.log),
             "--result", str(self.dir / f"result-{self.launches}.json"), *self.trainer_args,
             "--save-dir", str(self.ckdir), "--keep", str(KEEP_FILES),
             # A's period runs on past its urgent files; B's and C's restart at each
             *(["--save-every", repr(self.file_every)] if self.file_every > 0 else []),
             *(["--urgent-keeps-period"] if self.file_every > 0 and not self.reset_on_urgent else []),
             *(["--resume", resume] if resume else [])],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True)
        out.close()
        self.proc = Proc(popen.pid, popen, "resume" if resume else "launch")
        return self.proc

    def first_step_after(self, moment: float, timeout: float = 600) -> tuple[int, str, float]:
        def new() -> tuple[int, str, float] | None:
            after = [row for row in _rows(self.log) if row[2] > moment]
            if after:
                return after[0]
            if self.proc is not None and self.proc.popen is not None and self.proc.popen.poll() is not None:
                tail = (self.dir / "trainer.out").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{self.name}: the trainer exited {self.proc.popen.returncode}: {tail}")
            return None
        return _wait(new, timeout, f"{self.name}: no step after {moment:.3f}")

    def context_parity(self) -> None:
        """A launched trainer's CUDA state through the driver's checkpoint and restore, in place, so
        that it shares the GPU as a restored one does (see the module's docstring). After its first
        step: its context exists and the launch is timed already."""
        if not self.parity or self.proc is None:
            return
        pid, t0 = self.proc.pid, time.time()
        gpu_suspend.suspend([pid], PARITY_LOCK_S)  # lock + checkpoint (brought back itself on a failure)
        outcome = gpu_suspend.resume([pid])[pid]  # restore + unlock
        if outcome != "running" and not outcome.startswith("recovered"):
            raise RuntimeError(f"{self.name}: context parity left trainer {pid} {outcome}")
        self.parity_stalls.append({"pid": pid, "at": round(t0, 3), "seconds": round(time.time() - t0, 3)})

    def last_step(self) -> int:
        rows = _rows(self.log)
        return rows[-1][0] if rows else 0

    def newest_file(self) -> tuple[int, str] | None:
        names = sorted(n for n in os.listdir(self.ckdir) if n.startswith("ckpt-") and n.endswith(".pt"))
        return (int(names[-1][5:-3]), str(self.ckdir / names[-1])) if names else None

    def urgent_save(self, timeout: float = 300) -> tuple[int, float, float]:
        """SIGUSR1, then the file it wrote: (step, stall, start time)."""
        assert self.proc is not None
        before = len(_saves(self.log))
        os.kill(self.proc.pid, signal.SIGUSR1)
        got = _wait(lambda: [s for s in _saves(self.log)[before:] if s[3] == "urgent"], timeout,
                    f"{self.name}: no urgent file checkpoint")
        step, stall, start, _ = got[0]
        return step, stall, start

    # -- agent, store --
    def start_agent(self) -> None:
        self.store_dir.mkdir(mode=0o700, exist_ok=True)
        log = open(self.dir / "agent.log", "ab")
        self.agent = subprocess.Popen([_snapguard_exe(), "agent", "--interval", "0.2", "--store", self.store_url,
                                       "--images", str(self.dir / "agent-images")],
                                      env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                      start_new_session=True)
        log.close()
        _wait(lambda: any(e["event"] == "agent_started" for e in self.journal()), 60,
              f"{self.name}: the agent did not start; see {self.dir / 'agent.log'}")

    def kill_agent(self) -> None:
        """The machine is gone with the agent on it: the agent and the CRIU it runs (a process group
        of its own, named by the image directory it writes) are killed, as the machine's loss would."""
        if self.agent is not None and self.agent.poll() is None:
            os.killpg(self.agent.pid, signal.SIGKILL)
            self.agent.wait()
        images = str(self.dir / "agent-images").encode()
        strays = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if any(a.startswith(images) for a in argv) and int(pid) != os.getpid():
                strays.append(int(pid))
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        for pid in strays:
            _wait(lambda pid=pid: _gone(pid), 30, f"CRIU {pid} to go")

    def replace_agent(self) -> None:
        """A fresh agent, with a state of its own, for the replacement machine."""
        self.kill_agent()
        self.generation += 1
        self.state = self.dir / f"state-{self.generation}"
        self.env = {**os.environ, "SNAPGUARD_STATE_DIR": str(self.state)}
        self.config = load(self.env)
        self.start_agent()

    def stop_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.agent.pid, signal.SIGKILL)
                self.agent.wait()

    def journal(self) -> list[dict[str, Any]]:
        return read_journal(str(self.state / "agent"))

    def protect(self, pid: int, epoch: int | None = None) -> None:
        """`snapguard protect --pid`: the agent's registry holds this arm's one current trainer."""
        reg = Registry(agent_dir(self.config))
        for key in reg.load():
            reg.remove(key)
        reg.add_pid(pid, self.job, str(self.ckdir), epoch)

    def notice_snapshot(self, notice_id: str, deadline: float) -> dict[str, Any]:
        """`snapguard notice` to the agent, then its journal until the image is whole in the store or
        the deadline passes: {"image": store name, "uploaded_at", "sealed_at", "bytes"} or {"failed"}."""
        out: dict[str, Any] = {"posted_at": time.time()}
        post_notice(self.config, f"goodput drill reclaim {notice_id}", notice_id=notice_id,
                    lead_s=max(deadline - time.time(), 0.001))
        nid = f"local:{notice_id}"
        while True:
            image = None
            for e in self.journal():
                if e.get("notice") == nid and e["event"] == "snapshot_started":
                    image = e["image"]
                    out["started_at"] = e["t"]
                elif e.get("notice") == nid and e["event"] == "snapshot_failed":
                    return {**out, "failed": e.get("record", {}).get("reason", "snapshot_failed")}
                elif image and e.get("image") == image and e["event"] == "snapshot_sealed":
                    out.update(sealed_at=e["t"], bytes=e.get("image_bytes"))
                elif image and e.get("image") == image and e["event"] == "upload_failed":
                    return {**out, "failed": e.get("record", {}).get("reason", "upload_failed")}
                elif image and e.get("image") == image and e["event"] == "uploaded":
                    shutil.rmtree(image, ignore_errors=True)  # in the store now: the node's copy goes
                    return {**out, "image": os.path.basename(image), "uploaded_at": e["t"]}
                elif e.get("notice") == nid and e["event"] == "notice_done" and not image:
                    return {**out, "failed": "no workload snapshotted"}
            if time.time() > deadline:
                return {**out, "failed": "late", "image_name": os.path.basename(image) if image else None}
            time.sleep(0.02)

    def restore(self, image: str) -> tuple[Proc, dict[str, Any]]:
        pulled = self.dir / "pulled" / f"{image}-{time.monotonic_ns()}"
        pulled.parent.mkdir(mode=0o700, exist_ok=True)
        try:
            # the drill has ended the job's previous copy itself (stopped on the notice, or killed as
            # the machine went): it is provably gone, so an image already restored once (the newest
            # after an unannounced loss with no file checkpoint) is restored again, forced
            res = restore_from(self.store_url, self.config, job=self.job, image=image, images=str(pulled), force=True)
        finally:
            shutil.rmtree(pulled, ignore_errors=True)  # restored: the copy is not needed any more
        self.proc = Proc(int(res["pid"]), None, "restore")
        return self.proc, res

    def prune_store(self, keep: set[str]) -> None:
        """Drop the images of the arm's store it will never restore (the H200's are GBs each)."""
        from snapguard.store import open_store

        store = open_store(f"file://{self.store_dir}")
        for ref in store.images(self.job, whole_only=False):
            if ref.name not in keep:
                store.delete_image(self.job, ref.name)

    def teardown(self) -> None:
        if self.agent is not None:
            self.kill_agent()  # first: a trainer CRIU still traces cannot be reaped
        if self.proc is not None:
            try:
                self.proc.kill()
            except (TimeoutError, subprocess.TimeoutExpired) as e:
                self.say(f"{self.name}: trainer {self.proc.pid} not reaped at teardown: {e}")


# --- one arm through the schedule ----------------------------------------------------------


def relaunch_parity_s(stalls: list[dict[str, Any]], end: float) -> float:
    """The seconds of context parity that the launches after a run's first one spent, those begun
    before `end` whole (one that runs past the end still kept the trainer from stepping up to it).
    Parity is the drill's own instrument, not part of a recovery: the first launch's is in every
    run's window, the uninterrupted run's too, but a cold start outside the drill has none; the arm
    is credited the steps its own pace makes in that time (`parity_credit_steps`)."""
    return sum(float(p["seconds"]) for p in stalls[1:] if p["at"] < end)


def down_intervals(arm: dict[str, Any]) -> list[tuple[float, float]]:
    """When an arm's training stood still for an event, as absolute times: from the kill (A, an
    unannounced loss) or the snapshot's freeze to the first new step."""
    t0, out = arm["first_step_time"], []
    for e in arm.get("events", []):
        if "kill_s" in e and "kill_to_first_new_step_s" in e:
            start = t0 + e["kill_s"]
            out.append((start, start + e["kill_to_first_new_step_s"]))
        elif "notice_to_first_new_step_s" in e:
            notice = t0 + e["handled_s"]
            out.append((notice + (e.get("snapshot") or {}).get("notice_to_freeze_s", 0.0),
                        notice + e["notice_to_first_new_step_s"]))
    return out


def pace_while_arms_down(rows: list[tuple[int, str, float]], start: float, end: float,
                         down: list[tuple[float, float]]) -> dict[str, float | None]:
    """The uninterrupted run's steps per second inside [start, end] while any arm stood still and
    while none did: sharing one GPU, it steps faster when fewer share it (the planner knows no such
    thing, so its prediction and the measured goodput part by that much)."""
    spans = sorted((max(a, start), min(b, end)) for a, b in down if min(b, end) > max(a, start))
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    down_s = sum(b - a for a, b in merged)
    times = [t for _, _, t in rows if start < t <= end]
    in_down = sum(1 for t in times if any(a < t <= b for a, b in merged))
    up_s = (end - start) - down_s
    return {"seconds_any_arm_down": round(down_s, 3),
            "steps_per_s_any_arm_down": round(in_down / down_s, 3) if down_s > 0 else None,
            "steps_per_s_no_arm_down": round((len(times) - in_down) / up_s, 3) if up_s > 0 else None}


def steps_at_shared_pace(ref_steps: int, pace: dict[str, float | None] | None) -> int | None:
    """The uninterrupted run's steps had it kept its pace of the times no arm stood still all
    through the window: what it steps beyond that while arms are down is the GPU they left it, an
    effect of sharing one GPU, not of the arms' recoveries. None when the pace is not known
    (a sequential drill, no arm down) or it did not step faster while arms were down."""
    if not pace or pace.get("steps_per_s_any_arm_down") is None or not pace.get("steps_per_s_no_arm_down"):
        return None
    extra = pace["seconds_any_arm_down"] * (pace["steps_per_s_any_arm_down"] - pace["steps_per_s_no_arm_down"])
    return ref_steps - round(extra) if extra > 0 else None


def at_shared_pace(arms: dict[str, dict[str, Any]], ref_steps: int, pace: dict[str, float | None] | None) -> int | None:
    """steps_at_shared_pace, and each measured arm's goodput against it and the planner's
    difference from that (`goodput_at_shared_pace`, `difference_points_at_shared_pace`)."""
    shared = steps_at_shared_pace(ref_steps, pace)
    for a in arms.values():
        if shared and "goodput" in a:
            a["goodput_at_shared_pace"] = (a["steps_at_window_end"] + a["parity_credit_steps"]) / shared
            a["difference_points_at_shared_pace"] = 100.0 * (a["goodput_at_shared_pace"] - a["predicted_goodput"])
    return shared


def credit_steps(credit_s: float, step_time_s: float | None) -> int:
    """`credit_s` of parity as steps at the arm's median pace in the window (not run on after the
    window, when the other arms sharing the GPU have stopped and it would step faster)."""
    return round(credit_s / step_time_s) if credit_s > 0 and step_time_s else 0


class Arm:
    def __init__(self, spec: ArmSpec, base: Path, shape: Shape, schedule: list[Event], trainer_args: tuple[str, ...],
                 file_every: float | None, say: Callable[[str], None], parity: bool = False) -> None:
        self.spec, self.shape, self.schedule = spec, shape, schedule
        self.file_every = file_every
        self.say = lambda text: say(f"goodput {spec.name}: {text}")
        self.run = Run(base, f"arm-{spec.name}", trainer_args, file_every=file_every or 0.0,
                       reset_on_urgent=spec.snapshot, snapshot=spec.snapshot, parity=parity, say=self.say)
        self.t0 = 0.0
        self.machine = 1
        self.events: list[dict[str, Any]] = []
        self.kills: list[tuple[float, int]] = []  # (time, the step training continues from)
        self.doomed: tuple[float, int, dict[str, Any]] | None = None  # A: (kill time, machine, its event)
        self.snapshot: tuple[str, int] | None = None  # (store image, step it holds): the newest restored

    def rel(self, t: float) -> float:
        return round(t - self.t0, 3)

    def go(self) -> dict[str, Any]:
        r = self.run
        r.launch()  # its interpreter loads torch while the agent starts
        if self.spec.snapshot:
            r.start_agent()
        first = r.first_step_after(0)
        self.t0 = first[2]
        r.context_parity()
        if self.spec.snapshot:
            r.protect(r.proc.pid)  # type: ignore[union-attr]
        self.say(f"first step at {time.strftime('%H:%M:%S', time.localtime(self.t0))}, window "
                 f"{self.shape.window_s:.0f} s, {len(self.schedule)} events, files "
                 + (f"every {self.file_every:.1f} s" if self.file_every else "none"))
        end = self.t0 + self.shape.window_s
        queue = list(self.schedule)
        while True:
            nxt = queue[0].t + self.t0 if queue else math.inf
            if self.doomed and self.doomed[0] <= nxt:
                if self.doomed[0] >= end:
                    break
                _sleep_until(self.doomed[0])
                self.reclaim_a()
                continue
            if not queue or nxt >= end or time.time() >= end:
                break  # what falls due after the window (or while recovering past it) is not played
            ev = queue.pop(0)
            _sleep_until(nxt)
            if ev.kind == "notice":
                self.notice(ev)
            else:
                self.unannounced(ev)
        if self.doomed is not None:
            self.doomed[2]["outcome"] = "reclaim after the window"
        _sleep_until(end)
        reached = self.progress_at(end)
        r.teardown()
        return self.report(reached, [e for e in queue if e.t < self.shape.window_s],
                           relaunch_parity_s(r.parity_stalls, end))

    def progress_at(self, t: float) -> int:
        """The step training had reached at t: the last step logged by then, unless a kill after it
        sent training back (then the step it continues from)."""
        rows = [row for row in _rows(self.run.log) if row[2] <= t]
        step, at = (rows[-1][0], rows[-1][2]) if rows else (0, self.t0)
        for when, resume in self.kills:
            if at < when <= t:
                step = resume
        return step

    # -- events --
    def _new_event(self, ev: Event, **fields: Any) -> dict[str, Any]:
        rec = {"id": ev.id, "kind": ev.kind, "scheduled_s": round(ev.t, 3), "handled_s": self.rel(time.time()),
               "machine": self.machine, **({"lead_s": round(ev.lead, 3)} if ev.lead is not None else {}), **fields}
        self.events.append(rec)
        return rec

    def notice(self, ev: Event) -> None:
        r = self.run
        t_notice = time.time()
        assert ev.lead is not None
        deadline = t_notice + ev.lead
        if self.doomed is not None:  # A: this machine is already going
            self._new_event(ev, outcome="absorbed", note=f"machine {self.machine} already has a notice")
            self.say(f"notice {ev.id} at {self.rel(t_notice)} s falls on machine {self.machine}, already doomed")
            return
        rec = self._new_event(ev)
        if self.spec.urgent_file:
            step, stall, start = r.urgent_save()
            rec["urgent_file"] = {"step": step, "stall_s": round(stall, 4), "after_notice_s": round(start - t_notice, 3)}
        if not self.spec.snapshot:
            self.doomed = (deadline, self.machine, rec)
            rec["outcome"] = "pending"
            self.say(f"notice {ev.id} at {self.rel(t_notice)} s, lead {ev.lead:.1f} s: urgent file at step "
                     f"{rec['urgent_file']['step']}, trains on until the machine goes")
            return
        got = r.notice_snapshot(f"goodput-{self.spec.name}-{ev.id}-m{self.machine}", deadline)
        last_before = r.last_step()
        if "image" in got:
            rec["snapshot"] = {"image": got["image"], "bytes": got.get("bytes"),
                               "notice_to_freeze_s": round(got["started_at"] - t_notice, 3),
                               "notice_to_sealed_s": round(got.get("sealed_at", math.nan) - t_notice, 3),
                               "notice_to_whole_in_store_s": round(got["uploaded_at"] - t_notice, 3),
                               "request_to_whole_in_store_s": round(got["uploaded_at"] - got["posted_at"], 3),
                               "spare_lead_s": round(deadline - got["uploaded_at"], 3)}
            assert r.proc is not None
            r.proc.reap()  # CRIU ended it: its pid must be free for the restore
            t_restore = time.time()
            proc, res = r.restore(got["image"])
            first = r.first_step_after(t_restore)
            r.protect(proc.pid, res.get("fence_epoch"))
            self.machine += 1
            self.snapshot = (got["image"], first[0] - 1)
            r.prune_store({got["image"]})
            rec.update(outcome="restored", last_step_before=last_before, resumed_from_step=first[0] - 1,
                       first_new_step=first[0], steps_lost=last_before - (first[0] - 1),
                       restore_to_first_new_step_s=round(first[2] - t_restore, 3),
                       freeze_to_first_new_step_s=round(first[2] - got["started_at"], 3),
                       notice_to_first_new_step_s=round(first[2] - t_notice, 3),
                       fence_epoch=res.get("fence_epoch"))
            self.say(f"notice {ev.id} at {self.rel(t_notice)} s, lead {ev.lead:.1f} s: whole in the store after "
                     f"{rec['snapshot']['notice_to_whole_in_store_s']:.2f} s, restored, step {first[0]} "
                     f"{rec['notice_to_first_new_step_s']:.2f} s after the notice ({rec['steps_lost']} lost)")
            return
        # not whole before the lead ran out (or failed): the machine goes at the deadline
        rec["snapshot"] = {"failed": got["failed"]}
        _sleep_until(deadline)
        self._lost_machine(rec, deadline, t_notice, why=f"snapshot {got['failed']}", agent_lost=True)

    def reclaim_a(self) -> None:
        assert self.doomed is not None
        when, _, rec = self.doomed
        self.doomed = None
        self._lost_machine(rec, when, t_notice=self.t0 + rec["handled_s"])

    def unannounced(self, ev: Event) -> None:
        rec = self._new_event(ev)
        if self.doomed is not None:
            rec["note"] = f"the machine under notice {self.doomed[2]['id']} dies before its reclaim"
            self.doomed[2].update(outcome="overtaken", note=f"unannounced kill {ev.id} came first")
            self.doomed = None
        self._lost_machine(rec, time.time())

    def _lost_machine(self, rec: dict[str, Any], t_kill: float, t_notice: float | None = None,
                      why: str = "", agent_lost: bool = False) -> None:
        """The machine is gone at t_kill (SIGKILL of whatever runs): recover as the arm does. With
        `agent_lost` the agent went with it mid-snapshot: killed with its CRIU, and the replacement
        gets an agent of its own."""
        r = self.run
        assert r.proc is not None
        killed_at = time.time()
        if agent_lost:
            try:
                os.kill(r.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            r.replace_agent()
        r.proc.kill()
        last_before = r.last_step()
        file = r.newest_file() if self.spec.files != "none" else None
        snap = self.snapshot if self.spec.snapshot else None
        use_snapshot = snap is not None and (file is None or file[0] <= snap[1])
        t_start = time.time()
        res: dict[str, Any] = {}
        if snap is not None and use_snapshot:
            proc, res = r.restore(snap[0])
            how, resume = "restored paired snapshot", snap[1]
        else:
            proc = r.launch(file[1] if file else None)
            how, resume = ("cold start from file" if file else "start from step 0"), (file[0] if file else 0)
        self.kills.append((killed_at, resume))
        first = r.first_step_after(t_start)
        if not use_snapshot:
            r.context_parity()
        if self.spec.snapshot:
            r.protect(proc.pid, res.get("fence_epoch"))
        self.machine += 1
        rec.update(outcome=how, kill_s=self.rel(t_kill), last_step_before=last_before, resumed_from_step=resume,
                   first_new_step=first[0], steps_lost=last_before - resume,
                   kill_to_first_new_step_s=round(first[2] - t_kill, 3),
                   **({"notice_to_first_new_step_s": round(first[2] - t_notice, 3)} if t_notice else {}),
                   **({"why": why} if why else {}))
        self.say(f"{rec['kind']} {rec['id']}: machine taken at {rec['kill_s']} s{' (' + why + ')' if why else ''}, "
                 f"{how} at step {resume}, step {first[0]} after {rec['kill_to_first_new_step_s']:.2f} s, "
                 f"{rec['steps_lost']} steps lost")

    # -- the arm's record --
    def report(self, reached: int, late: list[Event], credit_s: float) -> dict[str, Any]:
        """The arm's record; `late`: scheduled inside the window, due only after it ended here;
        `credit_s`: its cold starts' context parity (relaunch_parity_s)."""
        saves = _saves(self.run.log)
        in_window = [s for s in saves if s[2] <= self.t0 + self.shape.window_s]
        return {
            "arm": self.spec.name, "title": self.spec.title.replace("{P}", f"{self.file_every or 0:.1f}"),
            "file_every_s": self.file_every, "urgent_file": self.spec.urgent_file, "snapshot": self.spec.snapshot,
            "first_step_time": self.t0, "steps_at_window_end": reached, "parity_credit_s": round(credit_s, 3),
            "events": self.events,
            # due inside the window but only after its end in this run, the arm still recovering
            # from an earlier event (the reference's "reclaim after the window")
            "events_after_window": [e.to_dict() for e in late],
            "file_checkpoints": {"periodic": sum(1 for s in in_window if s[3] == "periodic"),
                                 "urgent": sum(1 for s in in_window if s[3] == "urgent"),
                                 "stall_s": [round(s[1], 4) for s in saves],
                                 "periodic_stall_share": sum(s[1] for s in in_window if s[3] == "periodic")
                                 / self.shape.window_s},
            "launches": self.run.launches, "context_parity": self.run.parity_stalls, "log": str(self.run.log),
        }


# --- calibration, reference, prediction -------------------------------------------------------


def calibrate(base: Path, trainer_args: tuple[str, ...], say: Callable[[str], None], saves: int = 3) -> dict[str, Any]:
    """The costs the planner needs before any arm runs (to set arm C's cadence): file checkpoint
    stall (median of `saves` urgent files), cold start (kill to the first new step of a resume from
    the newest file), and one snapshot on notice through the agent and the store (notice to whole
    in the store, restore to first new step, notice to first new step)."""
    r = Run(base, "calibration", trainer_args, snapshot=True, say=say)
    try:
        r.launch()  # its interpreter loads torch while the agent starts
        r.start_agent()
        r.first_step_after(0)
        stalls = []
        for _ in range(saves):
            step = r.last_step()
            _wait(lambda: r.last_step() >= step + 3, 300, "calibration steps")
            stalls.append(r.urgent_save()[1])
        _wait(lambda: r.last_step() >= step + 3, 300, "calibration steps")
        t_kill = time.time()
        assert r.proc is not None
        r.proc.kill()
        file = r.newest_file()
        assert file is not None
        r.launch(file[1])
        cold = r.first_step_after(t_kill)[2] - t_kill
        r.protect(r.proc.pid)
        step = r.last_step()
        _wait(lambda: r.last_step() >= step + 3, 300, "calibration steps")
        t_notice = time.time()
        got = r.notice_snapshot("goodput-calibration", t_notice + 600)
        if "image" not in got:
            raise RuntimeError(f"calibration: the snapshot on notice failed ({got['failed']}); see "
                               f"{r.dir / 'agent.log'}")
        r.proc.reap()
        t_restore = time.time()
        r.restore(got["image"])
        first = r.first_step_after(t_restore)
        out = {"file_stall_s": statistics.median(stalls), "file_stalls_s": [round(s, 4) for s in stalls],
               "cold_start_s": cold, "snapshot_lag_s": got["uploaded_at"] - got["posted_at"],
               "snapshot_restore_s": first[2] - t_restore, "notice_downtime_s": first[2] - t_notice,
               "snapshot_bytes": got.get("bytes"), "log": str(r.log)}
        say(f"goodput: calibrated: file stall {out['file_stall_s']:.3f} s, cold start {cold:.2f} s, notice to "
            f"whole in store {out['snapshot_lag_s']:.2f} s, restore to first step {out['snapshot_restore_s']:.2f} s")
        return out
    finally:
        r.teardown()


def _mix(schedule: list[Event], window: float) -> planner.FailureMix:
    notices = [e for e in schedule if e.kind == "notice" and e.t < window]
    unannounced = [e for e in schedule if e.kind == "unannounced" and e.t < window]
    per_hour = planner.SECONDS_PER_HOUR / window
    lead = planner.LeadTime(points=tuple((e.lead or 0.0, 1.0) for e in notices)) if notices else None
    return planner.FailureMix(len(notices) * per_hour, len(unannounced) * per_hour, lead)


def cadence_for_c(cal: dict[str, Any], shape: Shape) -> float:
    """Arm C's file cadence: the planner's "snapshot on notice + files" period, from the calibrated
    costs and the schedule's mean rates (the failures a notice does not cover)."""
    hour = planner.SECONDS_PER_HOUR
    mix = planner.FailureMix(hour / shape.notice_every_s if shape.notice_every_s > 0 else 0.0,
                             hour / shape.unannounced_every_s if shape.unannounced_every_s > 0 else 0.0,
                             planner.LeadTime.between(shape.lead_lo_s, shape.lead_hi_s))
    costs = planner.Costs(file_stall=cal["file_stall_s"], cold_start=cal["cold_start_s"],
                          snapshot_lag=cal["snapshot_lag_s"], snapshot_restore=cal["snapshot_restore_s"],
                          notice_downtime=cal["notice_downtime_s"] + cal["file_stall_s"])
    p = planner.plan(costs, mix)
    period = next(s.period_s for s in p.strategies if s.name == "notice+files")
    return float(period) if period is not None else shape.window_s  # every failure covered: at most one file


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def measured_costs(arms: dict[str, dict[str, Any]], cal: dict[str, Any]) -> dict[str, Any]:
    """The planner's inputs as this run measured them (calibration where the arms measured none)."""
    evs = [e for a in arms.values() for e in a.get("events", [])]
    stalls = [s for a in arms.values() for s in a.get("file_checkpoints", {}).get("stall_s", [])]
    colds = [e["kill_to_first_new_step_s"] for e in evs if e.get("outcome") == "cold start from file"]
    lags = [e["snapshot"]["request_to_whole_in_store_s"] for e in evs if e.get("outcome") == "restored"]
    restores = [e["restore_to_first_new_step_s"] for e in evs if e.get("outcome") == "restored"]
    paired = [e["kill_to_first_new_step_s"] for e in evs if e.get("outcome") == "restored paired snapshot"]
    downtime = {name: _median([e["notice_to_first_new_step_s"] for e in a.get("events", [])
                               if e.get("outcome") == "restored"]) for name, a in arms.items()}
    pick = lambda got, key: got if got is not None else cal[key]  # noqa: E731
    return {"file_stall_s": pick(_median(stalls), "file_stall_s"),
            "cold_start_s": pick(_median(colds), "cold_start_s"),
            "snapshot_lag_s": pick(_median(lags), "snapshot_lag_s"),
            "snapshot_restore_s": pick(_median(restores), "snapshot_restore_s"),
            "paired_restore_s": pick(_median(paired), "snapshot_restore_s"),
            "notice_downtime_s": {k: v for k, v in downtime.items() if v is not None},
            "samples": {"file_stall": len(stalls), "cold_start": len(colds), "snapshot_lag": len(lags),
                        "snapshot_restore": len(restores), "paired_restore": len(paired)}}


def predict(spec: ArmSpec, period: float | None, costs: dict[str, Any], mix: planner.FailureMix) -> dict[str, Any]:
    """The planner's expected goodput of one arm (1 - its lost share), from snapguard.plan's terms:
    A: periodic files (every failure loses half a period, then a cold start); B and C: snapshot on
    notice + files every `period` (Table 12's terms); D: snapshot on notice alone."""
    stall, cold = costs["file_stall_s"], costs["cold_start_s"]
    lag, restore = costs["snapshot_lag_s"], costs["paired_restore_s"]
    downtime = costs["notice_downtime_s"].get(spec.name)
    if downtime is None:
        downtime = costs["snapshot_lag_s"] + costs["snapshot_restore_s"] + (stall if spec.urgent_file else 0.0)
    if spec.snapshot:
        covered, uncovered = mix.covered_rate(lag), mix.uncovered_rate(lag)
    else:
        covered, uncovered = 0.0, mix.rate
    if not spec.snapshot:
        assert period is not None
        terms = planner.periodic_loss(period, stall, mix.rate, 0.0, cold)
    elif period is not None:
        terms = {"notices": planner.notice_loss(covered, downtime),
                 **planner.notice_files_loss(period, stall, uncovered, covered, restore, cold)}
    elif uncovered > 0 and covered <= 0:
        terms = {"notices": 0.0, "lost_work": math.inf}  # nothing to go back to but step 0
    else:
        terms = {"notices": planner.notice_loss(covered, downtime),
                 "lost_work": uncovered / covered if uncovered > 0 else 0.0, "recovery": uncovered * restore}
    lost = sum(terms.values())
    return {"goodput": max(0.0, 1.0 - lost), "lost_share_terms": terms,
            "notice_downtime_s": downtime if spec.snapshot else None}


def check_bits(reference: list[tuple[int, str, float]], rows: list[tuple[int, str, float]]) -> dict[str, Any]:
    want: dict[int, str] = {}
    for step, bits, _ in reference:
        want.setdefault(step, bits)
    mismatched = sorted({s for s, b, _ in rows if s in want and want[s] != b})
    compared = sum(1 for s, _, _ in rows if s in want)
    return {"rows_compared": compared, "rows_logged": len(rows), "rows_beyond_reference": len(rows) - compared,
            "loss_mismatches": mismatched[:5], "bit_identical": not mismatched and compared > 0}


def _reference(base: Path, trainer_args: tuple[str, ...], run_for: float, say: Callable[[str], None],
               parity: bool = False) -> dict[str, Any]:
    r = Run(base, "reference", trainer_args, parity=parity, say=say)
    try:
        r.launch()
        t0 = r.first_step_after(0)[2]
        r.context_parity()
        say(f"goodput: reference running {run_for:.0f} s from its first step")
        _sleep_until(t0 + run_for)
    finally:
        r.teardown()
    return {"first_step_time": t0, "log": r.log, "context_parity": r.parity_stalls}


def _table(out: dict[str, Any]) -> str:
    head = (f"{'arm':<4} {'goodput':>7} {'predicted':>9} {'diff pts':>8} {'steps':>7} {'notices':>12} "
            f"{'unannounced':>11} {'lost/event':>16} {'to first step s':>16} {'bits':>5}")
    lines = [head, "-" * len(head)]
    for name, a in out["arms"].items():
        if a.get("failed"):
            lines.append(f"{name:<4} FAILED: {a['failure']}")
            continue
        evs = a["events"]
        notices = [e for e in evs if e["kind"] == "notice"]
        restored = sum(1 for e in notices if e.get("outcome") == "restored")
        kills = [e for e in evs if e["kind"] == "unannounced"]
        lost = [e["steps_lost"] for e in evs if "steps_lost" in e]
        firsts = [e.get("notice_to_first_new_step_s", e.get("kill_to_first_new_step_s")) for e in evs
                  if "first_new_step" in e]
        lines.append(
            f"{name:<4} {a['goodput']:>7.3f} {a['predicted_goodput']:>9.3f} {a['difference_points']:>+8.1f} "
            f"{a['steps_at_window_end']:>7} {f'{len(notices)} ({restored} snap)':>12} {len(kills):>11} "
            f"{(','.join(map(str, lost)) or '-')[:16]:>16} "
            f"{(','.join(f'{x:.1f}' for x in firsts if x is not None) or '-')[:16]:>16} "
            f"{'yes' if a['bits']['bit_identical'] else 'NO':>5}")
    return "\n".join(lines)


def run_goodput_drill(workdir: str, *, seed: int = 1, compress: float = 1.0, shape: Shape = REFERENCE_SHAPE,
                      trainer_args: tuple[str, ...] = (), concurrent: bool = False, json_path: str | None = None,
                      arms: str = "ABCD", context_parity: bool = True, parallel: int = 1,
                      say: Callable[[str], None] | None = None) -> int:
    """The goodput drill; `shape` in the reference's seconds, divided by `compress`. Exit 0: every
    arm ran its events and every logged step has the uninterrupted run's loss bits; 1 otherwise.
    `context_parity` applies only to a trainer on CUDA (not one given `--device cpu`). Without
    `concurrent`, `parallel` runs (the calibration, the uninterrupted run, then the arms in order;
    only arm C waits for the calibration) go at once, each starting as another ends: 2 on a CPU of
    2 cores, each trainer single-threaded."""
    emit = say or (lambda text: print(text, flush=True))
    lock = threading.Lock()

    def say_(text: str) -> None:
        with lock:
            emit(text)

    base = Path(workdir)
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(base.iterdir()):
        print(f"snapguard-lab USAGE_ERROR: {base} is not empty: earlier logs would be read as this drill's",
              file=sys.stderr)
        return 2
    scaled = shape.scaled(compress)
    schedule = make_schedule(seed, scaled)
    specs = [s for s in ARMS if s.name in arms]
    say_(f"goodput: seed {seed}, compress {compress:g}: window {scaled.window_s:.1f} s, notices every "
         f"{scaled.notice_every_s:.1f} s (lead {scaled.lead_lo_s:.1f}-{scaled.lead_hi_s:.1f} s), unannounced every "
         f"{scaled.unannounced_every_s:.1f} s, files every {scaled.file_every_s:.1f} s; schedule: "
         + (", ".join(f"{e.id}@{e.t:.1f}" + (f"+{e.lead:.1f}" if e.lead else "") for e in schedule) or "no events"))
    _subreaper(True)
    try:
        parity = context_parity and not _on_cpu(trainer_args)
        return _drill(base, seed, compress, shape, scaled, schedule, specs, trainer_args, concurrent, json_path,
                      say_, parity, parallel)
    finally:
        _subreaper(False)


def _on_cpu(trainer_args: tuple[str, ...]) -> bool:
    args = list(trainer_args)
    return any(a == "--device=cpu" or (a == "--device" and args[i + 1:i + 2] == ["cpu"]) for i, a in enumerate(args))


def _drill(base: Path, seed: int, compress: float, shape: Shape, scaled: Shape, schedule: list[Event],
           specs: list[ArmSpec], trainer_args: tuple[str, ...], concurrent: bool, json_path: str | None,
           say_: Callable[[str], None], parity: bool = False, parallel: int = 1) -> int:
    # with `parallel`, the calibration is the first of the runs that go at once: only arm C, whose
    # cadence the planner sets from the calibrated costs, waits for it
    pool = ThreadPoolExecutor(max_workers=parallel) if parallel > 1 and not concurrent else None
    calibrated: Future[dict[str, Any]] = Future()
    if pool is not None:
        calibrated = pool.submit(calibrate, base, trainer_args, say_)
    else:
        calibrated.set_result(calibrate(base, trainer_args, say_))
    cadence: list[float] = []
    cadence_lock = threading.Lock()

    def period_c() -> float:
        with cadence_lock:
            if not cadence:
                cadence.append(cadence_for_c(calibrated.result(), scaled))
                say_(f"goodput: the planner sets arm C's files every {cadence[0]:.2f} s")
            return cadence[0]

    def period(spec: ArmSpec) -> float | None:
        return {"fixed": scaled.file_every_s, "none": None}[spec.files] if spec.files != "planner" else period_c()

    if pool is None:
        period_c()
    # past the window: the arms' steps stay covered (each is seconds behind by its window's end,
    # and steps on only while it is torn down)
    run_for = scaled.window_s * 1.1 + 2.0
    results: dict[str, dict[str, Any]] = {}
    ref: dict[str, Any] = {}

    def do_ref() -> None:
        ref.update(_reference(base, trainer_args, run_for, say_, parity))

    def do_arm(spec: ArmSpec) -> None:
        arm = Arm(spec, base, scaled, schedule, trainer_args, period(spec), say_, parity)
        try:
            results[spec.name] = arm.go()
        except (SnapguardError, RuntimeError, TimeoutError, OSError, subprocess.SubprocessError, AssertionError) as e:
            f = failure_from(e) if isinstance(e, SnapguardError) else None
            why = f"{f.reason.name}: {f.message}" if f else f"{type(e).__name__}: {e}"
            say_(f"goodput {spec.name}: FAILED: {why}")
            results[spec.name] = {"arm": spec.name, "failed": True, "failure": why, "events": arm.events}
            arm.run.teardown()

    jobs: list[Callable[[], None]] = [do_ref, *[lambda s=s: do_arm(s) for s in specs]]
    if concurrent:
        threads = [threading.Thread(target=j, daemon=True) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elif pool is not None:
        with pool:
            for done in [pool.submit(j) for j in jobs]:
                done.result()
    else:
        for j in jobs:
            j()
    cal = calibrated.result()
    if "log" not in ref:
        say_("goodput: the reference run failed")
        return 1
    ref_rows = _rows(ref["log"])
    ref_steps = max([s for s, _, t in ref_rows if t <= ref["first_step_time"] + scaled.window_s], default=0)
    arms_out = {k: results[k] for k in [s.name for s in specs]}
    costs = measured_costs({k: v for k, v in arms_out.items() if not v.get("failed")}, cal)
    mix = _mix(schedule, scaled.window_s)
    ok = True
    for spec in specs:
        a = arms_out[spec.name]
        if a.get("failed"):
            ok = False
            continue
        rows = _rows(Path(a["log"]))
        a["bits"] = check_bits(ref_rows, rows)
        # its own pace between events: sequential arms on a shared CPU do not all get the reference's
        a["step_time_s"] = _median([b[2] - x[2] for x, b in zip(rows, rows[1:]) if b[0] == x[0] + 1])
        a["parity_credit_steps"] = credit_steps(a["parity_credit_s"], a["step_time_s"])
        a["goodput"] = (a["steps_at_window_end"] + a["parity_credit_steps"]) / ref_steps if ref_steps else 0.0
        a["goodput_uncredited"] = a["steps_at_window_end"] / ref_steps if ref_steps else 0.0
        p = predict(spec, period(spec), costs, mix)
        a["predicted_goodput"] = p["goodput"]
        a["prediction"] = p
        a["difference_points"] = 100.0 * (a["goodput"] - p["goodput"])
        a["steps_lost_per_event"] = [e.get("steps_lost") for e in a["events"]]
        a["ran_all_events"] = all(e.get("outcome") not in (None, "pending") for e in a["events"])
        ok = ok and a["bits"]["bit_identical"] and a["ran_all_events"]
    cal_bits = check_bits(ref_rows, _rows(Path(cal["log"])))
    ok = ok and cal_bits["bit_identical"]
    # only arms that ran beside the uninterrupted run can have changed its pace
    pace = pace_while_arms_down(ref_rows, ref["first_step_time"], ref["first_step_time"] + scaled.window_s,
                                [iv for a in arms_out.values() if not a.get("failed") for iv in down_intervals(a)]) \
        if concurrent else None
    shared = at_shared_pace(arms_out, ref_steps, pace)
    out = {"ok": ok, "seed": seed, "compress": compress, "concurrent": concurrent, "context_parity": parity,
           "shape_reference_s": asdict(shape), "shape_s": asdict(scaled), "trainer_args": list(trainer_args),
           "schedule": [e.to_dict() for e in schedule],
           "calibration": {**cal, "bits": cal_bits}, "cadence_c_s": period_c(),
           "planner_inputs": {"costs": costs, "mix": {"noticed_per_hour": mix.noticed_per_hour,
                                                      "unannounced_per_hour": mix.unannounced_per_hour,
                                                      "leads_s": [round(e.lead or 0, 3) for e in schedule
                                                                  if e.kind == "notice"]}},
           "reference": {"steps_in_window": ref_steps, "rows": len(ref_rows),
                         "context_parity": ref.get("context_parity", []), "pace": pace,
                         "steps_at_shared_pace": shared,
                         "step_time_s": _median([b[2] - a[2] for a, b in zip(ref_rows, ref_rows[1:])])},
           "arms": arms_out}
    print(_table(out), flush=True)
    if pace and pace["steps_per_s_any_arm_down"] is not None and pace["steps_per_s_no_arm_down"]:
        print(f"goodput drill: the uninterrupted run stepped {pace['steps_per_s_any_arm_down']:.2f}/s while an arm "
              f"stood still ({pace['seconds_any_arm_down']:.0f} s), {pace['steps_per_s_no_arm_down']:.2f}/s "
              "otherwise", flush=True)
    if shared:
        print(f"goodput drill: at the second pace all through it would have made {shared} steps; goodput against "
              "that (planner's difference): " + ", ".join(
                  f"{k} {a['goodput_at_shared_pace']:.3f} ({a['difference_points_at_shared_pace']:+.1f})"
                  for k, a in arms_out.items() if "goodput_at_shared_pace" in a), flush=True)
    print(f"goodput drill: uninterrupted run {ref_steps} steps in {scaled.window_s:.1f} s; "
          + ("PASS" if ok else "FAIL"), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0 if ok else 1


def _subreaper(on: bool) -> None:
    """Restored trainers are CRIU's orphans: made this process's children for the drill, so a
    killed one is reaped here at once (its pid must be free before the same image is restored
    again), whatever the host's init does with orphans."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def shape_with(base: Shape = REFERENCE_SHAPE, **changes: float | None) -> Shape:
    return replace(base, **{k: v for k, v in changes.items() if v is not None})

