"""The executor's cuda-checkpoint broker (snapguard.cuda.Broker) and the tool's client side
(snapguard.cuda_tool): through the broker the installed `snapguard-cuda-checkpoint` prints and
exits exactly as it does on its own; a broker it cannot reach leaves it answering itself; one that
took the request and did not answer is an error, never a second run; only well-formed requests
are served (its own uid only, and no other uid's listener asked: tests/system/test_root_cuda_broker.py). (On this machine the driver cannot load: both sides say so alike; on a GPU
machine the same holds for the driver's own answers, bench/gpu runs it through CRIU.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard.cuda import BROKER_ENV, Broker
from snapguard.wire import recv_line

TOOL = str(Path(sys.executable).parent / "snapguard-cuda-checkpoint")
CASES = [["-h"], [], ["--get-state"], ["--get-state", "--pid", "1"], ["--get-restore-tid", "--pid", "1"],
         ["--action", "bogus", "--pid", "1"], ["--action", "lock", "--pid", "1", "--timeout", "5"],
         ["--action", "restore", "--pid", "1", "--device-map", "nonsense"], ["--pid", "x", "--get-state"],
         ["--toggle", "--pid", "1"], ["--get-state", "--action", "lock", "--pid", "1"]]


@pytest.fixture
def short_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="sgb-", dir="/tmp")  # a socket path fits in sun_path
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tool(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if k not in (BROKER_ENV, "SNAPGUARD_DEVICE_MAP")}
    done = subprocess.run([TOOL, *argv], env={**base, **env}, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("device_map", [None, "GPU-a=GPU-b", "broken"])
def test_through_the_broker_the_tool_answers_as_on_its_own(short_dir: str, device_map: str | None) -> None:
    extra = {"SNAPGUARD_DEVICE_MAP": device_map} if device_map else {}
    with Broker(os.path.join(short_dir, "cuda.sock")) as broker:
        for argv in CASES:
            alone = tool(argv, extra)
            through = tool(argv, {**extra, BROKER_ENV: broker.path})
            assert through == alone, argv
        assert broker.served == len(CASES)  # every run went through it
    assert not os.path.exists(broker.path)


def test_a_broker_it_cannot_reach_leaves_it_answering_itself(short_dir: str) -> None:
    for argv in (["-h"], ["--get-state", "--pid", "1"]):
        assert tool(argv, {BROKER_ENV: os.path.join(short_dir, "absent.sock")}) == tool(argv, {})


def test_a_request_taken_and_not_answered_is_an_error_not_a_second_run(short_dir: str) -> None:
    path = os.path.join(short_dir, "mute.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def take_and_drop() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)

    server.settimeout(60)  # a tool that never connects fails the test, never hangs it
    t = threading.Thread(target=take_and_drop, daemon=True)
    t.start()
    rc, out, err = tool(["-h"], {BROKER_ENV: path})  # -h on its own would print the help and exit 0
    t.join(timeout=30)
    server.close()
    assert (rc, out) == (1, "") and "no answer from the executor's broker" in err


def ask(path: str, payload: bytes) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(payload)
        return json.loads(recv_line(s, 1 << 20))


@pytest.mark.parametrize("payload", [b"not json\n", b'{"argv": "-h"}\n', b'{"argv": [1]}\n', b"[]\n",
                                     b'{"argv": ["-h"], "extra": 1}\n', b'{"argv": ["-h"], "device_map": 5}\n',
                                     json.dumps({"argv": ["x" * 300]}).encode() + b"\n",
                                     b'{"argv": [' + b'"-h",' * 5000 + b'"-h"]}\n',
                                     b'{"argv": ' + b"[" * 4000 + b"]" * 4000 + b"}\n",  # past json's depth
                                     b'{"argv": ["\xff\xfe"]}\n'])
def test_malformed_requests_are_refused(short_dir: str, payload: bytes) -> None:
    with Broker(os.path.join(short_dir, "cuda.sock")) as broker:
        reply = ask(broker.path, payload)
        assert reply["rc"] == 2 and reply["stdout"] == "", reply
        assert broker.served == 0


def test_a_snapshot_with_cuda_processes_runs_crius_plugin_against_its_broker(short_dir: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's wiring: for a CRIU run with CUDA processes, a broker in the run's private
    directory, named in CRIU's environment, gone after the run, its answers counted; none without
    CUDA processes or with the config's `cuda_broker` false; and CRIU never inherits the variable."""
    from snapguard import criu
    from snapguard.config import Config
    from snapguard.pipeline._steps import Steps as _Steps
    from snapguard.pipeline.scopes import cuda_broker as _cuda_broker

    on, off = Config({"cuda_broker": True}, None), Config({"cuda_broker": False}, None)
    monkeypatch.setenv(BROKER_ENV, "/somewhere/else.sock")
    steps = _Steps()
    with criu.RunDir(short_dir, "/bin/true", None) as run_dir:
        st = os.lstat(run_dir.path)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700  # the socket's only guard
        opts = criu.CriuOptions(images_dir=short_dir, work_dir=short_dir, libdir=short_dir, timeout_s=5)
        assert BROKER_ENV not in run_dir.environment(opts)
        with _cuda_broker(run_dir, True, on, steps) as env:
            path = env[BROKER_ENV]
            assert os.path.dirname(path) == run_dir.path and os.stat(path).st_mode & 0o777 == 0o600
            assert tool(["-h"], env)[0] == 0 and tool(["--get-state", "--pid", "1"], env)[0] == 1
        assert not os.path.exists(path)
        with _cuda_broker(run_dir, False, on, steps) as env:
            assert env == {}
        assert steps.counts == {"cuda_broker_answers": 2}
        failed = _Steps()
        with pytest.raises(RuntimeError), _cuda_broker(run_dir, True, on, failed) as env:
            raise RuntimeError("CRIU's run failed")  # the broker still closes, its answers still counted
        assert not os.path.exists(env[BROKER_ENV]) and failed.counts == {"cuda_broker_answers": 0}
        with _cuda_broker(run_dir, True, off, steps) as env:
            assert env == {}
    assert steps.counts == {"cuda_broker_answers": 2}


