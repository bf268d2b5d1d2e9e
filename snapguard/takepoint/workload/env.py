"""The trainer's environment as the take point reads it: its switches, limits and spill directory
(the variables' names are snapguard.takepoint.protocol's)."""

from __future__ import annotations

import os

from .. import protocol

__all__ = ["DROP_GRADS", "GC_AHEAD", "HOLD_S", "IDLE_STEPS", "groups_on", "offload_device", "offload_on", "resolving", "spill_dir",
           "switch"]


def switch(name: str, default: bool) -> bool:
    """An on/off switch from the trainer's environment: a switch on by default is off only for
    0/false/no/off, one off by default is on only for 1/true/yes/on."""
    value = os.environ.get(name, "").strip().lower()
    return value not in ("0", "false", "no", "off") if default else value in ("1", "true", "yes", "on")


HOLD_S = float(os.environ.get(protocol.HOLD_S_ENV, "300"))  # a hold goes on by itself after this
IDLE_STEPS = int(os.environ.get(protocol.COMPILE_IDLE_STEPS_ENV, "5"))  # idle steps before the pool goes
DROP_GRADS = switch(protocol.DROP_GRADS_ENV, False)
GC_AHEAD = switch(protocol.GC_AHEAD_ENV, True)


def resolving() -> bool:
    """Whether the hook resolves the blockers (the default); RESOLVE_ENV=0 turns it off."""
    return switch(protocol.RESOLVE_ENV, True)


def groups_on() -> bool:
    """Whether the trainer's gloo and nccl groups run on the take point's releasable backend (the
    default); GROUPS_ENV=0 leaves torch.distributed as it is."""
    return switch(protocol.GROUPS_ENV, True)


def offload_on() -> bool:
    return switch(protocol.OFFLOAD_ENV, True)


def spill_dir() -> str | None:
    """Where a spilled arena's file goes: SPILL_DIR_ENV; else protocol.SPILL_TMPFS when a tmpfs is
    mounted there that this process may write (a node that mounted one, huge=within_size: see
    `snapguard preflight --node`); else /dev/shm. None when SPILL_ENV=0: the moved bytes then stay
    in the process, and CRIU writes them."""
    if not switch(protocol.SPILL_ENV, True):
        return None
    chosen = os.environ.get(protocol.SPILL_DIR_ENV, "").strip()
    if chosen:
        # as the executor looks it up: absolute, no link on the way, no trailing slash
        return os.path.realpath(chosen)
    tmpfs = protocol.SPILL_TMPFS
    return tmpfs if protocol.spill_tmpfs_usable(tmpfs) else protocol.SHM_DIR


def offload_device() -> str:
    """The device whose tensors move: "cuda". OFFLOAD_DEVICE_ENV=cpu moves a CPU trainer's
    optimizer tensors instead, which gains nothing (they are host memory already) but runs the
    same copy, mapping, snapshot and reload where there is no GPU: the test suite's way to check
    them through CRIU."""
    return "cpu" if os.environ.get(protocol.OFFLOAD_DEVICE_ENV, "").strip().lower() == "cpu" else "cuda"
