"""The cuda-checkpoint broker against another uid, which needs root to be one: the broker serves
only its own uid, and the tool asks no socket another uid listens on. The rest of the broker and
the tool is in tests/unit/test_cuda_broker.py, whose helpers these share."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from snapguard.cuda import BROKER_ENV, Broker
from tests.unit.test_cuda_broker import short_dir, tool

pytestmark = pytest.mark.root

__all__ = ["short_dir"]  # the shared fixture


def test_only_its_own_uid_is_served(short_dir: str) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root: a child that drops to another uid")
    with Broker(os.path.join(short_dir, "cuda.sock")) as broker:
        os.chmod(short_dir, 0o755)  # only so that another uid can reach the socket at all
        os.chmod(broker.path, 0o666)
        code = ("import json, socket, sys\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(30); s.connect(sys.argv[1])\n"
                "data = b''  # nothing sent: the broker refuses before it reads\n"
                "while not data.endswith(b'\\n'):\n"
                "    chunk = s.recv(65536)\n"
                "    if not chunk: break\n"
                "    data += chunk\n"
                "sys.stdout.write(data.decode())\n")
        # the system interpreter: the test's own may sit where that uid cannot reach
        done = subprocess.run(["/usr/bin/python3", "-I", "-c", code, broker.path], user=65534, group=65534,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout)
        assert reply["rc"] == 126 and reply["stdout"] == "" and "not 65534" in reply["stderr"], reply
        assert broker.served == 0


def test_the_tool_asks_no_listener_of_another_uid(short_dir: str) -> None:
    """A socket someone else listens on is never asked: the tool answers itself."""
    if os.geteuid() != 0:
        pytest.fail("needs root: a listener of another uid")
    os.chmod(short_dir, 0o777)
    path = os.path.join(short_dir, "foreign.sock")
    code = ("import socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.bind(sys.argv[1]); s.listen(4)\n"
            "print('ready', flush=True); s.settimeout(60)\n"
            "c, _ = s.accept(); c.sendall(b'{\"rc\": 0, \"stdout\": \"running\\\\n\", \"stderr\": \"\"}\\n')\n"
            "time.sleep(5)\n")
    listener = subprocess.Popen(["/usr/bin/python3", "-I", "-c", code, path], user=65534, group=65534,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        argv = ["--get-state", "--pid", "1"]
        assert tool(argv, {BROKER_ENV: path}) == tool(argv, {})  # not the listener's "running"
    finally:
        listener.kill()
        listener.wait(timeout=30)
