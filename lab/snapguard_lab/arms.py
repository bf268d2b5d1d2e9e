"""The torch drill's arms, apart from the drill itself: the CLI lists and checks them without
importing the drill (and the snapshot pipeline behind it)."""

from __future__ import annotations

__all__ = ["DEFAULT_TORCH_ARMS", "TORCH_ARMS"]

TORCH_ARMS = ("snapshots", "expandable", "file", "container", "compile")
DEFAULT_TORCH_ARMS = ("snapshots", "file", "container")
