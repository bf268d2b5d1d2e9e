"""The workload side of the take point (runs inside the trainer).

A daemon thread listens on a unix socket. `take <seconds>` registers a global optimizer step
post-hook; at the end of the next optimizer step the trainer's own thread synchronises, empties
PyTorch's cache, hands its memory figures back and blocks, making no CUDA call, until `release`
(or until SNAPGUARD_TAKE_HOLD_S passes, so a lost executor cannot hold it forever).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["start"]

_HOLD_S = float(os.environ.get("SNAPGUARD_TAKE_HOLD_S", "300"))


class _TakePoint:
    def __init__(self) -> None:
        self.reached = threading.Event()
        self.released = threading.Event()
        self.figures: dict[str, Any] = {}
        self.handle: Any = None

    def arm(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.reached.clear()
        self.released.clear()
        self.handle = register_optimizer_step_post_hook(self._at_step_end)

    def _at_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        import torch

        self.handle.remove()
        reserved_before = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
        t0 = time.monotonic()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.figures = {
            "pid": os.getpid(),
            "reserved_before": reserved_before,
            "reserved_after": torch.cuda.memory_reserved() if torch.cuda.is_available() else 0,
            "allocated": torch.cuda.memory_allocated() if torch.cuda.is_available() else 0,
            "trim_s": time.monotonic() - t0,
        }
        self.reached.set()
        # Hold at the boundary: the snapshot is taken while this thread waits here.
        self.released.wait(_HOLD_S)


def _serve(path: str, point: _TakePoint) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(4)
    while True:
        conn, _ = srv.accept()
        with conn:
            words = conn.makefile().readline().split()
            if not words:
                continue
            if words[0] == "take":
                wait = float(words[1]) if len(words) > 1 else 10.0
                point.arm()
                ok = point.reached.wait(wait)
                reply = {"ok": ok, **(point.figures if ok else {"error": "no step boundary in time"})}
                if not ok and point.handle is not None:
                    point.handle.remove()
            elif words[0] == "release":
                point.released.set()
                reply = {"ok": True}
            else:
                reply = {"ok": False, "error": f"unknown request {words[0]!r}"}
            conn.sendall((json.dumps(reply) + "\n").encode())


def start(take_dir: str) -> None:
    os.makedirs(take_dir, mode=0o700, exist_ok=True)
    from . import socket_path

    point = _TakePoint()
    t = threading.Thread(target=_serve, args=(socket_path(take_dir, os.getpid()), point),
                         name="snapguard-take-point", daemon=True)
    t.start()
    sys.modules[__name__].point = point  # type: ignore[attr-defined]
