"""The real runc, as snapguard asks it things: `runc state` of a container, under a deadline."""

from __future__ import annotations

import json
from typing import Any

from .children import run_captured
from .reasons import Reason, SnapguardError

__all__ = ["state"]


def state(runc: str, root: str | None, container_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """`runc [--root R] state ID` as a dict with an int `pid`; CONTAINER_NOT_FOUND otherwise."""
    argv = [runc, *(["--root", root] if root else []), "state", container_id]
    out = run_captured(argv, timeout_s=timeout_s, what="runc state", reason=Reason.RUNC_TIMEOUT)
    evidence = {"container": container_id, "root": root}
    if out.returncode != 0:
        said = out.stderr.strip().splitlines()
        raise SnapguardError(Reason.CONTAINER_NOT_FOUND,
                             f"runc state {container_id}: {said[-1][:300] if said else f'exit {out.returncode}'}",
                             evidence=evidence)
    try:
        found = json.loads(out.stdout)
        found["pid"] = int(found["pid"])
    except (ValueError, KeyError, TypeError):
        raise SnapguardError(Reason.CONTAINER_NOT_FOUND, f"runc state {container_id} printed no pid",
                             evidence=evidence) from None
    return found
