"""The take point's side in torchrun's elastic agent (snapguard.takepoint.workload.agent): the
stores it makes, dropped at a hold and made again at a rebuild (real TCPStores on loopback),
the agent's CUDA probe skipped, its status saying it is no trainer, its socket's words, and what
the executor's preflight says of the agent's connections."""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from snapguard import procfs
from snapguard.preflight import Report, workload
from snapguard.reasons import Reason, Severity
from snapguard.takepoint import protocol
from snapguard.takepoint.workload import agent, agent_link
from snapguard_lab.planted import TCP_PAIR, planted
from snapguard_lab.ports import free_port


def _free_port() -> int:
    return free_port("127.0.0.1")  # below the ephemeral range: no store client's connect takes it first


def _tcp_sockets(ports: set[int]) -> int:
    """This process's TCP connections and listening sockets that have one of `ports` at either end,
    from /proc/net: the stores' of a test, whatever sockets earlier tests' threads still open or
    close meanwhile (a full run had two loopback connections of theirs here, which closed during
    this test and made the count fall below the one taken before it)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            ends = {int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)}
            if fields[9] in inodes and ends & ports:
                count += 1
    return count


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> tuple[agent.Agent, type]:
    """A fresh Agent in place of the process's, and the store class bound to it."""
    pytest.importorskip("torch")
    import torch._C._distributed_c10d as c10d

    state = agent.Agent()
    monkeypatch.setattr(agent, "AGENT", state)
    return state, agent._store_class(c10d)


def test_the_hold_drops_every_store_and_the_rebuild_moves_the_workers_one(fresh: tuple[agent.Agent, type]) -> None:
    import torch.distributed as dist

    state, AgentStore = fresh
    gc.collect()  # the hold collects garbage: stores earlier tests left unreferenced go first, not inside the count
    port, other = _free_port(), _free_port()
    before = _tcp_sockets({port, other})
    hosted = AgentStore("127.0.0.1", port, 1, True, timedelta(seconds=20), multi_tenant=True)
    side = AgentStore("127.0.0.1", 0, None, True, timedelta(seconds=20))  # the c10d backend's, on a free port
    ports = {port, other, side.port}
    prefixed = dist.PrefixStore("run", hosted)
    prefixed.set("a", b"1")
    assert prefixed.multi_get(["a"]) == [b"1"] and hosted.libuvBackend is False
    assert _tcp_sockets(ports) > before
    # a worker's last operation on the store
    worker = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=20), use_libuv=False)
    worker.set("snapguard/drain/7/out/all", b"1")
    del worker
    answer = state.hold("snapguard/drain/7/out/all", port, 10.0)
    assert answer["ok"] is True and state.released
    assert _tcp_sockets(ports) == before  # no connection, no listening socket left
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(prefixed.add("n", 1)))
    waiter.start()  # the agent's own use waits while released
    time.sleep(0.3)
    assert got == [] and waiter.is_alive()
    again = state.hold("snapguard/drain/7/out/all", port, 1.0)  # a second worker's request: the same outcome
    assert again["ok"] is True
    rebuilt = state.rebuild(port, f"127.0.0.1:{other}")
    assert rebuilt["ok"] is True and not state.released
    waiter.join(10)
    assert got == [1]
    assert hosted.port == other and side.port not in (0, port, other)
    assert dist.TCPStore("127.0.0.1", other, None, False, timedelta(seconds=5), use_libuv=False).add("run/n", 0) == 1
    status = state.status()
    assert [s["port"] for s in status["stores"]] == [other, side.port] and status["holds"] == 1


def test_a_hold_whose_ranks_are_not_done_leaves_the_stores(fresh: tuple[agent.Agent, type]) -> None:
    state, AgentStore = fresh
    port = _free_port()
    hosted = AgentStore("127.0.0.1", port, 1, True, timedelta(seconds=20))
    answer = state.hold("snapguard/drain/1/out/all", port, 0.5)  # nobody set it
    assert answer["ok"] is False and not state.released and hosted.inner is not None
    hosted.set("k", b"v")
    assert hosted.get("k") == b"v"


@dataclass
class _Config:
    numa_options: Any = None

    def __post_init__(self) -> None:  # as LaunchConfig's
        import torch

        if self.numa_options is None and torch.cuda.is_available():
            self.numa_options = "default"


def test_the_agents_cuda_probe_is_skipped(monkeypatch: pytest.MonkeyPatch, fresh: tuple[agent.Agent, type]) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.delenv(protocol.TAKE_DIR_ENV, raising=False)
    probed: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: probed.append(True) or True)

    class Config(_Config):
        pass

    assert Config().numa_options == "default" and probed == [True]  # as torch has it
    agent._skip_cuda_probe(Config)
    assert not fresh[0].active
    agent._skip_cuda_probe(Config)  # once only
    c = Config()
    assert probed == [True] and c.numa_options is None
    assert fresh[0].active  # a LaunchConfig made: this process is the agent
    assert Config(numa_options="given").numa_options == "given"
    assert torch.cuda.is_available() is True  # put back


def test_the_agent_is_no_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    from snapguard.takepoint.workload.point import TakePoint

    point = TakePoint()
    point.trainer = True
    assert point.trainer is True
    monkeypatch.setattr(agent.AGENT, "active", True)
    assert point.trainer is False and point.status()["agent"]["ok"] is True


