"""The torch drill's arms, apart from the drill itself: the CLI lists and checks them without
importing the drill (and the snapshot pipeline behind it)."""

from __future__ import annotations

__all__ = ["DEFAULT_TORCH_ARMS", "GOODPUT_ARMS", "TORCH_ARMS", "TORCH_ARM_SETS"]

TORCH_ARMS = ("snapshots", "expandable", "file", "container", "compile")
DEFAULT_TORCH_ARMS = ("snapshots", "file", "container")

# `--arms goodput`: the goodput drill (goodput.py) instead of the arms above; its own arms, A to D
TORCH_ARM_SETS = ("goodput",)
GOODPUT_ARMS = ("A", "B", "C", "D")
