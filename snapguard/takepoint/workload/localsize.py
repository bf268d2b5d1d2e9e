"""torchrun's `--nproc-per-node gpu|auto`, counted without opening the GPU driver in its agent.

torch.distributed.run's `determine_local_world_size` answers `gpu` and `auto` with
torch.cuda.is_available() / device_count() and torch.accelerator's, in the launcher itself: that
opens the driver there (/dev/nvidia* held by a process with no CUDA context, a tree CRIU's CUDA
plugin cannot dump). In torchrun's launcher process (`launcher_process`: torch.distributed.run
imported by the `torchrun` script, or run as `python -m torch.distributed.run`), the take point
answers those questions (`answer_apart`) from one child Python that asks torch itself, its take
point not started; the launcher never touches CUDA, and torch's own function runs unchanged
(the same counts, the same ValueError where none is). The answers are the child's from then on,
in that process only (its workers are processes of their own). A child that cannot answer (a
broken torch, past PROBE_S) leaves torch's own functions in place: the driver then opens in the
launcher, and the executor's preflight says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

from .. import protocol

__all__ = ["PROBE_S", "RUN_MODULE", "answer_apart", "launcher_process"]

RUN_MODULE = "torch.distributed.run"
PROBE_S = 120.0
_PROBE = """\
import json
import torch
acc = getattr(torch, "accelerator", None)
a = bool(acc is not None and acc.is_available())
print(json.dumps({"cuda": torch.cuda.is_available(), "cuda_count": torch.cuda.device_count(),
                  "acc": a, "acc_count": acc.device_count() if a else 0,
                  "acc_type": acc.current_accelerator().type if a else None}))
"""


def launcher_process() -> bool:
    """Whether this process is torchrun's launcher (its elastic agent)."""
    main = sys.modules.get("__main__")
    return RUN_MODULE in sys.modules or getattr(getattr(main, "__spec__", None), "name", None) == RUN_MODULE


def _ask_child() -> dict[str, Any] | None:
    env = {k: v for k, v in os.environ.items() if k != protocol.TAKE_DIR_ENV}
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=PROBE_S, check=False)
        lines = out.stdout.strip().splitlines()
        if out.returncode != 0 or not lines:
            return None
        got = json.loads(lines[-1])
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    ok = isinstance(got, dict) and isinstance(got.get("cuda"), bool) and isinstance(got.get("acc"), bool) and \
        isinstance(got.get("cuda_count"), int) and isinstance(got.get("acc_count"), int) and \
        (got.get("acc_type") is None or isinstance(got.get("acc_type"), str))
    return got if ok else None


def answer_apart(torch: Any) -> None:
    """torch.cuda's and torch.accelerator's availability and counts, from a child, in this process;
    asked once, at the first question. Twice is once."""
    cuda, acc = torch.cuda, getattr(torch, "accelerator", None)
    if getattr(cuda.is_available, "_snapguard", False):
        return
    try:
        if cuda.is_initialized():  # CUDA is open here already: nothing left to spare
            return
    except Exception:
        return
    real = {"cuda.is_available": cuda.is_available, "cuda.device_count": cuda.device_count}
    if acc is not None:
        real.update({"acc.is_available": acc.is_available, "acc.device_count": acc.device_count,
                     "acc.current_accelerator": acc.current_accelerator})
    lock, asked = threading.Lock(), {}

    def answers() -> dict[str, Any] | None:
        with lock:
            if "got" not in asked:
                asked["got"] = _ask_child()
                if asked["got"] is None:  # put torch's own back
                    cuda.is_available, cuda.device_count = real["cuda.is_available"], real["cuda.device_count"]
                    if acc is not None:
                        acc.is_available, acc.device_count = real["acc.is_available"], real["acc.device_count"]
                        acc.current_accelerator = real["acc.current_accelerator"]
            return asked["got"]

    def make(key: str, pick: Any) -> Any:
        def answer(*args: Any, **kwargs: Any) -> Any:
            got = answers()
            return real[key](*args, **kwargs) if got is None else pick(got)

        answer._snapguard = True  # type: ignore[attr-defined]
        return answer

    cuda.is_available = make("cuda.is_available", lambda g: g["cuda"])
    cuda.device_count = make("cuda.device_count", lambda g: g["cuda_count"])
    if acc is not None:
        acc.is_available = make("acc.is_available", lambda g: g["acc"])
        acc.device_count = make("acc.device_count", lambda g: g["acc_count"])
        acc.current_accelerator = make("acc.current_accelerator",
                                       lambda g: torch.device(g["acc_type"]) if g["acc_type"] else None)
