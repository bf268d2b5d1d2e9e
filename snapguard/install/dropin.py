"""The runtime containerd gets: the drop-in with the CRI runtime, and the main config's import.

The runtime is containerd's default runtime (a runc v2 shim) with `BinaryName` snapguard's, every
other setting kept, as nvidia-ctk derives its runtime from runc's. containerd 1.x replaces a
plugin's whole table with an imported file's, so for it the drop-in carries a copy of the CRI
plugin's settings; 2.x merges tables key by key and gets the runtime alone.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from .. import __version__
from .base import absent_dirs, fail, read_trusted, sha, table
from .changes import Change, Plan
from .containerd import NVIDIA_RUNTIME, RUNC_SHIM, Effective, effective, imports_cover
from .toml import dump_toml, set_imports, toml_value

__all__ = ["POD_ANNOTATIONS", "Containerd", "DefaultRuntime", "default_runtime", "plan_dropin", "plan_main_imports",
           "verify_dropin"]

POD_ANNOTATIONS = "snapguard.io/*"  # passed from pods to the runtime's containers (the agent reads them)


@dataclass
class Containerd:
    """containerd's config as install found it: the main file, its version and how it merges."""

    main_path: str
    main_raw: bytes | None
    main: dict[str, Any]
    version: int
    plugin: str  # the CRI runtime plugin's table
    replace_plugins: bool  # containerd 1.x: an imported file's plugin table replaces the whole table
    dropin: str


@dataclass
class DefaultRuntime:
    """containerd's default runtime as containerd loads its config today (without the drop-in)."""

    eff: Effective
    cri: dict[str, Any]  # the CRI plugin's merged table (a copy)
    runtimes: dict[str, Any]
    name: str
    binary: str
    nvidia: bool
    systemd_cgroup: Any


def default_runtime(cd: Containerd, name: str, plan: Plan) -> DefaultRuntime:
    """containerd's default runtime as it loads its config now; its facts and notes go into `plan`."""
    eff = effective(cd.main_path, cd.main, cd.replace_plugins, skip=cd.dropin)
    plan.notes += [f"containerd's config imports {m}, which does not exist" for m in eff.missing]
    cri = copy.deepcopy(table(eff.plugins, cd.plugin))
    runtimes = table(table(cri, "containerd"), "runtimes")
    default_name = table(cri, "containerd").get("default_runtime_name") or "runc"
    default_opts = table(table(runtimes, default_name), "options")
    binary = default_opts.get("BinaryName") or ""
    binary = binary if isinstance(binary, str) else ""
    rt = DefaultRuntime(eff, cri, runtimes, default_name, binary, os.path.basename(binary).startswith(NVIDIA_RUNTIME),
                        default_opts.get("SystemdCgroup"))
    plan.facts["default_runtime"] = {"name": rt.name, "binary": rt.binary, "nvidia": rt.nvidia,
                                     "systemd_cgroup": rt.systemd_cgroup}
    if default_name == name:
        plan.notes.append(f"containerd's default runtime is `{name}` itself")
    elif name in runtimes and eff.sources.get(cd.plugin) != cd.dropin:
        plan.notes.append(f"runtime `{name}` is already defined in {eff.sources.get(cd.plugin)}; the drop-in's wins")
    return rt


def _runtime(rt: DefaultRuntime, name: str, binary_name: str) -> tuple[dict[str, Any], str | None]:
    """The runtime `name`, and the runtime its settings were copied from.

    The default runtime's settings (runtime_path, sandboxer, options: SystemdCgroup, Root, ...), as
    nvidia-ctk derives its runtime from runc's: only BinaryName differs, so a pod behaves the same
    under either; a default that is no runc shim (kata, say) lends nothing, `runc` then does."""
    base = next((n for n in (rt.name, "runc") if n != name and table(rt.runtimes, n).get("runtime_type")
                 in (RUNC_SHIM, None) and n in rt.runtimes), None)
    ours: dict[str, Any] = copy.deepcopy(table(rt.runtimes, base)) if base else {}
    ours["runtime_type"] = RUNC_SHIM
    ours.setdefault("options", {})
    if not isinstance(ours["options"], dict):
        ours["options"] = {}
    ours["options"]["BinaryName"] = binary_name
    # pod annotations snapguard.io/* reach the containers' OCI specs, where `snapguard agent
    # --containerd` reads which job a container runs (and its file checkpoint)
    given = ours.get("pod_annotations")
    annotations: list[Any] = list(given) if isinstance(given, list) else []
    ours["pod_annotations"] = annotations + ([] if POD_ANNOTATIONS in annotations else [POD_ANNOTATIONS])
    return ours, base


