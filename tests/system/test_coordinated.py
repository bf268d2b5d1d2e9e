"""Coordinated snapshots of a multi-process job: torch.distributed with gloo, ranks on loopback,
brought to one common step by the take point, dumped as one tree with CRIU and restored,
continuing bit for bit. Real torch (CPU), real CRIU. (Four ranks, and ranks on other nodes
restored elsewhere: test_gloo_ranks.py.)"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from snapguard.config import load
from snapguard.pipeline import checkpoint_pid, restore_images
from snapguard.reasons import Reason, SnapguardError
from snapguard_lab.ddp import DdpJob

pytest.importorskip("torch")  # in the test extra: a skip here means the install is broken

pytestmark = pytest.mark.stack  # CRIU

STEPS = 80  # long enough that no job finishes while a loaded CI machine snapshots it


@pytest.fixture
def config(tmp_path: Path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    return load({"SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")})


def take_dir(config) -> str:
    return os.path.join(config.state_dir, "take")


@contextmanager
def running(job: DdpJob, take: str | None) -> Iterator[subprocess.Popen[bytes]]:
    """The job's launcher, started; afterwards its whole session is killed, whatever happened."""
    launcher = job.start(take)
    try:
        yield launcher
    finally:
        subprocess.run(["pkill", "-9", "-s", str(launcher.pid)], check=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> DdpJob:
    return DdpJob(tmp_path_factory.mktemp("reference"), 2, STEPS).run_uninterrupted()


@pytest.mark.parametrize("leave_running", [True, False], ids=["leave-running", "stop-restore"])
def test_two_rank_gloo_job_snapshot_at_common_step(leave_running: bool, config, tmp_path: Path,
                                                   reference: DdpJob) -> None:
    job = DdpJob(tmp_path / "job", 2, STEPS)
    with running(job, take_dir(config)) as launcher:
        job.wait_step(10)
        result = checkpoint_pid(launcher.pid, str(tmp_path / "img"), config, leave_running=leave_running,
                                tcp_established=True)
        held = result["take_point"]
        assert len(held) == 2 and len({f["step"] for f in held.values()}) == 1, held
        manifest = json.loads((tmp_path / "img" / "snapguard-manifest.json").read_text())
        assert manifest["network_lock"] == "skip"  # every connection is between the ranks
        if not leave_running:
            launcher.wait(timeout=30)  # CRIU killed the job after the dump; free its pid
            restored = restore_images(str(tmp_path / "img"), config, tcp_established=True)
            assert restored["pid"] == launcher.pid
        assert job.mismatches(reference) == []


def test_cpu_job_without_hook_is_dumped_as_one_tree(config, tmp_path: Path) -> None:
    """Ranks without the hook cannot be held at a common step. On the CPU one frozen tree is still
    consistent (CRIU freezes every rank and carries the socket queues), so it is allowed; with
    several CUDA processes it is refused (test_workload covers that check)."""
    job = DdpJob(tmp_path / "job", 2, STEPS)
    with running(job, None) as launcher:
        job.wait_step(5)
        result = checkpoint_pid(launcher.pid, str(tmp_path / "img"), config, leave_running=True,
                                tcp_established=True)
        assert result["take_point"] == {}


def test_established_tcp_without_flag_is_refused(config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the take point's process groups off (SNAPGUARD_TAKE_GROUPS=0) the ranks' gloo and store
    connections stay through the hold: refused without --tcp-established, nothing frozen."""
    monkeypatch.setenv("SNAPGUARD_TAKE_GROUPS", "0")
    job = DdpJob(tmp_path / "job", 2, STEPS)
    with running(job, take_dir(config)) as launcher:
        job.wait_step(3)
        with pytest.raises(SnapguardError) as e:
            checkpoint_pid(launcher.pid, str(tmp_path / "img"), config, leave_running=True)
        assert e.value.reason is Reason.TCP_ESTABLISHED
        job.wait_step(max(job.rows(0)) + 3)  # untouched: still training


def test_single_trainer_take_point_holds_and_releases(config, tmp_path: Path) -> None:
    """One trainer: the hook holds it at the end of its next step while CRIU dumps, then lets go.
    Its reference runs beside it (one process each, one a core): the two share nothing."""
    ref = DdpJob(tmp_path / "ref", 1, STEPS)
    job = DdpJob(tmp_path / "job", 1, STEPS)
    with running(ref, None) as ref_launcher, running(job, take_dir(config)) as launcher:
        job.wait_step(5)
        result = checkpoint_pid(launcher.pid, str(tmp_path / "img"), config, leave_running=True,
                                tcp_established=True)
        (figures,) = result["take_point"].values()
        assert figures["ok"] and figures["step"] >= 6
        assert ref_launcher.wait(timeout=300) == 0, f"reference job in {ref.out} failed"
        assert job.mismatches(ref) == []
