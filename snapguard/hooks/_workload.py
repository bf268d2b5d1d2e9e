"""The workload side of the take point (runs inside the trainer).

A global optimizer step post-hook is registered the moment `torch.optim.optimizer` is imported, so
every rank of a job counts the same optimizer steps from its first. A daemon thread listens on a
unix socket for one request per connection:
  status            -> {"step": steps completed}
  take <seconds>    -> hold at the end of the next step
  take-at <S> <s>   -> hold at the end of step S (a step every rank of a job reaches: no rank is
                       left inside a collective that waits for a held one)
  release           -> go on
While held, the trainer's own thread has synchronised, emptied PyTorch's device and pinned host
caches and trimmed the C heap, and makes no CUDA call; it goes on by itself after SNAPGUARD_TAKE_HOLD_S, so a lost executor cannot hold it
forever.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["start"]

_HOLD_S = float(os.environ.get("SNAPGUARD_TAKE_HOLD_S", "300"))
_OPTIMIZER_MODULE = "torch.optim.optimizer"


def _host_anon_bytes() -> int:
    """Resident anonymous memory (RssAnon) of this process, 0 where procfs does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): return free heap pages to the kernel. Nothing elsewhere (musl)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


class _TakePoint:
    def __init__(self) -> None:
        self.step = 0
        self.trainer = False  # the step hook is registered: this process imported torch's optimizers
        self.hold_at: int | None = None
        self.reached = threading.Event()
        self.released = threading.Event()
        self.figures: dict[str, Any] = {}
        self.lock = threading.Lock()

    def arm(self, at_step: int | None) -> None:
        with self.lock:
            self.reached.clear()
            self.released.clear()
            self.hold_at = self.step + 1 if at_step is None else at_step

    def disarm(self) -> None:
        with self.lock:
            self.hold_at = None

    def at_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self.lock:
            self.step += 1
            holding = self.hold_at is not None and self.step >= self.hold_at
            if holding:
                self.hold_at = None
        if holding:
            self._hold()

    def _hold(self) -> None:
        import torch

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        reserved_before = torch.cuda.memory_reserved() if cuda else 0
        host_before = _host_anon_bytes()
        t0 = time.monotonic()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)  # pinned staging buffers
            if host_empty is not None:
                host_empty()
        # Every resident anonymous page is written into the image: give freed heap back first.
        gc.collect()
        _malloc_trim()
        self.figures = {
            "pid": os.getpid(),
            "step": self.step,
            "reserved_before": reserved_before,
            "reserved_after": torch.cuda.memory_reserved() if cuda else 0,
            "allocated": torch.cuda.memory_allocated() if cuda else 0,
            "host_anon_before": host_before,
            "host_anon_after": _host_anon_bytes(),
            "trim_s": time.monotonic() - t0,
        }
        self.reached.set()
        # Hold at the boundary: the snapshot is taken while this thread waits here.
        self.released.wait(_HOLD_S)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the step hook as soon as torch's optimizer module has executed."""

    def __init__(self, point: _TakePoint) -> None:
        self.point = point

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _OPTIMIZER_MODULE:
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


def _nccl_groups() -> bool:
    """Whether this process has an NCCL process group (cuda-checkpoint cannot checkpoint NCCL
    communicators, and procfs does not always show them)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    try:
        from torch.distributed.distributed_c10d import _world

        return any("nccl" in str(entry[0]).lower() for entry in _world.pg_map.values())
    except Exception:  # private API moved: ask the default group
        return "nccl" in str(dist.get_backend()).lower()


def _answer(point: _TakePoint, words: list[str]) -> dict[str, Any]:
    if words[0] == "status":
        return {"ok": True, "step": point.step, "trainer": point.trainer, "nccl": _nccl_groups(),
                "pid": os.getpid()}
    if words[0] in ("take", "take-at"):
        at = int(words[1]) if words[0] == "take-at" else None
        wait = float(words[-1]) if len(words) > (2 if at is not None else 1) else 10.0
        if at is not None and point.step >= at:
            return {"ok": False, "error": f"step {at} already passed (at {point.step})", "step": point.step}
        point.arm(at)
        if point.reached.wait(wait):
            return {"ok": True, **point.figures}
        point.disarm()
        return {"ok": False, "error": "no step boundary in time", "step": point.step}
    if words[0] == "release":
        point.released.set()
        return {"ok": True}
    return {"ok": False, "error": f"unknown request {words[0]!r}"}


def _serve(path: str, point: _TakePoint) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        with conn:
            words = conn.makefile().readline().split()
            if words:
                conn.sendall((json.dumps(_answer(point, words)) + "\n").encode())


def start(take_dir: str) -> None:
    from . import socket_path

    os.makedirs(take_dir, mode=0o700, exist_ok=True)
    point = _TakePoint()
    if _OPTIMIZER_MODULE in sys.modules:
        sys.modules[_OPTIMIZER_MODULE].register_optimizer_step_post_hook(point.at_step_end)
        point.trainer = True
    else:
        sys.meta_path.insert(0, _RegisterOnImport(point))
    threading.Thread(target=_serve, args=(socket_path(take_dir, os.getpid()), point),
                     name="snapguard-take-point", daemon=True).start()
