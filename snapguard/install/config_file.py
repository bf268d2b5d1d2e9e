"""snapguard's own config as install writes it: the pinned paths found on this node.

Keys the file already sets are kept, except `runc` where containerd's default runtime is NVIDIA's;
each line carries its key's comment from the table of keys (snapguard.config.keys).
"""

from __future__ import annotations

import os
from typing import Any

from ..config import DEFAULTS, SWITCH_OVERRIDES, TEXT_OVERRIDES
from ..config.keys import KEYS
from ..trust import UntrustedPathError, check_trusted_libdir, resolve_trusted
from .base import absent_dirs, fail, parse_toml, read_trusted, sha
from .changes import Change, Plan
from .launcher import LAUNCHER_NAME
from .options import CANDIDATES, Options
from .toml import toml_value

__all__ = ["CANDIDATES", "UNWRITTEN_DEFAULTS", "plan_config", "render_config", "trusted_path"]

# every on/off switch and the agent's strings: at its default it is left out of the config written
# (see plan_config)
UNWRITTEN_DEFAULTS = tuple(SWITCH_OVERRIDES) + tuple(TEXT_OVERRIDES)
# snapguard's own entries: never taken for the real runc
_OURS = ("snapguard-runc", LAUNCHER_NAME)


def trusted_path(key: str, path: str) -> str | None:
    """The canonical path of a pinned binary or libdir root alone controls, else None."""
    try:
        if key == "criu_libdir":
            return check_trusted_libdir(path)
        return resolve_trusted(path, "exec")
    except UntrustedPathError:
        return None


def render_config(values: dict[str, Any]) -> bytes:
    """snapguard's config as install writes it: each key set, with its comment from the table."""
    lines = ["# snapguard's pinned paths (written by `snapguard install`; keys set here are kept when it",
             "# runs again, except `runc` where containerd's default runtime is NVIDIA's). Each binary must be",
             "# root-owned and writable by root alone; nothing is looked up in PATH."]
    for key in KEYS:
        if key.name in values:
            lines.append(f"{key.name} = {toml_value(values[key.name])}  # {key.comment}")
    return ("\n".join(lines) + "\n").encode()


def plan_config(opts: Options, records: dict[str, Any], facts: dict[str, Any], nvidia: bool,
                 default_binary: str, ours: list[str], plan: Plan) -> Change:
    """The Change of snapguard's config: each key kept from the file, found on the node, or its default."""
    path = os.path.normpath(opts.snapguard_config)
    before = read_trusted(path, "snapguard's config")
    existing = parse_toml(before, path) if before is not None else {}
    unknown = sorted(set(existing) - set(DEFAULTS))
    if unknown:
        raise fail(f"{path}: unknown key(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, default in DEFAULTS.items():
        if key in existing:
            values[key], sources[key] = existing[key], f"kept from {path}"
            continue
        found = None
        if key == "runc" and os.path.isabs(default_binary) \
                and os.path.basename(default_binary) not in _OURS \
                and os.path.realpath(default_binary) not in {os.path.realpath(p) for p in ours}:
            found = trusted_path(key, default_binary)
        for candidate in opts.candidates.get(key, ()):
            found = found or trusted_path(key, candidate)
        if found:
            values[key], sources[key] = found, "found"
        else:
            values[key], sources[key] = default, "default" if key not in CANDIDATES else "not found: the default"
    if nvidia:
        nv = trusted_path("runc", default_binary)
        if nv is None:
            plan.notes.append(f"containerd's default runtime is {default_binary}, missing or not root's alone: "
                              "snapguard's `runc` is not pointed at it")
        else:
            if values["runc"] != nv and sources["runc"].startswith("kept"):
                plan.notes.append(f"`runc` {values['runc']} replaced by NVIDIA's {nv}, containerd's default runtime, "
                                  "so GPU containers keep their devices")
            values["runc"], sources["runc"] = nv, "containerd's default runtime (NVIDIA's)"
    facts["config"] = {k: {"value": values[k], "source": sources[k]} for k in DEFAULTS}
    # a switch at its default is left out unless the site set it: a config from an older install
    # stays as it was, and an older snapguard (which refuses keys it does not know) can still read it
    written = {k: v for k, v in values.items() if k in existing or k not in UNWRITTEN_DEFAULTS}
    text = render_config(written)
    if before is not None and existing == written:
        text = before  # the same settings: the file stays as it is, comments and all
    rec = records.get(path)
    if rec is None:
        dirs = [d for d in absent_dirs(os.path.dirname(path)) if d not in plan.dirs]
        plan.dirs += dirs
        rec = {"kind": "config", "previous": before.decode("utf-8", "surrogateescape") if before is not None else None,
               "created_dirs": dirs}
    rec["sha256"] = sha(text)
    records[path] = rec
    action = "unchanged" if before == text else "create" if before is None else "replace"
    summary = ", ".join(f"{k} {values[k]}" for k in ("runc", "criu", "criu_libdir", "cuda_checkpoint"))
    return Change(path, action, before, text, mode=0o644, summary=summary)
