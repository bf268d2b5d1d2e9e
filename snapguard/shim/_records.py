"""snapguard-runc's record of each guarded run, kept in its state directory as well.

The record goes to `<work-path>/snapguard-result.json`, where containerd's shim points the run;
containerd removes that directory with the task's bundle once the container is gone (after a
stopping checkpoint, or a failed restore), and the record with it. So each run's record is also
written to `<state_dir>/runs/<verb>-<container id>.json` (the newest run of that verb for that
container, 0600 in a 0700 directory, the state directory's trust rules), and beyond KEEP files the
oldest are removed: what a run did, its reason and its timings, can be read after the fact.
"""

from __future__ import annotations

import os
from typing import Any

from ..files import ensure_private_dir, write_private_json
from ..trust import UntrustedPathError

__all__ = ["KEEP", "RUNS_DIR", "keep", "kept_path"]

KEEP = 64
RUNS_DIR = "runs"


def kept_path(state_dir: str, verb: str, container_id: str) -> str:
    return os.path.join(state_dir, RUNS_DIR, f"{verb}-{container_id}.json")


def keep(state_dir: str, verb: str, container_id: str, record: dict[str, Any]) -> str | None:
    """Write `record` as the newest of its verb and container; its path, or None where the state
    directory cannot hold it (never raises: the run's own outcome is what counts)."""
    if verb not in ("checkpoint", "restore") or not container_id or "/" in container_id or \
            container_id in (".", ".."):
        return None
    try:
        runs = os.path.join(state_dir, RUNS_DIR)
        if os.path.islink(runs):  # never followed, whoever owns it
            return None
        runs = ensure_private_dir(runs)
        path = os.path.join(runs, f"{verb}-{container_id}.json")
        write_private_json(path, record)
        _prune(runs)
        return path
    except (OSError, UntrustedPathError):
        return None


def _prune(runs: str) -> None:
    entries = []
    with os.scandir(runs) as it:
        for e in it:
            if e.name.endswith(".json") and e.is_file(follow_symlinks=False):
                entries.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name))
    for _, name in sorted(entries)[:-KEEP]:
        try:
            os.unlink(os.path.join(runs, name))
        except FileNotFoundError:
            pass
