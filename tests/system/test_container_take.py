"""The take point through snapguard-runc: a PyTorch job in a runc container (its rootfs bind
mounts of this host's own directories, nothing pulled) is held at a step boundary by the executor,
checkpointed and restored through the real runc and CRIU, and continues bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from snapguard import gpu_suspend, image, procfs
from snapguard.reasons import Reason, SnapguardError
from snapguard.takepoint import client as take
from snapguard.takepoint import site_dir
from snapguard.takepoint.protocol import SPILL_TMPFS
from snapguard_lab.bundles import host_bundle, release_mounts
from snapguard_lab.ddp import DDP_LAUNCH, DdpJob

pytest.importorskip("torch")  # in the test extra: a skip here means the install is broken

REPO = Path(__file__).resolve().parents[2]
STEPS = 80  # long enough that the job cannot finish while it is snapshotted
# the ddp workload's directory too: it is the lab's package data, wherever the lab is installed
HOST_DIRS = ["/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", sys.base_prefix, str(REPO), str(DDP_LAUNCH.parent)]


def make_bundle(tmp_path: Path, out: Path, spill: Path | None = None) -> Path:
    """The job's bundle; with `spill`, that host directory (on a tmpfs) bound at the node's spill
    directory and the optimizer's CPU tensors moved at the hold (SNAPGUARD_TAKE_OFFLOAD_DEVICE=cpu:
    the GPU path's copy, file and reload, on a CPU job)."""
    args = [sys.executable, str(DDP_LAUNCH), "--world", "1", "--out", "/out", "--steps", str(STEPS)]
    env = ["PATH=/usr/bin:/bin", "HOME=/root", "PYTHONWARNINGS=ignore", f"PYTHONPATH={site_dir()}:{REPO}",
           "SNAPGUARD_TAKE_DIR=/run/snapguard/take"]
    writable = {"/out": str(out)}
    if spill is not None:
        env.append("SNAPGUARD_TAKE_OFFLOAD_DEVICE=cpu")
        writable[SPILL_TMPFS] = str(spill)
    return host_bundle(tmp_path / "bundle", args, env, HOST_DIRS, writable=writable)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> DdpJob:
    return DdpJob(tmp_path_factory.mktemp("reference"), 1, STEPS).run_uninterrupted()


