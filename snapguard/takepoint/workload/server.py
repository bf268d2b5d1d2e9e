"""The take point's socket server in the trainer: one request per connection, answered from the
`TakePoint` (protocol.py's words and fields), and the step hook's registration when torch's
optimizer module is imported."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys
import time
from typing import Any

from ..protocol import (ERROR, MAX_REQUEST, NCCL, OK, PID, RELEASE, STATUS, STEP, TAKE, TAKE_AT, TRAINER,
                        parse_take, recv_fds, release_rendezvous)
from .point import TakePoint

__all__ = ["OPTIMIZER_MODULE", "RegisterOnImport", "answer", "read_request", "serve"]

OPTIMIZER_MODULE = "torch.optim.optimizer"


class RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the step hook as soon as torch's optimizer module has executed."""

    def __init__(self, point: TakePoint) -> None:
        self.point = point

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != OPTIMIZER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, point = spec.loader, self.point

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                module.register_optimizer_step_post_hook(point.at_step_end)
                point.trainer = True

        spec.loader = _Loader()
        return spec


def nccl_groups() -> bool:
    """Whether this process has an NCCL process group the take point does not release at the hold
    (cuda-checkpoint cannot checkpoint NCCL communicators, and procfs does not always show them);
    one on the take point's own backend (`groups`: sgnccl) is not such a group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    try:
        from torch.distributed.distributed_c10d import _world

        return any(part.rpartition(":")[2] == "nccl" for entry in _world.pg_map.values()
                   for part in str(entry[0]).lower().split(","))
    except Exception:  # private API moved: ask the default group
        return "nccl" in str(dist.get_backend()).lower()


def compile_worker() -> bool:
    """This interpreter is inductor's compile worker sidecar (`python -m torch._inductor.compile_worker`,
    started by the trainer with its environment, so with the hook): it imports torch's optimizers
    but never steps, and is no trainer to hold."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and str(getattr(spec, "name", "")).startswith("torch._inductor.compile_worker"):
        return True  # python -m
    # python <path>/__main__.py, as SubprocPool runs it
    path = os.path.normpath(str(getattr(main, "__file__", "") or ""))
    return path.endswith(os.path.join("torch", "_inductor", "compile_worker", "__main__.py"))


def answer(point: TakePoint, words: list[str], fds: list[int]) -> tuple[dict[str, Any], int | None]:
    """The reply to one request, and a descriptor to send with it (a take's spilled bytes). `fds`
    came with the request: a release's is the file to reload from; any other request's are closed."""
    if words[0] == RELEASE:
        try:
            rendezvous = release_rendezvous(words)
        except ValueError as e:  # nothing released: the executor's request is at fault
            for fd in fds:
                os.close(fd)
            return {OK: False, ERROR: str(e)}, None
        point.release(fds, rendezvous)
        return {OK: True}, None
    for fd in fds:
        os.close(fd)
    if words[0] == STATUS:
        return {OK: True, STEP: point.step, TRAINER: point.trainer and not compile_worker(),
                NCCL: nccl_groups(), PID: os.getpid(), **point.status()}, None
    if words[0] in (TAKE, TAKE_AT):
        take = parse_take(words)
        at = take.at
        if at is not None and point.step >= at:
            return {OK: False, ERROR: f"step {at} already passed (at {point.step})", STEP: point.step}, None
        point.arm(at, take.wait_s, take.spill)
        point.collect_ahead()  # beside the step that ends in the hold, not inside the stall
        if point.reached.wait(max(0.0, take.wait_s - (time.monotonic() - point.armed_at))):
            return {OK: True, **point.figures}, point.pop_handover()
        point.disarm()
        return {OK: False, ERROR: "no step boundary in time", STEP: point.step}, None
    return {OK: False, ERROR: f"unknown request {words[0]!r}"}, None


def read_request(conn: socket.socket) -> tuple[list[str], list[int]]:
    """One request line and the descriptors sent with it (SCM_RIGHTS, with its first bytes)."""
    data, fds = recv_fds(conn, MAX_REQUEST)
    while data and b"\n" not in data and len(data) < MAX_REQUEST:
        more = conn.recv(MAX_REQUEST)
        if not more:
            break
        data += more
    return data.decode(errors="replace").split("\n", 1)[0].split(), fds
def serve(path: str, point: TakePoint) -> None:
    """Listen on `path` (0600) and answer each connection's request, for the life of the process."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                words, fds = read_request(conn)
            except OSError:
                continue
            if not words:
                for fd in fds:
                    os.close(fd)
                continue
            reply, handover = answer(point, words, fds)
            data = (json.dumps(reply) + "\n").encode()
            try:
                sent = socket.send_fds(conn, [data], [handover]) if handover is not None else 0
                conn.sendall(data[sent:])
            except OSError:
                pass  # the executor is gone: a hold goes on by itself after its limit
            finally:
                if handover is not None:
                    os.close(handover)  # ours closed before the executor reads the end of the reply