def test_the_agents_socket_answers_and_closes(tmp_path: Path, fresh: tuple[agent.Agent, type]) -> None:
    path = agent_link.agent_socket(str(tmp_path), os.getpid())
    threading.Thread(target=agent.serve, args=(path,), daemon=True).start()
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.stat(path).st_mode & 0o777 == 0o600
    status = agent_link.ask(path, agent_link.STATUS, 5.0)
    assert status["ok"] is True and status["pid"] == os.getpid() and status["unreached"] == []
    for bad in ("hold x", "rebuild notaport", "rebuild 1 no-port", "frobnicate"):
        reply = agent_link.ask(path, bad, 5.0)
        assert reply["ok"] is False and reply["error"], bad
    assert agent_link.ask(path, "rebuild 29500", 5.0) == {"ok": True}  # nothing released: nothing to do


def test_a_worker_names_an_agent_without_the_take_point(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from snapguard.takepoint.workload.reach import unreached

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv(protocol.TAKE_DIR_ENV, str(tmp_path))
    assert "the agent runs no take point" in unreached(None, None, 0, 2)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert unreached(None, None, 0, 2) is None


def test_preflight_says_the_agents_stores_are_released() -> None:
    with planted(TCP_PAIR) as pid:
        worker = {"trainer": True, protocol.GROUPS: {
            "groups": [{"backend": "gloo", "rank": 0, "size": 2, "ranks": [0, 1]}], "unreached": [],
            "released": False, "store": {"host": "127.0.0.1", "port": 29500, "hosted": False, "agent": pid}}}
        report = Report("test")
        workload.run_checks(report, procfs.inventory([pid]), trainers={pid + 100000: worker})
        (f,) = [f for f in report.findings if f.reason is Reason.TCP_ESTABLISHED]
        assert f.severity is Severity.WARNING and f.evidence["cause"] == "agent-released" and "torchrun" in f.detail
        report = Report("unreleased")
        worker[protocol.GROUPS]["unreached"] = ["x"]
        workload.run_checks(report, procfs.inventory([pid]), trainers={pid + 100000: worker})
        (f,) = [f for f in report.findings if f.reason is Reason.TCP_ESTABLISHED]
        assert f.severity is Severity.BLOCKER


def test_torchruns_launcher_counts_gpu_and_auto_without_cuda_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """In torchrun's launcher the take point answers torch.cuda's and torch.accelerator's questions
    from a child Python: torch's own determine_local_world_size gives its own answers (a CPU count
    for auto, its ValueError for gpu where no GPU is) and this process never asks CUDA."""
    pytest.importorskip("torch")
    import torch
    import torch.distributed.run as run

    from snapguard.takepoint.workload import localsize

    if torch.cuda.is_available():
        pytest.skip("the CPU's answers are checked here")
    expected_auto = run.determine_local_world_size("auto")

    def no_cuda(*_: Any) -> Any:
        raise AssertionError("CUDA asked in the launcher's own process")

    for owner, name in ((torch.cuda, "is_available"), (torch.cuda, "device_count"), (torch.accelerator, "is_available"),
                        (torch.accelerator, "device_count"), (torch.accelerator, "current_accelerator")):
        monkeypatch.setattr(owner, name, no_cuda)  # put back after the test, whatever answer_apart set
    assert localsize.launcher_process()  # torch.distributed.run is imported here
    localsize.answer_apart(torch)
    localsize.answer_apart(torch)  # twice is once
    assert run.determine_local_world_size("3") == 3
    assert run.determine_local_world_size("auto") == expected_auto
    with pytest.raises(ValueError, match="Cuda is not available"):
        run.determine_local_world_size("gpu")
    assert torch.cuda.device_count() == 0 and torch.accelerator.current_accelerator() is None


@pytest.mark.parametrize("launch", ["module", "script"])
def test_torchrun_with_nproc_auto_starts_under_the_take_point(launch: str, tmp_path: Path) -> None:
    """`python -m torch.distributed.run` and the `torchrun` script, each with --nproc-per-node auto
    and the take point started in the launcher: the workers start, as many as torch counts."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    import torch

    from snapguard.takepoint import site_dir

    worker = tmp_path / "worker.py"
    worker.write_text("import os, sys\nopen(os.path.join(sys.argv[1], 'w' + os.environ['RANK']), 'w')"
                      ".write(os.environ['LOCAL_WORLD_SIZE'])\n")
    head = [sys.executable, "-m", "torch.distributed.run"] if launch == "module" else \
        [str(Path(sys.executable).parent / "torchrun")]
    env = {**os.environ, "PYTHONPATH": f"{site_dir()}:{os.environ.get('PYTHONPATH', '')}",
           protocol.TAKE_DIR_ENV: str(tmp_path), "USE_LIBUV": "0"}
    seen = tmp_path / "seen"  # one file per worker: RANK -> LOCAL_WORLD_SIZE
    seen.mkdir()
    out = subprocess.run([*head, "--standalone", "--nnodes", "1", "--nproc-per-node", "auto", str(worker),
                          str(seen)],
                         env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-2000:]
    count = torch._utils.cpu_count() if not torch.cuda.is_available() else torch.cuda.device_count()
    assert {p.name: p.read_text() for p in seen.iterdir()} == {f"w{r}": str(count) for r in range(count)}
