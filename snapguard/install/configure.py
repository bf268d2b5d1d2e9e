"""plan_install(): what installing snapguard on this node changes, computed whole, nothing written.

In order: which containerd and which config version; containerd's default runtime as it loads
its config today; the drop-in and the main config's import; snapguard's own config; the launcher
and its pinned file. The state records what each file will be, for a second run and --uninstall.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from .. import __version__
from ..reasons import Reason
from ..trust import UntrustedPathError, resolve_trusted
from .base import fail, parse_toml, read_trusted
from .changes import Plan
from .config_file import plan_config
from .containerd import CRI_PLUGINS, containerd_version, find_containerd
from .dropin import Containerd, default_runtime, plan_dropin, plan_main_imports, verify_dropin
from .launcher import plan_launcher, plan_pin
from .options import Options
from .state import load_state
from .store_env import plan_store_env

__all__ = ["plan_install"]


def _check_options(opts: Options) -> None:
    name = opts.runtime_name
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
        raise fail(f"--runtime-name {name!r}: a RuntimeClass handler is a DNS label (a-z, 0-9, -)")
    for what, path in (("--containerd-config", opts.containerd_config), ("--config", opts.snapguard_config),
                       ("--state-file", opts.state_file), ("--dropin-dir", opts.dropin_dir or "/")):
        if not os.path.isabs(path):
            raise fail(f"{what} must be an absolute path, got {path!r}")


def _containerd(opts: Options, plan: Plan) -> Containerd:
    """Which containerd, which config version: the main config's, else the binary's."""
    facts = plan.facts
    main_path = os.path.normpath(opts.containerd_config)
    binary = find_containerd(opts.containerd)
    found = containerd_version(binary) if binary else None
    facts["containerd"] = binary
    facts["containerd_version"] = found[0] if found else None
    major = found[1] if found else None
    main_raw = read_trusted(main_path, "containerd's config")
    main = parse_toml(main_raw, main_path) if main_raw is not None else {}
    if main_raw is not None and "version" in main:
        version = main["version"]
        if version not in CRI_PLUGINS:
            raise fail(f"{main_path} has config version {version!r}; snapguard install writes versions 2 and 3")
        facts["config_version_from"] = main_path
    elif main_raw is not None:
        raise fail(f"{main_path} sets no `version`, so containerd reads it as version 1, which snapguard install "
                   "does not write: set `version = 2` (containerd 1.x; 2.x: `containerd config migrate`) and run again")
    elif major is None:
        raise fail(f"no {main_path} and no containerd binary to tell the config version: pass --containerd")
    else:
        version = 3 if major >= 2 else 2
        facts["config_version_from"] = f"containerd {facts['containerd_version']}"
    if major is not None and major < 2 and version == 3:
        plan.notes.append(f"containerd {facts['containerd_version']} cannot read config version 3")
    facts["config_version"] = version
    replace_plugins = major is None or major < 2  # containerd 1.x replaces whole plugin tables
    facts["dropin_copies_cri_settings"] = replace_plugins
    return Containerd(main_path, main_raw, main, version, CRI_PLUGINS[version], replace_plugins,
                      os.path.normpath(opts.dropin_path))


def _snapguard_runc(opts: Options) -> str:
    path = opts.snapguard_runc or os.path.join(os.path.dirname(sys.executable), "snapguard-runc")
    try:
        return resolve_trusted(path, "exec")
    except UntrustedPathError as e:
        raise fail(f"snapguard-runc {e}: containerd's shim runs it as root, so it must be root's alone "
                   "(install snapguard as root, e.g. the Debian package, or pass --snapguard-runc)",
                   Reason.UNTRUSTED_PATH if not e.unusable else Reason.USAGE_ERROR) from None


def plan_install(opts: Options) -> Plan:
    """What installing on this node changes, every file's bytes computed; nothing is written."""
    _check_options(opts)
    name = opts.runtime_name
    state = load_state(opts.state_file)
    if state.get("runtime_name") not in (None, name):
        raise fail(f"snapguard install ran here with runtime `{state['runtime_name']}`: "
                   "run `snapguard install --uninstall` first to change the name")
    records: dict[str, Any] = dict(state.get("files", {}))
    plan = Plan("install", state_file=opts.state_file, runtime_name=name)
    cd = _containerd(opts, plan)
    rt = default_runtime(cd, name, plan)

    snapguard_runc = _snapguard_runc(opts)
    launcher = plan_launcher(opts, snapguard_runc, records, plan)
    binary_name = launcher.path if launcher is not None else snapguard_runc
    plan.facts["binary_name"] = binary_name
    plan.facts["launcher"] = launcher.path if launcher is not None else None
    data = plan_dropin(cd, rt, name, binary_name, records, plan)
    main_after = plan_main_imports(cd, records, plan)
    verify_dropin(cd, main_after, data, name, binary_name)
    plan_store_env(opts.store, opts.systemd_dir, name, records, plan)  # containerd's SNAPGUARD_STORE

    # snapguard's own config, then the launcher and its pinned file (read from the config as written)
    ours_binaries = [snapguard_runc] + ([launcher.path] if launcher is not None else [])
    config_change = plan_config(opts, records, plan.facts, rt.nvidia, rt.binary, ours_binaries, plan)
    plan.changes.append(config_change)
    if launcher is not None:
        plan.changes.append(launcher)
        plan.changes.append(plan_pin(opts, config_change, snapguard_runc, records, plan))
    plan.state = {"snapguard": __version__, "runtime_name": name, "files": records}
    return plan
