"""The workload side of the take point: it runs inside the user's trainer, started by the
injected sitecustomize (`start`), and imports nothing of snapguard's but
snapguard.takepoint.protocol (torch only lazily, at the hold).

A global optimizer step post-hook is registered the moment `torch.optim.optimizer` is imported, so
every rank of a job counts the same optimizer steps from its first. A daemon thread listens on a
unix socket for one request per connection (`server`; the words are protocol.py's). While held,
the trainer's own thread has synchronised, moved its tensors' bytes from the GPU into host memory
(`offload.Offload`: the driver's checkpoint then copies little; back on the release; off with
OFFLOAD_ENV=0), freed cuBLAS's workspaces (where the move ran: no CUDA graph), emptied PyTorch's
device and pinned host caches and trimmed the C heap, and makes no CUDA call; it goes on by itself
after HOLD_S_ENV's seconds, so a lost executor cannot hold it forever (`point.TakePoint`). Asked
with `spill`, the bytes go into a tmpfs file of its own (`spill.SpillArena`, in SPILL_DIR_ENV;
else the node's huge-page tmpfs SPILL_TMPFS where there is one, /dev/shm where not; SPILL_ENV=0
refuses), whose descriptor the take's answer carries (SCM_RIGHTS), none of it mapped or open here
while the snapshot is taken.

It also resolves the two things that put GPU handles outside a CUDA context into a trainer's tree
(CRIU cannot dump them), on by default, off with RESOLVE_ENV=0:
  forked children   a child forked from a process with a CUDA context drops the /dev/nvidia*
                    descriptors and mappings it inherited, right after the fork (`forks`).
  compile pool      torch.compile's worker pool is shut down once compilation has been idle for
                    COMPILE_IDLE_STEPS_ENV optimizer steps, or at the take (`compile_pool`).
With DROP_GRADS_ENV=1 the hold also drops the gradients of the optimizer that just stepped
(`p.grad = None`, what `zero_grad(set_to_none=True)` does before the next backward), so they are
neither copied off the GPU nor written into the image: 4 bytes per fp32 parameter. Off by
default: a trainer that reads `.grad` between `optimizer.step()` and its next backward (a
gradient norm logged after the step, accumulation across optimizer steps) must leave it off.
The status answer says both (GPU_HANDLES_DROPPED, COMPILE_POOL), which is how the executor's
preflight knows that the hook is there.

When the trainer imports torch.distributed, its gloo and nccl groups and their store are made
releasable (`groups`, off with GROUPS_ENV=0): the hold releases them, the release rebuilds them
(at the rendezvous the release names, RENDEZVOUS_WORD), and the status answer lists them (GROUPS).
"""

from __future__ import annotations

import os
import sys
import threading

from ..protocol import socket_path
from . import forks
from .env import groups_on, resolving
from .groups import DIST_MODULE, InstallOnImport, install_on
from .point import TakePoint
from .server import OPTIMIZER_MODULE, RegisterOnImport, serve

__all__ = ["start"]


def start(take_dir: str) -> None:
    """The take point in this process: its socket in `take_dir`, the step hook registered now or
    when torch's optimizers are imported, the fork handler when it resolves the blockers."""
    os.makedirs(take_dir, mode=0o700, exist_ok=True)
    point = TakePoint(resolve=resolving())
    if point.resolve:
        forks.install()
    if OPTIMIZER_MODULE in sys.modules:
        sys.modules[OPTIMIZER_MODULE].register_optimizer_step_post_hook(point.at_step_end)
        point.trainer = True
    else:
        sys.meta_path.insert(0, RegisterOnImport(point))
    if groups_on():
        if DIST_MODULE in sys.modules:
            install_on(sys.modules[DIST_MODULE])
        else:
            sys.meta_path.insert(0, InstallOnImport())
    threading.Thread(target=serve, args=(socket_path(take_dir, os.getpid()), point),
                     name="snapguard-take-point", daemon=True).start()
