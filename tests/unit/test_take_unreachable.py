"""A process whose take-point socket exists but never answers (a hook that hangs: a trainer
that may be mid-step) refuses the snapshot, typed and naming the pid, instead of being left out
of the processes the take point waits for; one that is gone is left out."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapguard.reasons import Reason, SnapguardError
from snapguard.takepoint import client
from snapguard.takepoint.protocol import TAKE_DIR_ENV

# binds <take dir>/<its pid>.sock as the hook does, accepts every connection, never answers
SILENT = """
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(os.path.join(os.environ["SNAPGUARD_TAKE_DIR"], f"{os.getpid()}.sock"))
s.listen(8)
open(sys.argv[1], "w").close()
held = []
while True:
    held.append(s.accept()[0])
"""


def test_a_take_socket_that_never_answers_refuses_the_snapshot(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    take_dir = tmp_path / "take"
    take_dir.mkdir(mode=0o700)
    ready = tmp_path / "ready"
    silent = subprocess.Popen([sys.executable, "-c", SILENT, str(ready)],
                              env={**os.environ, TAKE_DIR_ENV: str(take_dir)})
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert silent.poll() is None and time.monotonic() < deadline, "the silent hook did not start"
            time.sleep(0.02)
        assert client.socket_for(silent.pid) is not None
        monkeypatch.setattr(client, "_STATUS_WAIT_S", 0.5)
        started = time.monotonic()
        with pytest.raises(SnapguardError) as refused:
            client.trainers([os.getpid(), silent.pid])
        assert time.monotonic() - started < 5
        assert refused.value.reason is Reason.TAKE_POINT_UNREACHABLE
        assert refused.value.failure.evidence["pids"] == [silent.pid]
        assert f"pid {silent.pid}: no answer in 0.5 s" in str(refused.value), str(refused.value)
        assert "\n" not in str(refused.value)
    finally:
        silent.kill()
        silent.wait()
    # gone: its socket file is left, and it is no process to wait for
    assert (take_dir / f"{silent.pid}.sock").exists()
    assert client.trainers([silent.pid]) == {}
