"""The executor answers CRIU's CUDA plugin itself while CRIU runs.

The plugin runs `cuda-checkpoint` about five times per dump and four per restore (its probe, the
restore thread's id, the state, the restore and unlock), each a new process that starts Python and
loads libcuda: 0.15-0.2 s a run on the H200, inside the trainer's stall. The executor has the
driver loaded already, so for the length of one CRIU run it listens on a socket in that run's
private directory (snapguard.criu.RunDir: root's, 0700) and CRIU's environment names it
(SNAPGUARD_CUDA_BROKER). snapguard's `cuda-checkpoint` (snapguard.cuda_tool) sends its arguments
there and prints the answer, which is exactly what it would have printed itself
(snapguard.cuda.cli.answer); when nothing listens it answers itself. NVIDIA's binary ignores the
variable. Only root's connections are served (SO_PEERCRED); a request is one JSON line of at most
8 KiB, `{"argv": [...], "device_map": "..." | null}`; the reply one JSON line, `{"rc", "stdout",
"stderr"}`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from ..wire import LineTooLong, peer_uid, recv_line
from ._driver import Driver, load
from .cli import answer

__all__ = ["Broker"]

REQUEST_MAX = 8192
_ARGS_MAX, _ARG_MAX, _MAP_MAX = 16, 256, 4096


def _request(data: bytes) -> tuple[list[str], str | None] | None:
    """The request's argv and device map, or None for anything else."""
    try:
        req = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        return None
    if not isinstance(req, dict) or set(req) - {"argv", "device_map"}:
        return None
    argv, device_map = req.get("argv"), req.get("device_map")
    if not isinstance(argv, list) or len(argv) > _ARGS_MAX \
            or not all(isinstance(a, str) and len(a) <= _ARG_MAX for a in argv):
        return None
    if device_map is not None and (not isinstance(device_map, str) or len(device_map) > _MAP_MAX):
        return None
    return argv, device_map


class Broker:
    """Serves `cuda-checkpoint` runs on a Unix socket at `path` until closed (a context manager)."""

    def __init__(self, path: str, driver: Callable[[], Driver] = load) -> None:
        self.path = path
        self.served = 0
        self._driver = driver
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # no umask change: it is process-wide, and the executor's other threads create files;
            # the run's directory (0700, root's) guards the socket until the chmod
            self._sock.bind(path)
            os.chmod(path, 0o600)
            self._sock.listen(8)
        except OSError:
            self._sock.close()
            raise
        # close() wakes accept() at once with shutdown(); the timeout is only a fallback
        self._sock.settimeout(5.0)
        self.abandoned = False  # a driver call still running when close() stopped waiting
        self._thread = threading.Thread(target=self._serve, name="cuda-broker", daemon=True)
        self._thread.start()
        # libcuda loaded off the critical path (the dump's executor has it already; a restore not)
        threading.Thread(target=self._preload, name="cuda-broker-load", daemon=True).start()

    def _preload(self) -> None:
        try:
            self._driver()
        except OSError:
            pass  # each answer then says the driver cannot be loaded, as the tool would

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # closed
            with conn:
                try:
                    self._handle(conn)
                except OSError:
                    pass  # the client went away: nothing to answer
                except Exception as e:  # never the end of the broker: the next run must get an answer
                    try:
                        self._reply(conn, 1, "", f"cuda-checkpoint: the executor's broker failed: "
                                                 f"{type(e).__name__}: {' '.join(str(e).split())}\n")
                    except OSError:
                        pass

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        uid = peer_uid(conn)
        if uid != os.geteuid():
            self._reply(conn, 126, "", f"cuda-checkpoint: the executor's broker serves uid {os.geteuid()}, not {uid}\n")
            return
        try:
            data = recv_line(conn, REQUEST_MAX)
        except LineTooLong:
            self._reply(conn, 2, "", "cuda-checkpoint: request too long\n")
            return
        if not data.endswith(b"\n"):
            return  # the client went away mid-request
        parsed = _request(data)
        if parsed is None:
            self._reply(conn, 2, "", "cuda-checkpoint: malformed request to the executor's broker\n")
            return
        rc, out, err = answer(parsed[0], parsed[1], self._driver)
        self.served += 1
        self._reply(conn, rc, out, err)

    @staticmethod
    def _reply(conn: socket.socket, rc: int, out: str, err: str) -> None:
        conn.sendall(json.dumps({"rc": rc, "stdout": out, "stderr": err}).encode() + b"\n")

    def close(self, wait_s: float = 60.0) -> None:
        """Stop serving; wait up to `wait_s` for an answer in progress (a driver call cannot be
        interrupted: a restore of a large GPU state takes seconds), then go on regardless and say
        so in `abandoned` (its thread is a daemon)."""
        self._stop.set()
        # shutdown() wakes the thread blocked in accept() now (EINVAL on Linux); close() alone
        # leaves it in poll() until the timeout, 84 ms on average, which every dump and restore
        # paid inside its step (a leave-running snapshot's inside the stall)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=wait_s)
        self.abandoned = self._thread.is_alive()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
