"""The take point: a workload-side hook that brings a PyTorch trainer to a step boundary, moves
its tensors' bytes from the GPU into host memory (back on the release), releases the allocator's
reserve and holds still while a snapshot is taken.

Injected without changing the trainer: start it with PYTHONPATH including `site_dir()` (which
holds a sitecustomize) and TAKE_DIR_ENV set. The package's parts:
  protocol   what both ends share: the socket's path, request words, reply fields, environment
  workload   the trainer's side (`start`): the server, the optimizer's move, the spill, the fork
             handler, the compile pool; it imports nothing of snapguard's but `protocol`
  client     the executor's side: `trainers` finds the hooked processes of a tree, `hold` brings
             them to a step boundary (a `TakeResult`), `release_all` lets them go
  spill      the executor's side of the spill: the trainers' files into the image and back, sweeps

In the trainer the hook also resolves what would put GPU handles outside a CUDA context into its
tree: children forked from a CUDA process drop the /dev/nvidia* descriptors and mappings they
inherited, and torch.compile's worker pool is shut down once compilation is idle (or at the take)
and comes back when something compiles. On by default; RESOLVE_ENV=0 in the trainer's environment
turns both off (the executor then refuses such a tree, as without the hook).

Importing this package loads `protocol` alone: the sitecustomize imports it in every process a
hooked trainer starts.
"""

from __future__ import annotations

import os

from . import protocol
from .protocol import RESOLVE_ENV, SPILL_TMPFS, TAKE_DIR_ENV, socket_path

__all__ = ["RESOLVE_ENV", "SPILL_TMPFS", "TAKE_DIR_ENV", "node_spill_dir", "site_dir", "socket_path", "start"]


def node_spill_dir() -> str:
    """Where this node's take points spill by default, the directory a container's spec binds at
    SPILL_TMPFS for its trainer to spill: SPILL_TMPFS where a tmpfs that every user may write is
    mounted there (`snapguard preflight --node` says whether it has huge pages), else /dev/shm."""
    tmpfs = protocol.SPILL_TMPFS
    return tmpfs if protocol.spill_tmpfs_usable(tmpfs, anyone=True) else protocol.SHM_DIR


def site_dir() -> str:
    """The directory to put first on a trainer's PYTHONPATH: its sitecustomize starts the take point."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


def start(take_dir: str) -> None:
    """The workload side, in this process (the injected sitecustomize calls it in the trainer);
    imported here lazily: the executor side never loads it."""
    from .workload import start as start_workload

    start_workload(take_dir)
