"""A trainer whose process groups the take point releases, but which also holds a group made with
the C++ API over its own store: the connection left after the hold is refused before CRIU freezes
anything (PROCESS_GROUP_UNREACHED), the hold is released, and the trainer goes on. Real torch (CPU,
gloo, world size 1), the take point injected as in production, a real `snapguard checkpoint`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapguard.takepoint import site_dir
from snapguard_lab.testbed import product_root

pytest.importorskip("torch")

pytestmark = [pytest.mark.root, pytest.mark.stack]

TRAINER = r'''
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo", init_method="env://")
c10d = torch._C._distributed_c10d
store = dist.TCPStore("127.0.0.1", int(os.environ["RAW_PORT"]), 1, True, use_libuv=False)
raw = c10d.ProcessGroupGloo(c10d.PrefixStore("raw", store), 0, 1, timedelta(seconds=60))
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.ones(4, 8)
step = 0
while True:
    step += 1
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    raw.allreduce([torch.ones(1)]).wait()
    with open(sys.argv[1] + ".tmp", "w") as f:  # replaced whole: a reader never sees it empty
        f.write(str(step))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(0.02)
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_group_the_take_point_does_not_reach_is_refused_before_the_dump(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    env = {**os.environ, "SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}
    steps = tmp_path / "steps"
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    run_env = {**env, "PYTHONPATH": os.pathsep.join([site_dir(), product_root()]), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_port()), "RAW_PORT": str(_port()), "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_RANK": "0", "USE_LIBUV": "0", "SNAPGUARD_TAKE_DIR": str(tmp_path / "state" / "take")}
    proc = subprocess.Popen([sys.executable, str(trainer), str(steps)], env=run_env, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not steps.exists() or not steps.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "the trainer did not start"
            time.sleep(0.1)
        out = subprocess.run([sys.executable, "-m", "snapguard.cli", "checkpoint", "--pid", str(proc.pid),
                              "--images", str(tmp_path / "img"), "--leave-running", "--json"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr
        assert "PROCESS_GROUP_UNREACHED" in out.stderr
        failure = json.loads(out.stdout)
        assert failure["reason"] == "PROCESS_GROUP_UNREACHED"
        assert failure["evidence"]["connections"], failure
        assert not (tmp_path / "img" / "pages-1.img").exists()  # CRIU never ran
        before = int(steps.read_text())
        time.sleep(1.0)
        assert proc.poll() is None and int(steps.read_text()) > before, "the trainer did not go on"
    finally:
        subprocess.run(["pkill", "-9", "-s", str(proc.pid)], check=False)
        proc.wait(timeout=30)
