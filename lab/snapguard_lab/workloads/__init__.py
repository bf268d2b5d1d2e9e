"""The lab's example workloads, shipped as package data beside this module:

  counter/counter.sh  the CPU workload of the container drill (a counter and a hash chain)
  torch/train.py      the deterministic GPT trainer of the torch drill
  ddp/launch.py       a gloo job of ddp/train.py ranks, for coordinated snapshots of several processes

They run as scripts (busybox sh in an image, or the interpreter given a path), so `path` hands out
real files: the lab is installed as a directory (a wheel or an editable install), never zipped.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

__all__ = ["path"]


def path(*parts: str) -> Path:
    """The file or directory `parts` below the workloads, as a real, absolute filesystem path."""
    found = files(__name__)
    for part in parts:
        found = found / part
    if not isinstance(found, os.PathLike):
        raise RuntimeError(f"snapguard_lab's workloads are not on the filesystem ({found!r}): install "
                           "snapguard-lab as a directory, not zipped")
    real = Path(os.fspath(found)).resolve()
    if not real.exists():
        raise FileNotFoundError(f"workload file {real} is missing: reinstall snapguard-lab")
    return real
