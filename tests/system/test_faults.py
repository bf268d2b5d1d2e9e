"""The fault-injection matrix: every step of a checkpoint and a restore failed in turn, through
both entry points (`snapguard checkpoint/restore` on a bare tree, `snapguard-runc` on a runc
container; snapguard_lab.targets), with CRIU's own fault injection (CRIU_FAULT, which snapguard
passes to runc and CRIU with the rest of its environment) or a stand-in for CRIU.

After each failing row: exit status 1, exactly one `snapguard <REASON>:` line on stderr and no
traceback, the record's reason where the entry point writes one, the workload running and intact
(or cleanly stopped with a whole image), and no completion marker on an image that is not whole.

CPU rows (CRIU 4.2.1's faults: criu/include/fault-injection.h):

  preflight           `criu` in the config is missing: CRIU_MISSING, nothing changed
  take_point_no_hook  a workload without the take-point hook: the snapshot goes on, no warning
  take_point_timeout  a trainer with the hook that never ends a step, take_wait_s = 1: the
                      snapshot goes on with a TAKE_POINT_TIMEOUT warning
  criu_start          `criu` is a stand-in that answers --version and check, and dies at once
                      for a run: CRIU_DUMP_FAILED
  criu_vanished       `criu` is made non-executable after preflight's `criu check`: it cannot
                      start; CRIU_MISSING (bare) or CRIU_DUMP_FAILED (runc), with the cause
  criu_hang           `criu` sleeps for an hour for a run, criu_timeout_s = 1, run_timeout_s = 4:
                      snapguard's deadline (10 x criu_timeout_s, at most run_timeout_s) kills its
                      process group; CRIU_TIMEOUT or RUNC_TIMEOUT within ~20 s, nothing of it left
  criu_killed         FI_DUMP_EARLY (1): CRIU SIGKILLs itself with the tree seized and infected
  page_dump           FI_DUMP_PAGES (3): the page dump fails; CRIU's Error line is quoted
  seal                a directory planted in the image dir before the dump: CRIU ignores it,
                      sealing refuses it: IMAGE_WRITE_FAILED, no marker
  marker              the image dir is a tmpfs that a stand-in CRIU fills, after the real dump, up to
                      its last inode: the manifest is written, the completion marker is not
  restore             FI_POST_RESTORE (6) on restoring a stop image: CRIU_RESTORE_FAILED; the image
                      still verifies, and a second restore continues exactly
  restore_hang        `criu` sleeps for an hour when restoring a stop image, criu_timeout_s = 1,
                      run_timeout_s = 4: CRIU_TIMEOUT or RUNC_TIMEOUT within ~20 s, nothing of it
                      left; the image
                      still verifies, and a second restore with the real CRIU continues exactly

GPU rows (they need an NVIDIA driver, a CUDA build of torch, CRIU's CUDA plugin and
cuda-checkpoint; where /proc/driver/nvidia/version is absent they skip, and bench/gpu/faults.py
runs them on the H200):

  cuda_lock           a CUDA workload that keeps the GPU busy with kernels of ~2 s, criu_timeout_s
                      = 1 (the lock's timeout): CUDA_LOCK_TIMEOUT, the workload running
  cuda_restore        cuda-checkpoint fails `--action restore` while a stop image is restored:
                      CRIU_RESTORE_FAILED or CUDA_RESTORE_FAILED; the image still verifies and a
                      second restore with the real tool continues
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from snapguard import image
from snapguard.names import MANIFEST_NAME, MARKER_NAME
from snapguard_lab.targets import (COUNTER, IDLE_TRAINER, KINDS, RuncTarget, Target, criu_wrapper, failing_tool,
                                   make_target, typed_lines, wait_gone)
from snapguard_lab.testbed import expected_hash

pytestmark = pytest.mark.timeout(180)

NVIDIA_DRIVER = "/proc/driver/nvidia/version"
GPU_SKIP = "GPU row: bench/gpu/faults.py on the H200"
FI_DUMP_EARLY, FI_DUMP_PAGES, FI_POST_RESTORE = "1", "3", "6"
RUN_TIMEOUT_S = 4  # the hang rows' deadline on the runc or CRIU run (run_timeout_s)

CUDA_BUSY = """
import torch
torch.ones(1, device="cuda")
cycles = 4 * 10**9  # about 2 s of GPU time per kernel
""" + COUNTER.replace("    time.sleep(0.01)\n", """    torch.cuda._sleep(cycles)  # one kernel queued behind the running one: the GPU never idles
    done = torch.cuda.Event(); done.record()
    if i > 1:
        last.synchronize()
    last = done
