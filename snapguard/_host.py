"""Facts about this host that decide whether an image can run here.

The procfs root is swappable so that parsing is tested against fixture trees.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["cpu_info", "host_facts", "mem_available_bytes", "process_state"]

PROC = "/proc"


def cpu_info(proc: str = PROC) -> dict[str, Any]:
    """CPU model and the flags every CPU has (the intersection: flags can differ per core)."""
    model = ""
    flag_sets: list[set[str]] = []
    with open(os.path.join(proc, "cpuinfo")) as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags":
                flag_sets.append(set(value.split()))
    flags = set.intersection(*flag_sets) if flag_sets else set()
    return {"model": model, "flags": sorted(flags)}


def mem_available_bytes(proc: str = PROC) -> int:
    with open(os.path.join(proc, "meminfo")) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("MemAvailable missing from meminfo")


def host_facts(proc: str = PROC) -> dict[str, Any]:
    uname = os.uname()
    return {
        "hostname": uname.nodename,
        "kernel": uname.release,
        "arch": uname.machine,
        "cpu": cpu_info(proc),
    }


def process_state(pid: int, proc: str = PROC) -> str:
    """The state letter of /proc/PID/stat (R, S, Z...), or "gone"."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            # comm, in parentheses, may itself contain spaces and parentheses
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
