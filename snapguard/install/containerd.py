"""Reading containerd: its binary and version, its config's version, the config it would load.

containerd merges its main config with the files it imports (relative to the importing file, globs
in name order): 1.x replaces a plugin's whole table with a later file's, 2.x merges key by key.
effective() does the same, so that install sees containerd's default runtime as containerd does.
"""

from __future__ import annotations

import copy
import fnmatch
import glob
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Any

from ..reasons import Reason
from ..trust import UntrustedPathError, resolve_trusted
from .base import fail, parse_toml, read_trusted

__all__ = ["CONTAINERD_CANDIDATES", "CRI_PLUGINS", "Effective", "NVIDIA_RUNTIME", "RUNC_SHIM", "containerd_version",
           "effective", "find_containerd", "imports_cover", "resolve_imports"]

CONTAINERD_CANDIDATES = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/usr/sbin/containerd")
# The CRI runtime plugin's table, by config version.
CRI_PLUGINS = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
RUNC_SHIM = "io.containerd.runc.v2"
NVIDIA_RUNTIME = "nvidia-container-runtime"


def _deep_merge(to: dict[str, Any], frm: dict[str, Any]) -> None:
    for k, v in frm.items():
        if isinstance(v, dict) and isinstance(to.get(k), dict):
            _deep_merge(to[k], v)
        else:
            to[k] = copy.deepcopy(v)


def _is_glob(p: str) -> bool:
    return any(c in p for c in "*?[")


def resolve_imports(path: str, imports: list[Any], extra: str | None = None) -> list[str]:
    """containerd's resolveImports: relative to the importing file, globs expanded in name order.
    `extra` is a file about to be written: it is listed where a glob would find it."""
    out: list[str] = []
    for entry in imports:
        if not isinstance(entry, str):
            continue
        p = entry if os.path.isabs(entry) else os.path.join(os.path.dirname(path), entry)
        if _is_glob(p):
            matches = set(glob.glob(p))
            if extra is not None and fnmatch.fnmatchcase(extra, p):
                matches.add(extra)
            out.extend(sorted(matches))
        else:
            out.append(os.path.normpath(p))
    return out


def imports_cover(path: str, imports: list[Any], target: str) -> bool:
    """Whether `imports` of the file at `path` load `target`."""
    return target in resolve_imports(path, imports, extra=target)


@dataclass
class Effective:
    """The config containerd would load: the merged plugin tables and the files, in load order."""

    plugins: dict[str, Any]
    files: list[str]
    missing: list[str]
    sources: dict[str, str]  # plugin -> the last file that set its table


def effective(main_path: str, main: dict[str, Any], replace_plugins: bool, skip: str | None = None,
               extra: tuple[str, dict[str, Any]] | None = None) -> Effective:
    """Merge the main config and its imports as containerd does: 1.x replaces a plugin's whole
    table with a later file's (replace_plugins), 2.x merges them key by key. `skip` is left out
    (the drop-in as it is on disk); `extra` is a file about to be written, with its content."""
    eff = Effective({}, [], [], {})
    pending: list[tuple[str, dict[str, Any] | None]] = [(main_path, main)]
    seen: set[str] = set()
    while pending:
        path, data = pending.pop(0)
        if path in seen:
            continue
        seen.add(path)
        if data is None:
            if extra is not None and path == extra[0]:
                data = extra[1]
            elif path == skip:
                continue
            else:
                raw = read_trusted(path, "containerd import")
                if raw is None:
                    eff.missing.append(path)
                    continue
                data = parse_toml(raw, path)
        eff.files.append(path)
        for name, table in (data.get("plugins") or {}).items():
            if not isinstance(table, dict):
                continue
            if replace_plugins or not isinstance(eff.plugins.get(name), dict):
                eff.plugins[name] = copy.deepcopy(table)
            else:
                _deep_merge(eff.plugins[name], table)
            eff.sources[name] = path
        imports = data.get("imports") or []
        resolved = resolve_imports(path, imports if isinstance(imports, list) else [],
                                    extra[0] if extra is not None else None)
        pending.extend((p, None) for p in resolved)
    return eff


def containerd_version(binary: str) -> tuple[str, int] | None:
    """The version `binary --version` says, and its major; None where it says none."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    # containerd github.com/containerd/containerd 1.6.20~ds1 ...; containerd github.com/containerd/containerd/v2 2.1.9
    m = re.search(r"\bv?(\d+)\.(\d+)\.(\d+)\S*", out.stdout)
    return (m.group(0).lstrip("v"), int(m.group(1))) if out.returncode == 0 and m else None


def find_containerd(given: str | None) -> str | None:
    """The containerd binary, canonical and checked: `given`, else the first of the usual places."""
    for candidate in ([given] if given else list(CONTAINERD_CANDIDATES)):
        try:
            return resolve_trusted(candidate, "exec")
        except UntrustedPathError as e:
            if given and not e.missing:
                raise fail(f"containerd {e}", Reason.UNTRUSTED_PATH if not e.unusable else Reason.USAGE_ERROR) from None
    if given:
        raise fail(f"no containerd at {given}")
    return None