def test_no_child_but_the_crius_it_serves_is_told_of_a_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker named in the executor's own environment (inherited, planted) reaches no child that
    snapguard starts with its environment: children.run and run_captured drop it; an environment
    the caller builds (CRIU's, with the broker of its run) is passed as given."""
    from snapguard import children
    from snapguard.reasons import Reason

    monkeypatch.setenv(BROKER_ENV, "/somewhere/else.sock")
    monkeypatch.setenv("SNAPGUARD_SOME_SETTING", "kept")
    show = [sys.executable, "-c", f"import os; print(os.environ.get({BROKER_ENV!r}), os.environ.get('SNAPGUARD_SOME_SETTING'))"]
    got = children.run_captured(show, timeout_s=30, what="env", reason=Reason.INTERNAL_ERROR)
    assert got.stdout.split() == ["None", "kept"], got
    probed = children.probe(show, 30)
    assert not isinstance(probed, str) and probed.stdout.split() == ["None", "kept"]
    given = children.run_captured(show, timeout_s=30, what="env", reason=Reason.INTERNAL_ERROR,
                                  env={BROKER_ENV: "/run/x/cuda.sock", "PATH": "/usr/bin:/bin"})
    assert given.stdout.split() == ["/run/x/cuda.sock", "None"], given


class _RefusingDriver:
    """The driver's Python side raising what its C types refuse (a GPU UUID that is not one, a
    timeout past an int): on this machine libcuda cannot load, so the real one never gets there."""

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        raise OverflowError("int too big to convert")

    def restore(self, pid: int, pairs: object = None) -> None:
        raise ValueError("badly formed hexadecimal UUID string")


def test_what_the_driver_refuses_is_one_line_and_the_broker_serves_on(short_dir: str) -> None:
    with Broker(os.path.join(short_dir, "cuda.sock"), driver=_RefusingDriver) as broker:  # type: ignore[arg-type]
        for argv in (["--action", "lock", "--pid", "1", "--timeout", str(2**40)],
                     ["--action", "restore", "--pid", "1", "--device-map", "GPU-a=GPU-b"]):
            rc, out, err = tool(argv, {BROKER_ENV: broker.path})
            assert rc == 2 and out == "" and err.count("\n") == 1 and "Error" in err, (argv, err)
        assert tool(["-h"], {BROKER_ENV: broker.path})[0] == 0
        assert broker.served == 3


def test_close_wakes_the_waiting_broker_at_once(short_dir: str) -> None:
    """Its thread waits in accept() with a 5 s fallback poll; close() wakes it (shutdown), so the
    dump or restore around it does not wait out the poll (it waited 84 ms on average with a 0.2 s
    poll). 2 s is far above the wake-up and far below the poll."""
    broker = Broker(os.path.join(short_dir, "cuda.sock"), driver=_RefusingDriver)  # type: ignore[arg-type]
    assert tool(["-h"], {BROKER_ENV: broker.path})[0] == 0  # it serves, then waits in accept() again
    broker.close(wait_s=2.0)
    assert not broker.abandoned and not os.path.exists(broker.path)
