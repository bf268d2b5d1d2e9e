"""The take point's releasable process groups (snapguard.takepoint.workload.groups) in a real
torch.distributed job of two ranks (gloo, CPU, loopback), the release's rendezvous words, and what the
executor's preflight says of a trainer's groups."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from snapguard import procfs
from snapguard.preflight import Report, workload
from snapguard.reasons import Reason, Severity
from snapguard.takepoint import protocol
from snapguard.takepoint.workload.groups import translate_backend
from snapguard_lab.planted import TCP_PAIR, planted

TRAINER = r'''
import json, os, struct, sys
sys.meta_path.insert(0, __import__("snapguard.takepoint.workload.groups", fromlist=["x"]).InstallOnImport())
from snapguard.takepoint.workload.groups import GROUPS
import torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo")
sub = dist.new_group([0])
out = {"backend": dist.get_backend(), "status": GROUPS.status()}
def sockets():
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [f for f in fds if f.startswith("socket:")]
def train(swap):
  torch.manual_seed(0)
  ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
  opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
  bits = out["swap" if swap else "plain"] = []
  for step in range(6):
      g = torch.Generator().manual_seed(step)
      loss = ddp(torch.randn(4, 8, generator=g)).pow(2).mean()
      opt.zero_grad(); loss.backward(); opt.step()
      t = loss.detach().clone(); dist.all_reduce(t, group=sub)
      bits.append(struct.pack(">f", float(t)).hex())
      if step == 2 and swap:
          out["sockets_before"] = len(sockets())
          out["release"] = GROUPS.release(10)
          out["sockets_held"] = len(sockets())
          try:
              dist.all_reduce(torch.zeros(1))
              out["collective_while_released"] = "ran"
          except Exception as e:
              out["collective_while_released"] = str(e)[:200]
          port = int(os.environ["NEXT_PORT"])
          out["rebuild"] = GROUPS.rebuild(f"127.0.0.1:{port}")
          out["status_after"] = GROUPS.status()
train(False)
train(True)
# a rank whose peer is not held: the drain times out and its groups stay as they were
rank = dist.get_rank()
if rank == 0:
    out["late"] = GROUPS.release(1.0, 99)
t = torch.ones(1); dist.all_reduce(t)
out["after_late"] = float(t)
print(json.dumps(out))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run() -> dict:
    """Both ranks of a two-rank job on loopback; rank 0's record."""
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "NEXT_PORT": str(_free_port()), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    ranks = [subprocess.Popen([sys.executable, "-c", TRAINER], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in ranks]
    for p, (_, err) in zip(ranks, outs):
        assert p.returncode == 0, err[-2000:]
    return json.loads(outs[0][0].strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs() -> tuple[dict, dict]:
    """One job: the same training uninterrupted, then with a release and rebuild after step 2."""
    pytest.importorskip("torch")
    out = _run()
    return out, out


def test_groups_run_on_the_take_points_backend(runs: tuple[dict, dict]) -> None:
    plain, _ = runs
    assert plain["backend"] == "sggloo"
    groups = plain["status"]
    assert groups["unreached"] == [] and groups["store"]["hosted"] is True  # rank 0's
    assert [(g["backend"], g["ranks"]) for g in groups["groups"]] == [("gloo", [0, 1]), ("gloo", [0])]


def test_release_drops_every_connection_and_rebuild_continues_bit_for_bit(runs: tuple[dict, dict]) -> None:
    plain, swapped = runs
    assert swapped["release"]["released"] is True and swapped["release"]["groups"] == 2
    assert swapped["sockets_before"] > 0 and swapped["sockets_held"] == 0
    assert "released for a snapshot" in swapped["collective_while_released"]
    assert swapped["rebuild"]["rendezvous"].startswith("127.0.0.1:")
    assert swapped["status_after"]["store"]["port"] == int(swapped["rebuild"]["rendezvous"].split(":")[1])
    assert swapped["swap"] == plain["plain"] and len(plain["plain"]) == 6


def test_a_drain_without_every_rank_leaves_the_groups(runs: tuple[dict, dict]) -> None:
    late = runs[0]["late"]
    assert late["released"] is False and "drain" in late["error"]
    assert runs[0]["after_late"] == 2.0  # both ranks' groups went on as they were


def test_backend_translation() -> None:
    assert translate_backend("gloo") == ("sggloo", [])
    assert translate_backend("NCCL") == ("sgnccl", [])
    assert translate_backend("cpu:gloo,cuda:nccl") == ("cpu:sggloo,cuda:sgnccl", [])
    assert translate_backend("mpi") == ("mpi", ["mpi"])
    assert translate_backend(None) == (None, [])


def test_release_rendezvous_words() -> None:
    assert protocol.release_request() == "release\n"
    line = protocol.release_request("169.254.82.10:29518")
    assert protocol.release_rendezvous(line.split()) == "169.254.82.10:29518"
    assert protocol.release_rendezvous(["release"]) is None
    assert protocol.parse_rendezvous("[fe80::1]:80") == ("fe80::1", 80)
    for bad in ("host", "host:0", "host:99999", ":80", "a b:1", "h;rm:1", "h:1x"):
        with pytest.raises(ValueError):
            protocol.parse_rendezvous(bad)
    with pytest.raises(ValueError):
        protocol.release_rendezvous(["release", "rendezvous"])


def test_malformed_release_releases_nothing() -> None:
    from snapguard.takepoint.workload.point import TakePoint
    from snapguard.takepoint.workload.server import answer

    point = TakePoint()
    reply, _ = answer(point, ["release", "rendezvous", "no-port"], [])
    assert reply["ok"] is False and "HOST:PORT" in reply["error"] and not point.released.is_set()
    reply, _ = answer(point, ["release", "rendezvous", "10.1.2.3:4000"], [])
    assert reply["ok"] is True and point.released.is_set() and point.rendezvous == "10.1.2.3:4000"


RELEASABLE = {protocol.GROUPS: {"groups": [{"backend": "gloo", "rank": 0, "size": 2, "ranks": [0, 1]}],
                                "unreached": [], "released": False,
                                "store": {"host": "169.254.81.10", "port": 29517, "hosted": True}}}


def _report(pid: int, trainers: dict) -> dict[Reason, list]:
    report = Report("test")
    workload.run_checks(report, procfs.inventory([pid]), trainers=trainers)
    out: dict[Reason, list] = {}
    for f in report.findings:
        out.setdefault(f.reason, []).append(f)
    return out


def test_preflight_says_which_groups_it_releases() -> None:
    with planted(TCP_PAIR) as pid:
        (f,) = _report(pid, {pid: {"trainer": True, **RELEASABLE}})[Reason.TCP_ESTABLISHED]
        assert f.severity is Severity.WARNING and f.evidence["cause"] == "groups-released"
        assert "gloo (rank 0 of ranks [0, 1])" in f.detail and "169.254.81.10:29517 hosted here" in f.detail
        unreached = {protocol.GROUPS: {**RELEASABLE[protocol.GROUPS], "unreached": ["torchrun's agent store"]}}
        found = _report(pid, {pid: {"trainer": True, **unreached}})
        assert found[Reason.TCP_ESTABLISHED][0].severity is Severity.BLOCKER  # not released: refused
        assert found[Reason.PROCESS_GROUP_UNREACHED][0].severity is Severity.BLOCKER
        report = Report("carried")
        workload.run_checks(report, procfs.inventory([pid]), tcp_established=True,
                            trainers={pid: {"trainer": True, **unreached}})
        assert {f.reason: f.severity for f in report.findings}[Reason.PROCESS_GROUP_UNREACHED] is Severity.WARNING


def test_nccl_groups_need_nvls_off(tmp_path: Path) -> None:
    nccl = {protocol.GROUPS: {**RELEASABLE[protocol.GROUPS],
                              "groups": [{"backend": "nccl", "rank": 0, "size": 1, "ranks": [0]}]}}
    inv = procfs.inventory([procfs_self()])
    inv.procs[0].env.pop("NCCL_NVLS_ENABLE", None)
    (f,) = workload.check_process_groups(inv, {procfs_self(): {"trainer": True, **nccl}})
    assert f.reason is Reason.NCCL_NVLS_ON and "NCCL_NVLS_ENABLE=(unset)" in f.detail
    inv.procs[0].env["NCCL_NVLS_ENABLE"] = "0"
    assert workload.check_process_groups(inv, {procfs_self(): {"trainer": True, **nccl}}) == []
    assert workload.groups_released({"trainer": True, **nccl})
    assert not workload.groups_released({"trainer": True})
    captured = {protocol.GROUPS: {**nccl[protocol.GROUPS], protocol.GROUPS_CAPTURED: True}}
    (f,) = workload.check_process_groups(inv, {procfs_self(): {"trainer": True, **captured}})
    assert f.reason is Reason.COLLECTIVE_IN_CUDA_GRAPH and f.severity is Severity.BLOCKER
    assert not workload.groups_released({"trainer": True, **captured})


def test_a_captured_collective_keeps_the_groups() -> None:
    from snapguard.takepoint.workload.groups import Groups

    groups = Groups()
    groups.groups, groups.captured = [object()], True
    assert groups.release(1.0) == {"released": False, "error": groups.error} and "CUDA graph" in groups.error
    assert groups.released is False


def procfs_self() -> int:
    import os

    return os.getpid()


@pytest.mark.parametrize("argv,env,word", [
    (["restore", "--images", "/nonexistent", "--rendezvous", "bad"], {}, "--rendezvous"),
    (["restore", "--images", "/nonexistent"], {"SNAPGUARD_RENDEZVOUS": "x y"}, "--rendezvous"),
    (["checkpoint", "--pid", "1", "--images", "/nonexistent", "--at-step", "-3"], {}, "--at-step"),
])
def test_bad_rendezvous_and_step_are_usage_errors(argv: list[str], env: dict[str, str], word: str) -> None:
    import os

    snapguard = os.path.join(os.path.dirname(sys.executable), "snapguard")
    done = subprocess.run([snapguard, *argv], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("snapguard USAGE_ERROR: argument " + word)


def test_what_the_take_point_cannot_own_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from snapguard.takepoint.workload.groups import _unreached

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    assert "MASTER_ADDR" in _unreached(None, None, 0, 2)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _unreached("env://", None, 0, 2) is None
    assert "RANK" in _unreached(None, None)
    assert "store of the trainer's" in _unreached(None, object(), 0, 2)
    assert "file:///tmp/x" in _unreached("file:///tmp/x", None, 0, 2)
    assert _unreached("tcp://10.0.0.1:29500", None, 0, 2) is None
    assert "tcp://" in _unreached("tcp://10.0.0.1:29500?rank=0", None, 0, 2)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "torchrun's agent store" in _unreached(None, None, 0, 2)


def test_no_backend_given_is_torchs_own_default_on_the_take_points_backend() -> None:
    """init_process_group() with no backend: the device:backend pairs torch itself would make (its
    BackendConfig of UNDEFINED; `cpu:gloo` on a machine without an accelerator), each on the take
    point's own backend, so the group is released at the hold like a named one."""
    pytest.importorskip("torch")
    script = r'''
import json, sys
sys.meta_path.insert(0, __import__("snapguard.takepoint.workload.groups", fromlist=["x"]).InstallOnImport())
from snapguard.takepoint.workload.groups import GROUPS
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
torchs = str(c10d.BackendConfig(c10d.Backend.UNDEFINED))
dist.init_process_group()
print(json.dumps({"torch": torchs, "backend": str(dist.get_backend()), "unreached": GROUPS.unreached,
                  "release": GROUPS.release(10)}))
'''
    env = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    translated, left = translate_backend(got["torch"])
    assert not left and got["unreached"] == []
    assert got["backend"] == translated, got  # e.g. cpu:sggloo for torch's cpu:gloo
    assert got["release"]["released"] is True, got["release"]
