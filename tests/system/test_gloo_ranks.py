"""A multi-rank gloo job spread over two "nodes" (network namespaces), its ranks launched as
torchrun's agent launches them, snapshotted by snapguard running on each node: the take point
releases every rank's process groups and store at the common step (no TCP connection in the
image, no --tcp-established), rebuilds them after a leave-running snapshot, and after a stop +
restore into two other nodes (other addresses), or of one node's ranks onto another node beside
the node that stayed, at the rendezvous the restore names; the loss bits
of every step and the final state equal an uninterrupted run's. Real torch (CPU), CRIU, netns."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from snapguard_lab.gloo_nodes import NodesJob, restore_on, snapguard_in
from snapguard_lab.netns import Nodes

pytest.importorskip("torch")

pytestmark = [pytest.mark.root, pytest.mark.stack]

AHEAD_S = 6.0  # the common step is this far ahead: both nodes' snapguard have started and asked by then
AHEAD = int(AHEAD_S / NodesJob.step_sleep) + 2  # in steps: a step takes at least step_sleep
AFTER = 30  # steps the job still runs after its last snapshot's step (and the restored job with it)
PORT = 29517


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    return {"SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}


@pytest.fixture
def sites() -> Iterator[tuple[Nodes, Nodes]]:
    """Two pairs of nodes on two links: where the job starts, and where it is restored."""
    with Nodes(["a", "b"]) as first, Nodes(["c", "d"]) as second:
        yield first, second


@contextmanager
def launched(job: NodesJob, nodes: Nodes, split: list[list[int]], take: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    master = f"{nodes.addresses['a']}:{PORT}"
    procs = [job.start_node(nodes, name, ranks, master, take, i) for i, (name, ranks) in enumerate(zip("ab", split))]
    try:
        yield procs
    finally:
        for p in procs:
            subprocess.run(["pkill", "-9", "-s", str(p.pid)], check=False)


def checkpoint_both(nodes: Nodes, procs: list[subprocess.Popen[bytes]], at: int, img: Path, env: dict[str, str],
                    leave_running: bool) -> list[dict]:
    """`snapguard checkpoint --at-step` on both nodes at once, each in its namespace."""
    runs = []
    for name, p in zip("ab", procs):
        args = ["checkpoint", "--pid", str(p.pid), "--images", str(img / name), "--at-step", str(at)]
        runs.append((name, args + ["--take-wait", "20"] + (["--leave-running"] if leave_running else [])))
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda r: snapguard_in(nodes, r[0], r[1], env), runs))
    for d in done:
        assert d.returncode == 0, (d.stdout, d.stderr)
    return [d.stdout for d in done]


def run_case(tmp_path: Path, env: dict[str, str], sites: tuple[Nodes, Nodes], world: int,
             split: list[list[int]], leave_running_first: bool) -> None:
    first, second = sites
    # every snapshot's step ahead of where the job is, and the job still running past the last
    steps = 3 + (2 if leave_running_first else 1) * (AHEAD + 3) + AFTER
    ref = NodesJob(tmp_path / "ref", world, steps)
    reference = ref.start_reference()  # meanwhile
    job = NodesJob(tmp_path / "job", world, steps)
    take = os.path.join(env["SNAPGUARD_STATE_DIR"], "take")
    with launched(job, first, split, take) as procs:
        job.wait_step(3)
        at = max(max(job.rows(r)) for r in range(world)) + AHEAD
        if leave_running_first:
            records = checkpoint_both(first, procs, at, tmp_path / "live", env, leave_running=True)
            held = [f for rec in records for f in rec["take_point"].values()]
            assert {f["step"] for f in held} == {at} and len(held) == world
            assert all(f["process_groups"]["released"] is True and f["process_groups"]["groups"] for f in held), held
            job.wait_step(at + 3)
        at = max(max(job.rows(r)) for r in range(world)) + AHEAD
        assert at <= steps - AFTER // 2, (at, steps)  # the job has not outrun its own length
        checkpoint_both(first, procs, at, tmp_path / "img", env, leave_running=False)
        for p in procs:
            p.wait(timeout=30)
        # each node's tree runs in the other node's network namespace (its addresses)
        restore_on(second, {"c": str(tmp_path / "img" / "a"), "d": str(tmp_path / "img" / "b")},
                   ["--rendezvous", f"{second.addresses['c']}:{PORT + 1}"], env)
        assert reference.wait(timeout=120) == 0
        assert job.mismatches(ref) == []


def test_two_ranks_leave_running_then_restored_on_other_nodes(tmp_path: Path, env: dict[str, str],
                                                               sites: tuple[Nodes, Nodes]) -> None:
    run_case(tmp_path, env, sites, 2, [[0], [1]], leave_running_first=True)


def test_four_ranks_restored_on_other_nodes(tmp_path: Path, env: dict[str, str], sites: tuple[Nodes, Nodes]) -> None:
    run_case(tmp_path, env, sites, 4, [[0, 1], [2, 3]], leave_running_first=False)


def test_one_node_reclaimed_its_ranks_restored_beside_the_one_that_stayed(tmp_path: Path,
                                                                          env: dict[str, str]) -> None:
    """The common reclaim: of a job's two nodes one is taken back. Both stop at the common step;
    node a's tree comes back on node c (other addresses), node b's on node b itself, and the
    groups meet at a rendezvous on c: the bits equal an uninterrupted run's."""
    world = 2
    steps = 3 + AHEAD + 3 + AFTER
    ref = NodesJob(tmp_path / "ref", world, steps)
    reference = ref.start_reference()
    job = NodesJob(tmp_path / "job", world, steps)
    take = os.path.join(env["SNAPGUARD_STATE_DIR"], "take")
    with Nodes(["a", "b", "c"]) as nodes, launched(job, nodes, [[0], [1]], take) as procs:
        job.wait_step(3)
        at = max(max(job.rows(r)) for r in range(world)) + AHEAD
        checkpoint_both(nodes, procs, at, tmp_path / "img", env, leave_running=False)
        for p in procs:
            p.wait(timeout=30)
        restore_on(nodes, {"c": str(tmp_path / "img" / "a"), "b": str(tmp_path / "img" / "b")},
                   ["--rendezvous", f"{nodes.addresses['c']}:{PORT + 2}"], env)
        assert reference.wait(timeout=120) == 0
        assert job.mismatches(ref) == []
