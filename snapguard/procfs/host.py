"""This host as procfs tells it: the CPU, available memory, the boot id."""

from __future__ import annotations

import os
from typing import Any

from ._root import read, root as _root, vanishing

__all__ = ["boot_id", "cpu_info", "host_facts", "mem_available_bytes"]


def cpu_info(proc: str | None = None) -> dict[str, Any]:
    """CPU model and the flags every CPU has (the intersection: flags can differ per core)."""
    model = ""
    flag_sets: list[set[str]] = []
    with open(os.path.join(_root(proc), "cpuinfo")) as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags":
                flag_sets.append(set(value.split()))
    flags = set.intersection(*flag_sets) if flag_sets else set()
    return {"model": model, "flags": sorted(flags)}


def mem_available_bytes(proc: str | None = None) -> int:
    with open(os.path.join(_root(proc), "meminfo")) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("MemAvailable missing from meminfo")


def host_facts(proc: str | None = None) -> dict[str, Any]:
    uname = os.uname()
    return {"hostname": uname.nodename, "kernel": uname.release, "arch": uname.machine, "cpu": cpu_info(proc)}



def boot_id(proc: str | None = None) -> str | None:
    """The kernel's boot id (sys/kernel/random/boot_id): a new one after every boot; None when
    it cannot be read."""
    text = vanishing(lambda: read(os.path.join(_root(proc), "sys/kernel/random/boot_id")), None)
    return text.strip() if text else None
