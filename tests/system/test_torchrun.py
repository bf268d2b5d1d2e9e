"""An unmodified `torchrun --nnodes 1 --nproc-per-node 2 train.py` job (gloo), its elastic agent the
root of the tree and the take point in every process of it (the agent included), snapshotted by
snapguard as a bare tree: the workers release their groups and their store, the agent its stores
(the server its workers use among them), so that the image holds no TCP connection and CRIU runs
without --tcp-established. Leave-running, then stop + restore into another network namespace
(another address: the restore names the store's new one with --rendezvous, or, for --standalone,
whose store is on `localhost`, none); the loss bits of every step and the final state equal an
uninterrupted run's. Real torchrun, torch (CPU), CRIU, netns."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from snapguard_lab.gloo_nodes import NodesJob, restore_on, snapguard_in
from snapguard_lab.netns import Nodes

pytest.importorskip("torch")

pytestmark = [pytest.mark.root, pytest.mark.stack]

STEPS = {"static": 80, "standalone": 45, "c10d": 70}  # a few past the last snapshot's step: the run after it is short
STEP_SLEEP = 0.15  # seconds per step outside the math: the steps' pace is the sleep's, whatever the load
AHEAD_S = 4.0  # the common step is this far ahead: snapguard has started and asked by then
PORT = 29531


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    return {"SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}


def checkpoint(job: NodesJob, nodes: Nodes, pid: int, img: Path, env: dict[str, str], leave_running: bool) -> dict:
    at = max(max(job.rows(r)) for r in range(job.world)) + int(AHEAD_S / job.step_sleep) + 2
    assert at < job.steps - 2, f"the job is at step {at} already: too slow a machine for this test"
    done = snapguard_in(nodes, "a", ["checkpoint", "--pid", str(pid), "--images", str(img), "--take-wait", "20",
                                     "--at-step", str(at), *(["--leave-running"] if leave_running else [])], env)
    assert done.returncode == 0, (done.stdout, done.stderr)
    record = done.stdout
    held = list(record["take_point"].values())
    assert len(held) == 2 and {f["step"] for f in held} == {at}, held  # the workers, not the agent
    for f in held:
        groups = f["process_groups"]
        assert groups["released"] is True and groups["store"]["agent"] == pid and "agent" in groups, groups
    # preflight named the agent's connections as released at the hold (no --tcp-established)
    assert any("torchrun's agent" in w["detail"] for w in record["warnings"]), record["warnings"]
    return record


@pytest.mark.parametrize("flavour", ["static", "standalone"])
def test_torchrun_job_leave_running_then_restored_elsewhere(tmp_path: Path, env: dict[str, str],
                                                            flavour: str) -> None:
    with Nodes(["a"]) as first, Nodes(["c"]) as second:
        ref = NodesJob(tmp_path / "ref", 2, STEPS[flavour])
        reference = ref.start_reference()  # meanwhile
        job = NodesJob(tmp_path / "job", 2, STEPS[flavour], step_sleep=STEP_SLEEP)
        take = os.path.join(env["SNAPGUARD_STATE_DIR"], "take")
        static = flavour == "static"
        rendezvous = ["--master-addr", first.addresses["a"], "--master-port", str(PORT)] if static else ["--standalone"]
        proc = job.start_torchrun(first, "a", rendezvous, take)
        try:
            job.wait_step(3)
            if static:  # the agent rebuilds its stores in place, its workers reconnect
                checkpoint(job, first, proc.pid, tmp_path / "live", env, leave_running=True)
                job.wait_step(max(job.rows(0)) + 3)
            checkpoint(job, first, proc.pid, tmp_path / "img", env, leave_running=False)
            proc.wait(timeout=30)
            restore_on(second, {"c": str(tmp_path / "img")},
                       ["--rendezvous", f"{second.addresses['c']}:{PORT + 1}"] if static else [], env)
            assert reference.wait(timeout=120) == 0
            assert job.mismatches(ref) == []
        finally:
            subprocess.run(["pkill", "-9", "-s", str(proc.pid)], check=False)


@pytest.mark.parametrize("endpoint_node", ["a", "b"])
def test_a_c10d_job_of_two_nodes_restored_on_two_other_nodes(tmp_path: Path, env: dict[str, str],
                                                             endpoint_node: str) -> None:
    """`torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint X:P` on nodes a and b, one rank each
    (node a, its address sorting first, is rank 0 and hosts the workers' store; X, which hosts the
    rendezvous's store, is a or b), both stopped at one step and restored on nodes c and d of
    another link, each restore naming c (a's) with --rendezvous: every store comes back on c, and
    the job continues exactly."""
    with Nodes(["a", "b"]) as first, Nodes(["c", "d"]) as second:
        ref = NodesJob(tmp_path / "ref", 2, STEPS["c10d"])
        reference = ref.start_reference()  # meanwhile
        job = NodesJob(tmp_path / "job", 2, STEPS["c10d"], step_sleep=STEP_SLEEP)
        take = os.path.join(env["SNAPGUARD_STATE_DIR"], "take")
        endpoint = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{first.addresses[endpoint_node]}:{PORT}",
                    "--rdzv-id", "j1"]
        procs = [job.start_torchrun(first, n, [*endpoint, "--rdzv-conf", f"is_host={int(n == endpoint_node)}",
                                               "--local-addr", first.addresses[n]], take, nnodes=2) for n in "ab"]
        try:
            job.wait_step(3)
            at = max(max(job.rows(r)) for r in range(job.world)) + int(AHEAD_S / job.step_sleep) + 2
            assert at < job.steps - 2, f"the job is at step {at} already: too slow a machine for this test"
            with ThreadPoolExecutor(2) as pool:
                done = list(pool.map(lambda np: snapguard_in(first, np[0], [
                    "checkpoint", "--pid", str(np[1].pid), "--images", str(tmp_path / "img" / np[0]),
                    "--take-wait", "20", "--at-step", str(at)], env), zip("ab", procs)))
            for d in done:
                assert d.returncode == 0, (d.stdout, d.stderr)
                assert [f["step"] for f in d.stdout["take_point"].values()] == [at]
            for p in procs:
                p.wait(timeout=30)
            restore_on(second, {"c": str(tmp_path / "img" / "a"), "d": str(tmp_path / "img" / "b")},
                       ["--rendezvous", f"{second.addresses['c']}:{PORT + 1}"], env)
            assert reference.wait(timeout=120) == 0
            assert job.mismatches(ref) == []
        finally:
            for p in procs:
                subprocess.run(["pkill", "-9", "-s", str(p.pid)], check=False)