""")

CUDA_COUNTER = """
import torch
x = torch.zeros(1, device="cuda")
""" + COUNTER.replace("    time.sleep(0.01)\n", "    x += 1; torch.cuda.synchronize(); time.sleep(0.01)\n")


@dataclass
class Case:
    """What a row did and what must hold after it."""

    target: Target
    out: subprocess.CompletedProcess[str]
    images: Path
    work: Path  # where the run's record is, for the runc path
    reasons: tuple[str, ...] = ()  # the typed reasons allowed; () for a row that must succeed
    record_expected: bool = True  # False where the entry point cannot write one (documented per row)
    workload: str = "running"  # "running", or "stopped" (a stop image that must verify)
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[Callable[..., Target]]:
    """Make and start targets; stop them all afterwards (and unmount what a row mounted)."""
    made: list[Target] = []
    mounts: list[Path] = []

    def make(kind: str, lines: int = 10, **kw: Any) -> Target:
        t = make_target(kind, tmp_path / "target", **kw)
        made.append(t)
        t.mounts = mounts  # type: ignore[attr-defined]
        t.start(lines=lines)
        return t

    yield make
    for t in made:
        t.stop()
    for m in mounts:
        subprocess.run(["umount", "-l", str(m)], capture_output=True, check=False)


def _dirs(tmp_path: Path, make_images: bool = True) -> tuple[Path, Path]:
    images, work = tmp_path / "img", tmp_path / "work"
    if make_images:
        images.mkdir(mode=0o700)
    return images, work


# -- the rows ------------------------------------------------------------------------------------

def row_preflight(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    t.configure(criu=str(tmp_path / "no-such-criu"))
    images, work = _dirs(tmp_path)
    out = t.checkpoint(images, work)
    assert sorted(p.name for p in images.iterdir()) in ([], ["snapguard-result.json"]), "a refusal wrote an image"
    return Case(t, out, images, work, ("CRIU_MISSING",))


def row_take_point_no_hook(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    images, work = _dirs(tmp_path)
    out = t.checkpoint(images, work, leave_running=True)
    record = t.record(images, work) or {}
    assert record.get("take_point") == {}, record
    assert not [w for w in record.get("warnings", []) if w["reason"] == "TAKE_POINT_TIMEOUT"], record["warnings"]
    return Case(t, out, images, work)


def row_take_point_timeout(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind, lines=3, script=IDLE_TRAINER, hook=True)
    t.configure(take_wait_s=1)
    images, work = _dirs(tmp_path)
    out = t.checkpoint(images, work, leave_running=True)
    record = t.record(images, work) or {}
    waits = [w for w in record.get("warnings", []) if w["reason"] == "TAKE_POINT_TIMEOUT"]
    assert len(waits) == 1 and "within 1 s" in waits[0]["detail"], record.get("warnings")
    assert record.get("take_point") == {} and record["timings"]["take_s"] < 5, record
    return Case(t, out, images, work)


def row_criu_start(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    t.configure(criu=str(criu_wrapper(tmp_path / "criu-fails", "fail")))
    images, work = _dirs(tmp_path)
    return Case(t, t.checkpoint(images, work), images, work, ("CRIU_DUMP_FAILED", "CRIU_MISSING"))


def row_criu_vanished(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    t.configure(criu=str(criu_wrapper(tmp_path / "criu-vanishes", "vanish")))
    images, work = _dirs(tmp_path)
    out = t.checkpoint(images, work)
    # the operator reads why CRIU did not run in the one typed line (containerd shows only that)
    assert "permission denied" in "".join(typed_lines(out.stderr)).lower(), out.stderr
    return Case(t, out, images, work, ("CRIU_MISSING", "CRIU_DUMP_FAILED"))


def row_criu_hang(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    hang = criu_wrapper(tmp_path / "criu-hangs", "hang")
    t.configure(criu=str(hang), criu_timeout_s=1, run_timeout_s=RUN_TIMEOUT_S)
    images, work = _dirs(tmp_path)
    t0 = time.monotonic()
    out = t.checkpoint(images, work)
    took = time.monotonic() - t0
    assert took < RUN_TIMEOUT_S + 15, f"snapguard took {took:.1f} s past a {RUN_TIMEOUT_S} s deadline"
    pids = [int(p) for p in Path(f"{hang}.pids").read_text().split()]
    assert pids, "the stand-in CRIU never ran"
    assert wait_gone(pids) == [], "the hung CRIU outlived snapguard's deadline"
    reason = "CRIU_TIMEOUT" if kind == "bare" else "RUNC_TIMEOUT"
    return Case(t, out, images, work, (reason,))


def row_criu_killed(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    images, work = _dirs(tmp_path)
    out = t.checkpoint(images, work, extra_env={"CRIU_FAULT": FI_DUMP_EARLY})
    return Case(t, out, images, work, ("CRIU_DUMP_FAILED",))


def row_page_dump(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    images, work = _dirs(tmp_path)
    out = t.checkpoint(images, work, extra_env={"CRIU_FAULT": FI_DUMP_PAGES})
    assert "fault: Dump VMA pages failure!" in "".join(typed_lines(out.stderr)), out.stderr
    return Case(t, out, images, work, ("CRIU_DUMP_FAILED",))


def row_seal(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    images, work = _dirs(tmp_path)
    (images / "planted").mkdir()
    return Case(t, t.checkpoint(images, work, leave_running=True), images, work, ("IMAGE_WRITE_FAILED",))


def row_marker(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    images, work = _dirs(tmp_path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=400,mode=0700", "tmpfs", str(images)],
                   check=True)
    t.mounts.append(images)  # type: ignore[attr-defined]
    t.configure(criu=str(criu_wrapper(tmp_path / "criu-fills", "fill", fill_dir=str(images))))
    out = t.checkpoint(images, work, leave_running=True)
    assert (images / MANIFEST_NAME).exists(), "the fault came before the manifest, not at the marker"
    # the bare path's record would go into the full image dir: it is lost (stderr says so)
    return Case(t, out, images, work, ("IMAGE_WRITE_FAILED",), record_expected=kind == "runc")


def row_restore(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    images, work = _dirs(tmp_path, make_images=False)
    stopped = t.checkpoint(images, work)
    assert stopped.returncode == 0, stopped.stderr
    assert wait_gone([t.pid() or 0]) == []
    last = t.log.last()
    restore_work = tmp_path / "restore-work"
    out = t.restore(images, restore_work, extra_env={"CRIU_FAULT": FI_POST_RESTORE})
    return Case(t, out, images, restore_work, ("CRIU_RESTORE_FAILED",), workload="stopped",
                extra={"last": last, "retry_work": tmp_path / "retry-work"})


def row_restore_hang(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind)
    images, work = _dirs(tmp_path, make_images=False)
    stopped = t.checkpoint(images, work)
    assert stopped.returncode == 0, stopped.stderr
    assert wait_gone([t.pid() or 0]) == []
    last = t.log.last()
    hang = criu_wrapper(tmp_path / "criu-hangs", "hang")
    t.configure(criu=str(hang), criu_timeout_s=1, run_timeout_s=RUN_TIMEOUT_S)
    t0 = time.monotonic()
    out = t.restore(images, tmp_path / "restore-work")
    took = time.monotonic() - t0
    assert took < RUN_TIMEOUT_S + 15, f"snapguard took {took:.1f} s past a {RUN_TIMEOUT_S} s deadline"
    pids = [int(p) for p in Path(f"{hang}.pids").read_text().split()]
    assert pids and wait_gone(pids) == [], "the hung CRIU outlived snapguard's deadline"
    if isinstance(t, RuncTarget):
        # snapguard killed runc half way through its restore: what runc had made must go with it,
        # or every retry fails with "container with given ID already exists"
        assert not (t.root / t.container_id).exists(), \
            f"the killed runc restore left {t.root / t.container_id} behind (state: {t.state()})"
    reason = "CRIU_TIMEOUT" if kind == "bare" else "RUNC_TIMEOUT"
    return Case(t, out, images, tmp_path / "restore-work", (reason,), workload="stopped",
                extra={"last": last, "retry_work": tmp_path / "retry-work",
                       "before_retry": lambda: t.configure(criu=None, criu_timeout_s=None, run_timeout_s=None)})


def _cuda_devices() -> list[str]:
    return sorted(d for d in glob.glob("/dev/nvidia*") if os.path.exists(d) and not os.path.isdir(d))


def row_cuda_lock(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind, lines=2, script=CUDA_BUSY, devices=_cuda_devices())
    t.configure(criu_timeout_s=1)  # the CUDA lock's timeout is CRIU's
    images, work = _dirs(tmp_path)
    return Case(t, t.checkpoint(images, work), images, work, ("CUDA_LOCK_TIMEOUT",))


def row_cuda_restore(kind: str, make: Callable[..., Target], tmp_path: Path) -> Case:
    t = make(kind, script=CUDA_COUNTER, devices=_cuda_devices())
    images, work = _dirs(tmp_path, make_images=False)
    stopped = t.checkpoint(images, work)
    assert stopped.returncode == 0, stopped.stderr
    assert wait_gone([t.pid() or 0]) == []
    last = t.log.last()
    real = next(p for p in ("/usr/local/bin/cuda-checkpoint", os.path.join(os.path.dirname(sys.executable),
                                                                            "snapguard-cuda-checkpoint"))
                if os.path.exists(p))
    t.configure(cuda_checkpoint=str(failing_tool(tmp_path / "cuda-checkpoint-fails", real, "--action restore")))
    restore_work = tmp_path / "restore-work"
    out = t.restore(images, restore_work)
    t.configure(cuda_checkpoint=None)
    return Case(t, out, images, restore_work, ("CRIU_RESTORE_FAILED", "CUDA_RESTORE_FAILED"), workload="stopped",
                extra={"last": last, "retry_work": tmp_path / "retry-work"})


ROWS: dict[str, Callable[[str, Callable[..., Target], Path], Case]] = {
    "preflight": row_preflight,
    "take_point_no_hook": row_take_point_no_hook,
    "take_point_timeout": row_take_point_timeout,
    "criu_start": row_criu_start,
    "criu_vanished": row_criu_vanished,
    "criu_hang": row_criu_hang,
    "criu_killed": row_criu_killed,
    "page_dump": row_page_dump,
    "seal": row_seal,
    "marker": row_marker,
    "restore": row_restore,
    "restore_hang": row_restore_hang,
    "cuda_lock": row_cuda_lock,
    "cuda_restore": row_cuda_restore,
}
GPU_ROWS = ("cuda_lock", "cuda_restore")


# -- the matrix ----------------------------------------------------------------------------------

def _running(t: Target) -> None:
    assert t.alive(), "the workload is gone"
    assert t.advancing(lines=2, timeout=15), "the workload stopped advancing"
    assert t.log.chain_errors() == []


def _whole_or_unmarked(images: Path) -> None:
    """No marker on an image that is not whole: a marked image verifies."""
    if (images / MARKER_NAME).exists():
        image.verify(str(images))


@pytest.mark.parametrize("step", list(ROWS))
@pytest.mark.parametrize("kind", KINDS)
def test_fault(kind: str, step: str, targets: Callable[..., Target], tmp_path: Path) -> None:
    if step in GPU_ROWS and not os.path.exists(NVIDIA_DRIVER):
        pytest.skip(GPU_SKIP)
    case = ROWS[step](kind, targets, tmp_path)
    t, out = case.target, case.out
    assert "Traceback" not in out.stderr, out.stderr
    record = t.record(case.images, case.work)

    if not case.reasons:  # the step's failure is not the snapshot's: it goes on
        assert out.returncode == 0, out.stderr
        assert typed_lines(out.stderr) == [], out.stderr
        assert record is not None and record["ok"] is True
        assert (case.images / MARKER_NAME).exists()
        image.verify(str(case.images))
        _running(t)
        return

    assert out.returncode == 1, (out.returncode, out.stderr)
    lines = typed_lines(out.stderr)
    assert len(lines) == 1, out.stderr
    reason = lines[0].split(":", 1)[0].split()[1]
    assert reason in case.reasons, lines[0]
    if isinstance(t, RuncTarget):
        assert t.runc_log_messages()[-1] == lines[0], "containerd would show another line"
    if case.record_expected:
        assert record is not None, "no record"
        assert record["ok"] is False and record["reason"] == reason
    _whole_or_unmarked(case.images)

    if case.workload == "running":
        if record is not None:
            assert record["workload_intact"] is True, record
        _running(t)
        return
    # a failed restore of a stop image: the image is whole as it was, so the caller can retry
    assert (case.images / MARKER_NAME).exists()
    image.verify(str(case.images))
    case.extra.get("before_retry", lambda: None)()
    retry = t.restore(case.images, case.extra["retry_work"])
    assert retry.returncode == 0, retry.stderr
    _running(t)
    rows = t.values()
    last = case.extra["last"]
    after = [v for v in rows if v[0] == last + 1]
    assert after == [(last + 1, expected_hash(last + 1))], "the retried restore did not continue where it stopped"


@pytest.mark.parametrize("kind", KINDS)
def test_workload_killed_mid_dump_ends_the_dump_within_seconds(kind: str, targets: Callable[..., Target],
                                                              tmp_path: Path) -> None:
    """A workload that dies while CRIU works on it (the goodput drill killed a trainer mid-dump
    and CRIU, tracing a zombie, waited on for minutes): the dump is ended a tenth of snapguard's
    deadline (at most 10 s) after the death, long before the deadline (here 3 s of 30 s:
    run_timeout_s), with one typed line, nothing left."""
    import signal
    import threading

    t = targets(kind)
    hang = criu_wrapper(tmp_path / "criu-hangs", "hang")
    t.configure(criu=str(hang), criu_timeout_s=60, run_timeout_s=30)
    images, work = _dirs(tmp_path)
    done: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: done.update(out=t.checkpoint(images, work), t=time.monotonic()))
    runner.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{hang}.pids") and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = t.pid()
    assert pid is not None and os.path.exists(f"{hang}.pids"), "the stand-in CRIU never ran"
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    runner.join(timeout=120)
    assert not runner.is_alive(), "the dump outlived its workload by two minutes"
    out = done["out"]
    assert done["t"] - killed < 20, f"{done['t'] - killed:.1f} s after the workload died"
    lines = typed_lines(out.stderr)
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("snapguard CRIU_DUMP_FAILED: ") and "died during the dump" in lines[0], lines[0]
    assert wait_gone([int(p) for p in Path(f"{hang}.pids").read_text().split()]) == []
    assert not (images / MARKER_NAME).exists()
