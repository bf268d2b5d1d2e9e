"""The take point: a workload-side hook that brings a PyTorch trainer to a step boundary, moves
its tensors' bytes from the GPU into host memory (back on the release), releases the allocator's
reserve and holds still while a snapshot is taken.

Injected without changing the trainer: start it with PYTHONPATH including `site_dir()` (which
holds a sitecustomize) and SNAPGUARD_TAKE_DIR set. The executor side is `take`: `trainers` finds
the hooked processes of a tree, `hold` brings them to a step boundary, `release_all` lets them go.

In the trainer the hook also resolves what would put GPU handles outside a CUDA context into its
tree: children forked from a CUDA process drop the /dev/nvidia* descriptors and mappings they
inherited, and torch.compile's worker pool is shut down once compilation is idle (or at the take)
and comes back when something compiles. On by default; RESOLVE_ENV=0 in the trainer's environment
turns both off (the executor then refuses such a tree, as without the hook).
"""

from __future__ import annotations

import os

__all__ = ["RESOLVE_ENV", "SPILL_TMPFS", "node_spill_dir", "site_dir", "socket_path", "start_in_workload"]

from ..names import SPILL_TMPFS as SPILL_TMPFS  # where trainers spill by default; a container binds it in

RESOLVE_ENV = "SNAPGUARD_RESOLVE_BLOCKERS"


def node_spill_dir() -> str:
    """Where this node's take points spill by default, the directory a container's spec binds at
    SPILL_TMPFS for its trainer to spill: SPILL_TMPFS where a tmpfs that every user may write is
    mounted there (`snapguard preflight --node` says whether it has huge pages), else /dev/shm."""
    from .. import names
    from ..files import spill_tmpfs_usable

    return names.SPILL_TMPFS if spill_tmpfs_usable(names.SPILL_TMPFS, anyone=True) else "/dev/shm"


def site_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


def socket_path(take_dir: str, pid: int) -> str:
    return os.path.join(take_dir, f"{pid}.sock")


def start_in_workload(take_dir: str) -> None:
    """The workload side: called by the injected sitecustomize inside the trainer (imported here
    lazily: the executor side never loads it)."""
    from ._workload import start

    start(take_dir)
