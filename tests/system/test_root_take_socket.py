"""The take socket's check-then-use: a trainer (the user `nobody`, the real workload server on a
real unix socket) owns the directory of its socket, and a process of its own swaps the socket's
name for a link to another socket that only root can reach, in a loop, while the executor (root,
this test) asks the trainer's status again and again. The executor reaches the trainer, or
refuses; it never sends a byte to the other socket, whose server records every connection's bytes.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard.reasons import Reason, SnapguardError
from snapguard.takepoint import client

pytestmark = pytest.mark.root

NOBODY = 65534
PYTHON = "/usr/bin/python3"  # the trainer and the racer run as nobody, who may not run the venv's
ROOT = str(Path(__file__).resolve().parents[2])

TRAINER = """
import os, sys
from snapguard.takepoint.workload.point import TakePoint
from snapguard.takepoint.workload.server import serve
point = TakePoint()
point.trainer = True
serve(os.path.join(sys.argv[1], f"{os.getpid()}.sock"), point)
"""

# keeps a hard link of the real socket and puts, by rename, the socket and a link to the other
# socket at the trainer's name by turns, as fast as it can
RACER = """
import os, sys
take_dir, name, other = sys.argv[1:]
real = os.path.join(take_dir, name)
keep, a, b = (os.path.join(take_dir, n) for n in ("keep", "tmp-sock", "tmp-link"))
os.link(real, keep)
while True:
    for tmp in (a, b):
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    os.link(keep, a)
    os.rename(a, real)
    os.symlink(other, b)
    os.rename(b, real)
"""


class _Recorder:
    """A server on a socket only root reaches: every connection's bytes, in order."""

    def __init__(self, path: str) -> None:
        self.got: list[bytes] = []
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(64)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                data = b""
                try:
                    while chunk := conn.recv(4096):
                        data += chunk
                        if b"\n" in data:
                            conn.sendall(b'{"ok": true, "trainer": true, "step": 0, "root": "the wrong socket"}\n')
                            break
                except OSError:
                    pass
                self.got.append(data)


def _as_nobody(script: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PYTHON, "-c", script, *args], user=NOBODY, group=NOBODY, extra_groups=[],
                            env={"PYTHONPATH": ROOT, "SNAPGUARD_TAKE_DIR": args[0], "PATH": "/usr/bin:/bin"},
                            cwd="/", stdin=subprocess.DEVNULL)


@pytest.fixture
def take_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="snapguard-take-race-", dir="/tmp")
    os.chown(d, NOBODY, NOBODY)
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_link_swapped_in_for_the_take_socket_never_gets_a_request(take_dir: str, tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o700)  # root's alone: only a link followed by root reaches it
    other = str(tmp_path / "root-only.sock")
    recorder = _Recorder(other)
    trainer = _as_nobody(TRAINER, take_dir)
    racer = None
    try:
        name = f"{trainer.pid}.sock"
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(take_dir, name)):
            assert time.monotonic() < deadline and trainer.poll() is None, "the trainer's take point did not start"
            time.sleep(0.02)
        # unraced, the executor finds the trainer through its socket
        assert client.trainers([trainer.pid])[trainer.pid]["trainer"] is True
        racer = _as_nobody(RACER, take_dir, name, other)
        reached = 0
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            try:
                found = client.trainers([trainer.pid])
            except SnapguardError as e:  # a link where the socket was: refused, nothing sent
                assert e.reason is Reason.TAKE_POINT_UNREACHABLE, e
                continue
            if found:
                assert "root" not in found[trainer.pid], found  # the other socket's answer
                reached += 1
        assert racer.poll() is None, "the racer stopped"
        time.sleep(0.3)  # the recorder's last connection recorded
        sent = [g for g in recorder.got if g]
        assert sent == [], f"root sent {len(sent)} request(s) to the other socket: {sent[:3]}"
        assert reached > 0, "the executor never reached the trainer between the swaps"
    finally:
        for p in (racer, trainer):
            if p is not None:
                p.kill()
                p.wait()
        recorder.srv.close()
