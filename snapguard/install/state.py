"""What `snapguard install` wrote, recorded in its root-only state file, and its undoing.

The state file (/var/lib/snapguard/install.json, 0600) records every file install wrote, with its
digest, the directories it created and the config it replaced: `--uninstall` reverses exactly
that, and leaves alone a file someone else changed since.
"""

from __future__ import annotations

import json
from typing import Any

from .base import fail, parse_toml, read_trusted, sha
from .changes import Change, Plan
from .options import Options
from .toml import set_imports

__all__ = ["load_state", "plan_uninstall"]


def load_state(path: str) -> dict[str, Any]:
    """The install state recorded at `path`; empty where install has not run."""
    raw = read_trusted(path, "install state")
    if raw is None:
        return {}
    try:
        state = json.loads(raw)
    except ValueError:
        raise fail(f"the install state {path} is not JSON; move it away to start afresh") from None
    return state if isinstance(state, dict) else {}


def plan_uninstall(opts: Options) -> Plan:
    """The plan that reverses what the state file records (nothing where install has not run)."""
    state = load_state(opts.state_file)
    plan = Plan("uninstall", state_file=opts.state_file, runtime_name=state.get("runtime_name", opts.runtime_name))
    records: dict[str, Any] = state.get("files", {})
    plan.state = None
    if not records:
        plan.notes.append(f"nothing recorded in {opts.state_file}: snapguard install has not run here")
        return plan
    for path, rec in records.items():
        current = read_trusted(path, "file")
        kind = rec.get("kind")
        if kind == "main" and not rec.get("created"):
            if current is None:
                plan.changes.append(Change(path, "keep", None, None, summary="gone"))
                continue
            imports = parse_toml(current, path).get("imports", [])
            if isinstance(imports, list) and rec.get("import") in imports:
                rest = [i for i in imports if i != rec["import"]]
                text = set_imports(current.decode(), None if not rest and rec.get("imports_key_added") else rest)
                plan.changes.append(Change(path, "edit", current, text.encode(), summary=f"imports -= {rec['import']}"))
            else:
                plan.changes.append(Change(path, "keep", current, current, summary="does not import the drop-in"))
            continue
        plan.remove_dirs += rec.get("created_dirs") or []
        if current is None:
            plan.changes.append(Change(path, "keep", None, None, summary="already gone"))
        elif kind == "launcher-pin":  # the config loader rewrites it: ours whatever it holds
            plan.changes.append(Change(path, "remove", current, None))
        elif sha(current) != rec.get("sha256"):
            plan.changes.append(Change(path, "keep", current, current, summary="changed since snapguard install wrote it",
                                       binary=kind == "launcher"))
        elif kind == "config" and rec.get("previous") is not None:
            prev = rec["previous"].encode("utf-8", "surrogateescape")
            plan.changes.append(Change(path, "restore", current, prev, summary="the file it replaced"))
        else:
            plan.changes.append(Change(path, "remove", current, None, binary=kind == "launcher"))
            if kind == "systemd-dropin":  # install.store_env's
                plan.next.append("systemctl daemon-reload  (systemd forgets the removed drop-in)")
    plan.remove_dirs = sorted(set(plan.remove_dirs), key=lambda d: -d.count("/"))
    return plan
