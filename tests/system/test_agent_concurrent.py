"""On one notice the agent snapshots a node's workloads concurrently within the notice's lead:
two real bare counters snapshotted at once by real CRIU, a third (registered as holding far more
GPU memory than the lead can move) falling back to its file checkpoint with NOTICE_TOO_SHORT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapguard_lab.targets import COUNTER

pytestmark = [pytest.mark.root, pytest.mark.stack]

EXE = os.path.join(os.path.dirname(sys.executable), "snapguard")


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_two_snapshotted_at_once_and_a_third_falls_back(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the agent's tests need root (CRIU)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("concurrency needs two CPUs")
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    env = {"SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}
    procs = []
    try:
        for name in ("a", "b", "c"):
            log = tmp_path / f"{name}.log"
            procs.append(subprocess.Popen([sys.executable, "-c", COUNTER, str(log)], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        for p, name in zip(procs, "abc"):
            out = _run("protect", "--pid", str(p.pid), "--job", f"job-{name}", "--file-checkpoint",
                       f"/ckpt/{name}.pt", env=env)
            assert out.returncode == 0, out.stderr
        reg = tmp_path / "state" / "agent" / "registry.json"
        doc = json.loads(reg.read_text())
        doc["workloads"][f"pid:{procs[2].pid}"]["gpu_bytes"] = 80 << 30  # 80 GiB: no 10 s lead moves it
        reg.write_text(json.dumps(doc))
        out = _run("notice", "--lead", "10", "--id", "short", "--queue", env=env)
        assert out.returncode == 0, out.stderr
        start = time.monotonic()
        out = _run("agent", "--once", "--host-checks-every", "0", env=env)
        took = time.monotonic() - start
        assert out.returncode == 0, out.stderr
        events = [json.loads(x) for x in (tmp_path / "state" / "agent" / "journal.jsonl").read_text().splitlines()]
        kinds = [e["event"] for e in events]
        sched = events[kinds.index("schedule")]
        assert sched["workers"] >= 2 and sched["order"][-1]["key"] == f"pid:{procs[2].pid}", sched
        started = [i for i, k in enumerate(kinds) if k == "snapshot_started"]
        sealed = [i for i, k in enumerate(kinds) if k == "snapshot_sealed"]
        assert len(started) == 2 and len(sealed) == 2, out.stderr
        assert started[1] < sealed[0]  # the second began before the first was sealed: at once
        fb = [e for e in events if e["event"] == "fell_back"]
        assert [(e["key"], e["reason"], e["file_checkpoint"]) for e in fb] == [
            (f"pid:{procs[2].pid}", "NOTICE_TOO_SHORT", "/ckpt/c.pt")]
        done = events[kinds.index("schedule_done")]
        assert sorted(done["fit"]) == sorted(f"pid:{p.pid}" for p in procs[:2])
        assert procs[2].poll() is None  # never stopped: it goes on until the node does
        assert all(p.wait(10) is not None for p in procs[:2])  # stopping snapshots
        assert took < 30
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
