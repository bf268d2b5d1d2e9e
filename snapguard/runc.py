"""The real runc, as snapguard asks it things: `runc state` of a container, under a deadline."""

from __future__ import annotations

import json
import re
from typing import Any

from .children import run_captured
from .reasons import Reason, SnapguardError

__all__ = ["CRIU_BY_PATH", "state", "version"]

CRIU_BY_PATH = (1, 2, 0)  # from this runc on, CRIU is found through PATH only; `--criu` is ignored (1.4: refused)


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


_VERSION = re.compile(r"^runc version (\d+)\.(\d+)\.(\d+)", re.M)


def version(runc: str, state_dir: str | None = None) -> tuple[int, int, int]:
    """The real runc's version, read once per binary (cached in the state dir under its inode,
    size and mtime): runc 1.2 and newer find CRIU only through PATH and ignore `--criu` (1.4
    rejects it), so what snapguard tells runc depends on it. (0, 0, 0) when runc does not say."""
    import hashlib
    import json
    import os

    from .files import ensure_private_dir, write_private_json
    from .trust import UntrustedPathError

    try:
        st = os.stat(runc)
    except OSError:
        return (0, 0, 0)
    key = hashlib.sha256(f"{runc}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    cache = os.path.join(state_dir, "runc-version.json") if state_dir else None
    if cache:
        try:
            fd = os.open(cache, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd) as f:
                known = json.loads(f.read(4096))
            if known.get("key") == key and len(known.get("version", [])) == 3:
                return tuple(int(v) for v in known["version"])  # type: ignore[return-value]
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    out = run_captured([runc, "--version"], timeout_s=10, what="runc --version", reason=Reason.RUNC_TIMEOUT,
                       start_reason=Reason.RUNC_UNUSABLE)
    m = _VERSION.search(out.stdout)
    found = (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (0, 0, 0)
    if cache and m:
        try:
            ensure_private_dir(state_dir)  # type: ignore[arg-type]
            write_private_json(cache, {"key": key, "version": list(found)})
        except (OSError, UntrustedPathError):
            pass  # an unwritable cache only costs the next call a `runc --version`
    return found