class _Container:
    """The job's container run through snapguard-runc (its own runc root and state directory),
    checkpointed and restored through it; deleted, its mounts released, on exit."""

    def __init__(self, tmp_path: Path, snapguard_runc: str, bundle: Path, cid: str) -> None:
        self.tmp_path, self.bundle, self.cid = tmp_path, bundle, cid
        self.root = tmp_path / "runc"
        self.executor = [snapguard_runc, "--root", str(self.root)]
        self.env = {**os.environ, "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}

    def __enter__(self) -> _Container:
        # stdio /dev/null, as containerd's null IO: a host file as stdio is outside the container's
        # mounts and CRIU cannot dump it (the ranks log to /out)
        run = subprocess.run([*self.executor, "run", "--detach", "--bundle", str(self.bundle), self.cid],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             timeout=60, env=self.env)
        if run.returncode != 0:
            self.__exit__()
        assert run.returncode == 0
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["/usr/sbin/runc", "--root", str(self.root), "delete", "--force", self.cid], capture_output=True)
        release_mounts(self.bundle)

    def runc(self, *args: str) -> str:
        """The real runc on the container (`pause`, `resume`, `state`): its output."""
        done = subprocess.run(["/usr/sbin/runc", "--root", str(self.root), *args, self.cid], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def status(self) -> str:
        """runc's status of the container; "gone" once runc deleted it (a stop checkpoint)."""
        done = subprocess.run(["/usr/sbin/runc", "--root", str(self.root), "state", self.cid], capture_output=True,
                              text=True, timeout=30)
        return str(json.loads(done.stdout)["status"]) if done.returncode == 0 else "gone"

    def attempt(self, img: Path, work: Path, leave_running: bool) -> subprocess.CompletedProcess[str]:
        flags = ["--leave-running"] if leave_running else []
        return subprocess.run([*self.executor, "checkpoint", "--image-path", str(img), "--work-path", str(work),
                               "--tcp-established", *flags, self.cid], capture_output=True, text=True, timeout=120,
                              env=self.env)

    def checkpoint(self, img: Path, work: Path, leave_running: bool) -> None:
        ck = self.attempt(img, work, leave_running)
        assert ck.returncode == 0, ck.stderr

    def restore(self, img: Path) -> None:
        rs = subprocess.run([*self.executor, "restore", "--image-path", str(img), "--work-path",
                             str(self.tmp_path / "restore-work"), "--bundle", str(self.bundle), "--detach",
                             "--tcp-established", self.cid], capture_output=True, text=True, timeout=120,
                            env=self.env, stdin=subprocess.DEVNULL)
        assert rs.returncode == 0, rs.stderr


@pytest.mark.parametrize("leave_running", [True, False], ids=["leave-running", "stop-restore"])
def test_executor_holds_container_at_take_point(leave_running: bool, tmp_path: Path, snapguard_runc: str,
                                                reference: DdpJob) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = DdpJob(out, 1, STEPS)
    with _Container(tmp_path, snapguard_runc, make_bundle(tmp_path, out),
                    f"take-{os.getpid()}-{int(leave_running)}") as box:
        job.wait_step(5)
        img, work = tmp_path / "image", tmp_path / "work"
        box.checkpoint(img, work, leave_running)
        result = json.loads((work / "snapguard-result.json").read_text())
        (figures,) = result["take_point"].values()
        assert figures["ok"] and figures["step"] >= 6 and figures["pid"] != int(next(iter(result["take_point"])))
        if not leave_running:
            box.restore(img)
        assert job.mismatches(reference) == []


@pytest.mark.parametrize("leave_running", [True, False], ids=["leave-running", "stop-restore"])
def test_container_spills_through_a_bind_of_a_host_tmpfs(leave_running: bool, tmp_path: Path, snapguard_runc: str,
                                                         reference: DdpJob, request: pytest.FixtureRequest) -> None:
    """A container whose spec binds a host tmpfs directory at the node's spill directory: its
    trainer's moved bytes go into a file there, which the executor reaches through the host's
    path (the bind's source, from mountinfo), copies into the image and hands back at the
    release; CRIU, through runc, treats the bind as external and never dumps it. The job goes on
    bit for bit, after a leave-running snapshot and after a stop snapshot restored into a new
    container (new host pids: the spill is matched by the pid the trainer sees), and no spill is
    left in the host directory."""
    spill = Path(tempfile.mkdtemp(prefix="snapguard-test-", dir="/dev/shm"))  # the host's tmpfs
    request.addfinalizer(lambda: shutil.rmtree(spill, ignore_errors=True))
    out = tmp_path / "out"
    out.mkdir()
    job = DdpJob(out, 1, STEPS)
    with _Container(tmp_path, snapguard_runc, make_bundle(tmp_path, out, spill),
                    f"spill-{os.getpid()}-{int(leave_running)}") as box:
        job.wait_step(5)
        img = tmp_path / "image"
        box.checkpoint(img, tmp_path / "work", leave_running)
        ((key, figures),) = image.verify(str(img)).to_json()["take_point"].items()
        offload = figures["offload"]
        assert offload["state"] == "moved" and "spill" in offload, offload
        held = img / offload["spill"]["file"]
        assert held.name == f"snapguard-take-{key}.bin" and held.stat().st_size == offload["spill"]["bytes"]
        assert offload["spill"]["path"].startswith(SPILL_TMPFS + "/"), offload  # the trainer's own name for it
        if not leave_running:
            assert not list(spill.iterdir()), "the stopped trainer's spill was left in the host's directory"
            box.restore(img)
        assert job.mismatches(reference) == []
        assert not list(spill.iterdir()), "the reloaded trainer's spill was left in the host's directory"


def test_paused_container_is_thawed_for_the_take_point(tmp_path: Path, snapguard_runc: str,
                                                      reference: DdpJob) -> None:
    """containerd's CRI pauses a task (the cgroup freezer) before it asks the runtime for a
    checkpoint, and resumes it after. A frozen trainer answers no take point and a frozen CUDA
    process no driver lock: the CUDA step refuses one at once (WORKLOAD_FROZEN, not a wait that
    never ends), and snapguard-runc resumes the container for the hold, lets CRIU freeze it, and
    leaves it paused again after a leave-running checkpoint (as containerd left it), ended after a
    stop checkpoint. The trainer is held both times and goes on bit for bit. A trainer stopped
    (SIGSTOP: no runc resume undoes it) is refused at once, typed, before the take point asks it
    anything, and goes on when continued."""
    out = tmp_path / "out"
    out.mkdir()
    job = DdpJob(out, 1, STEPS)
    with _Container(tmp_path, snapguard_runc, make_bundle(tmp_path, out), f"paused-{os.getpid()}") as box:
        job.wait_step(5)
        box.runc("pause")
        pid = int(json.loads(box.runc("state"))["pid"])
        with pytest.raises(SnapguardError) as refused:
            gpu_suspend.suspend([pid], 60.0)
        assert refused.value.reason is Reason.WORKLOAD_FROZEN and "frozen cgroup" in str(refused.value)
        for leave_running in (True, False):
            img, work = tmp_path / f"image-{int(leave_running)}", tmp_path / f"work-{int(leave_running)}"
            box.checkpoint(img, work, leave_running)
            result = json.loads((work / "snapguard-result.json").read_text())
            (figures,) = result["take_point"].values()
            assert figures["ok"], figures
            assert result["counts"]["container_thawed"] == 1, result["counts"]
            if leave_running:
                assert box.status() == "paused"  # as containerd left it: its client resumes it
                box.runc("resume")
                job.wait_step(figures["step"] + 2)
                box.runc("pause")
            else:
                assert box.status() == "gone"  # runc deletes a container its checkpoint stopped
        box.restore(img)
        hooked = [p for p in procfs.process_tree(int(json.loads(box.runc("state"))["pid"])) if take.socket_for(p)]
        assert hooked
        for p in hooked:
            os.kill(p, signal.SIGSTOP)
        # (asked, it would have left the question in its socket: CRIU_DUMP_FAILED after 5 s)
        refused_ck = box.attempt(tmp_path / "image-stopped", tmp_path / "work-stopped", True)
        assert refused_ck.returncode != 0 and "WORKLOAD_FROZEN" in refused_ck.stderr, refused_ck.stderr
        for p in hooked:
            os.kill(p, signal.SIGCONT)
        assert job.mismatches(reference) == []