def plan_dropin(cd: Containerd, rt: DefaultRuntime, name: str, binary_name: str, records: dict[str, Any],
                plan: Plan) -> dict[str, Any]:
    """The drop-in's Change (added to `plan`); returns the drop-in's table."""
    ours, base = _runtime(rt, name, binary_name)
    plan.facts["copied_from_runtime"] = base
    if cd.replace_plugins:
        body = rt.cri
        body.setdefault("containerd", {}).setdefault("runtimes", {})[name] = ours
        why = ("# containerd 1.x replaces a plugin's whole table with an imported file's, so this file carries the\n"
               f"# CRI plugin's settings as {rt.eff.sources.get(cd.plugin) or 'the defaults'} gave them when it was "
               "written:\n# after changing them there, run `snapguard install` again.\n")
    else:
        body = {"containerd": {"runtimes": {name: ours}}}
        why = ""
    data = {"version": cd.version, "plugins": {cd.plugin: body}}
    text = (f"# Written by `snapguard install` (snapguard {__version__}); `snapguard install --uninstall` removes\n"
            f"# it. The CRI runtime `{name}`: containerd's runc shim runs snapguard-runc in place of runc;\n"
            f"# a Kubernetes RuntimeClass with handler `{name}` selects it.\n{why}\n" + dump_toml(data)).encode()
    dropin = cd.dropin
    before = read_trusted(dropin, "the drop-in")
    rec = records.get(dropin)
    if before is not None and before != text and (rec is None or rec.get("sha256") != sha(before)):
        raise fail(f"{dropin} exists and was not written by snapguard install (or was changed since): "
                   "move it away and run again")
    summary = f"runtime `{name}`: {RUNC_SHIM}, BinaryName {binary_name}" + (
        f", the rest as `{base}`" if base else "")
    dirs = absent_dirs(os.path.dirname(dropin))
    plan.dirs += dirs
    plan.changes.append(Change(dropin, "unchanged" if before == text else "replace" if before else "create",
                               before, text, summary=summary))
    records[dropin] = {"kind": "dropin", "sha256": sha(text), "created_dirs": (rec or {}).get("created_dirs") or dirs}
    return data


def plan_main_imports(cd: Containerd, records: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The main config's Change: created, or its `imports` given the drop-in; returns it as it
    will read."""
    main_path, main_raw, main, dropin = cd.main_path, cd.main_raw, cd.main, cd.dropin
    if main_raw is None:
        text = f"version = {cd.version}\nimports = {toml_value([dropin])}\n".encode()
        dirs = [d for d in absent_dirs(os.path.dirname(main_path)) if d not in plan.dirs]
        plan.dirs[:0] = dirs
        plan.changes.append(Change(main_path, "create", None, text, summary=f"imports {dropin}"))
        records[main_path] = {"kind": "main", "created": True, "sha256": sha(text), "import": dropin,
                              "created_dirs": dirs}
        return {"version": cd.version, "imports": [dropin]}
    imports = main.get("imports", [])
    if not isinstance(imports, list):
        raise fail(f"{main_path}: `imports` is not a list")
    if imports_cover(main_path, imports, dropin):
        plan.changes.append(Change(main_path, "unchanged", main_raw, main_raw, summary=f"imports {dropin}"))
        return main
    text = set_imports(main_raw.decode(), [*imports, dropin]).encode()
    plan.changes.append(Change(main_path, "edit", main_raw, text, summary=f"imports += {dropin}"))
    records[main_path] = {"kind": "main", "created": False, "import": dropin,
                          "imports_key_added": "imports" not in main}
    return {**main, "imports": [*imports, dropin]}


def verify_dropin(cd: Containerd, main_after: dict[str, Any], data: dict[str, Any], name: str,
                  binary_name: str) -> None:
    """The drop-in must be what containerd ends up with: nothing imported after it may replace it."""
    after = effective(cd.main_path, main_after, cd.replace_plugins, extra=(cd.dropin, data))
    got = table(table(table(table(after.plugins, cd.plugin), "containerd"), "runtimes"), name)
    if cd.dropin not in after.files:
        raise fail(f"internal error: {cd.main_path} would not import {cd.dropin}")
    if table(got, "options").get("BinaryName") != binary_name:
        raise fail(f"{after.sources.get(cd.plugin)} is imported after {cd.dropin} and replaces the CRI plugin's "
                   "settings (containerd 1.x): fold it into the main config, or rename it to load before, and run "
                   "again")
