"""`snapguard install`: put snapguard on a node, the counterpart of `nvidia-ctk runtime configure`.

What it changes, each file written whole (a temporary file renamed over it), root's, 0644:

- a containerd drop-in, `<conf.d>/99-<name>.toml` beside containerd's main config, that adds the
  CRI runtime `<name>` (default `snapguard`): containerd's default runtime (a runc v2 shim) with
  `BinaryName` = this install's snapguard-runc, every other setting (SystemdCgroup, Root,
  runtime_path, ...) kept, as nvidia-ctk derives its runtime from runc's. A Kubernetes RuntimeClass
  whose `handler` is `<name>` selects it (the manifest is printed).
- the main config's `imports`, where it does not import the drop-in yet (containerd 1.6/1.7 import
  nothing by default, 2.1 neither): the drop-in's path is appended, nothing else changes. A node
  without a main config gets a minimal one (`version` and `imports`).
- /etc/snapguard/config.toml: the pinned paths found on this node (each canonical and checked with
  snapguard.trust); keys the file already sets are kept, except `runc` where containerd's default
  runtime is NVIDIA's (`nvidia-container-runtime`): snapguard-runc then runs that, so GPU containers
  keep their devices (it forwards every verb but `create` to runc).
- snapguard-runc's C launcher (c_helpers/runc_launcher.c), where its source is installed (c_helpers/
  in a source or editable install, snapguard/_c_helpers/ in the wheel and the Debian package; --launcher
  requires it, --no-launcher leaves it out): compiled with the pinned C compiler
  (/usr/bin/cc) into `snapguard-runc-launcher` beside the Python snapguard-runc, root's, 0755, and
  the drop-in's `BinaryName`; it execs runc for every verb but checkpoint and restore without
  starting Python, and the Python snapguard-runc for those two. Beside the config, its pinned file
  (`runc-launcher.pin`: the config's runc, the config file's identity, the Python entry), which the
  config loader keeps in sync with the config. An explicit --snapguard-runc is the BinaryName as
  given, without the launcher.

The config version decides the drop-in's shape: the main config's `version` (2 for containerd 1.6
and 1.7, 3 for 2.x), or without a main config the containerd binary's (1.x: 2, 2.x: 3). The drop-in
always has the main config's version: containerd 2.x migrates the merged config by the last file's
version, so a version 3 drop-in makes it ignore a version 2 main config's CRI settings. containerd
1.x replaces a plugin's whole table with an imported file's, so for it the drop-in carries a copy of
the CRI plugin's settings as the main config and its other imports give them, plus the runtime;
containerd 2.x merges tables key by key and gets the runtime alone.

What it wrote is recorded in a root-only state file (/var/lib/snapguard/install.json): `--uninstall`
reverses exactly that (the drop-in removed, the imports entry taken out, a replaced config put
back), and leaves alone what was changed by someone else since. A second run changes nothing.
`--dry-run` prints the change as a diff and writes nothing.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import __version__
from .config import (DEFAULTS, LAUNCHER_PIN_HEADER, SWITCH_OVERRIDES, ConfigError, _load, launcher_pin_path, pin_stamp,
                     read_launcher_pin, render_launcher_pin)
from .reasons import Reason, SnapguardError
from .trust import UntrustedPathError, check_trusted_libdir, make_private_dir, open_trusted, resolve_trusted

__all__ = ["Options", "Plan", "plan_install", "plan_uninstall", "apply", "runtimeclass_manifest", "dump_toml",
           "set_imports", "DEFAULT_RUNTIME_NAME", "CRI_PLUGINS", "build_launcher", "launcher_source_dir",
           "CompilerMissingError", "DEFAULT_CC", "LAUNCHER_NAME"]

DEFAULT_RUNTIME_NAME = "snapguard"
DEFAULT_CONTAINERD_CONFIG = "/etc/containerd/config.toml"
DEFAULT_SNAPGUARD_CONFIG = "/etc/snapguard/config.toml"
DEFAULT_STATE_FILE = "/var/lib/snapguard/install.json"
CONTAINERD_CANDIDATES = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/usr/sbin/containerd")
# The CRI runtime plugin's table, by config version.
CRI_PLUGINS = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
RUNC_SHIM = "io.containerd.runc.v2"
NVIDIA_RUNTIME = "nvidia-container-runtime"
# Where each pinned path is looked for, first found wins (runc: after containerd's own choice).
CANDIDATES = {
    "runc": ("/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc"),
    "criu": ("/usr/local/sbin/criu", "/usr/sbin/criu", "/usr/local/bin/criu", "/usr/bin/criu"),
    "criu_libdir": ("/usr/local/lib/criu", "/usr/lib/criu", "/usr/lib/x86_64-linux-gnu/criu"),
    "cuda_checkpoint": ("/usr/local/bin/cuda-checkpoint", "/usr/bin/cuda-checkpoint"),
}
CONFIG_COMMENTS = {
    "runc": "the real runc (or NVIDIA's runtime in front of it) every non-snapshot verb goes to",
    "criu": "CRIU >= 4.0",
    "criu_libdir": "CRIU's plugin directory (cuda_plugin.so); every .so in it is loaded as root",
    "cuda_checkpoint": "NVIDIA's cuda-checkpoint; where missing, snapguard-cuda-checkpoint is used",
    "state_dir": "root-only: run directories, the runc path cache",
    "criu_timeout_s": "CRIU's own timeout, seconds",
    "take_wait_s": "how long a snapshot waits for the workload's take point, seconds",
    "cuda_broker": "the executor answers CRIU's CUDA plugin itself while CRIU runs (shorter stall and restore)",
    "hash_while_dumping": "the image's page files are hashed while CRIU writes them (a shorter seal)",
    "restore_prefetch": "a restore has CRIU's files read ahead of the image's digest check (a cold restore)",
}
# every on/off switch: at its default it is left out of the config written (see _plan_config)
UNWRITTEN_DEFAULTS = tuple(SWITCH_OVERRIDES)
MAX_FILE_BYTES = 1 << 20
# snapguard-runc's C launcher: the pinned compiler, the installed name (beside the Python
# snapguard-runc), its sources (c_helpers/), and how it is compiled.
DEFAULT_CC = "/usr/bin/cc"
LAUNCHER_NAME = "snapguard-runc-launcher"
LAUNCHER_SOURCES = ("runc_launcher.c", "runc_argv_table.h")
LAUNCHER_CFLAGS = ("-std=gnu11", "-O2", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong",
                   "-fPIE", "-pie", "-Wl,-z,relro,-z,now", "-s")
# the compiler finds its assembler and linker through PATH: only root's directories
BUILD_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


class InstallError(SnapguardError):
    pass


class CompilerMissingError(InstallError):
    """The pinned C compiler is missing or not executable: the launcher cannot be built."""


POD_ANNOTATIONS = "snapguard.io/*"  # passed from pods to the runtime's containers (the agent reads them)

def _fail(detail: str, reason: Reason = Reason.USAGE_ERROR) -> InstallError:
    return InstallError(reason, detail)


# --- TOML out ------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_str(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v in (float("inf"), float("-inf")):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if hasattr(v, "isoformat"):
        return v.isoformat()
    raise _fail(f"cannot write a TOML value of type {type(v).__name__}")


def dump_toml(data: dict[str, Any]) -> str:
    """TOML text for `data` (scalars of a table before its sub-tables); tomllib reads it back equal."""
    lines: list[str] = []

    def table(path: list[str], d: dict[str, Any]) -> None:
        scalars = [(k, v) for k, v in d.items() if not isinstance(v, dict)]
        tables = [(k, v) for k, v in d.items() if isinstance(v, dict)]
        if path and (scalars or not tables):
            if lines:
                lines.append("")
            lines.append("[" + ".".join(_toml_key(p) for p in path) + "]")
        for k, v in scalars:
            lines.append(f"{'  ' * min(len(path), 1)}{_toml_key(k)} = {_toml_value(v)}")
        for k, v in tables:
            table([*path, k], v)

    table([], data)
    text = "\n".join(lines) + "\n"
    if tomllib.loads(text) != data:
        raise _fail("internal error: the TOML written does not read back equal")
    return text


# --- reading -------------------------------------------------------------------------------------

def _read_trusted(path: str, what: str) -> bytes | None:
    """The bytes of a file root alone controls, None when it does not exist."""
    try:
        fd = open_trusted(path, "file")
    except UntrustedPathError as e:
        if e.missing:
            return None
        raise _fail(f"{what} {e}", Reason.UNTRUSTED_PATH if not e.unusable else Reason.USAGE_ERROR) from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise _fail(f"{what} {path} is larger than {MAX_FILE_BYTES} bytes")
    return raw


def _parse(raw: bytes, path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise _fail(f"{path} is not valid TOML: {' '.join(str(e).split())}") from None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _deep_merge(to: dict[str, Any], frm: dict[str, Any]) -> None:
    for k, v in frm.items():
        if isinstance(v, dict) and isinstance(to.get(k), dict):
            _deep_merge(to[k], v)
        else:
            to[k] = copy.deepcopy(v)


def _is_glob(p: str) -> bool:
    return any(c in p for c in "*?[")


def _resolve_imports(path: str, imports: list[Any], extra: str | None = None) -> list[str]:
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


def _imports_cover(path: str, imports: list[Any], target: str) -> bool:
    return target in _resolve_imports(path, imports, extra=target)


@dataclass
class Effective:
    """The config containerd would load: the merged plugin tables and the files, in load order."""

    plugins: dict[str, Any]
    files: list[str]
    missing: list[str]
    sources: dict[str, str]  # plugin -> the last file that set its table


def _effective(main_path: str, main: dict[str, Any], replace_plugins: bool, skip: str | None = None,
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
                raw = _read_trusted(path, "containerd import")
                if raw is None:
                    eff.missing.append(path)
                    continue
                data = _parse(raw, path)
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
        resolved = _resolve_imports(path, imports if isinstance(imports, list) else [],
                                    extra[0] if extra is not None else None)
        pending.extend((p, None) for p in resolved)
    return eff


# --- the imports line of the main config ---------------------------------------------------------

_HEADER = re.compile(r"^\s*\[")
_IMPORTS_KEY = re.compile(r"""^\s*(imports|"imports"|'imports')\s*=""")
_VERSION_KEY = re.compile(r"""^\s*(version|"version"|'version')\s*=""")


def _loads_ok(text: str) -> bool:
    try:
        tomllib.loads(text)
        return True
    except tomllib.TOMLDecodeError:
        return False


def _top_level_end(lines: list[str]) -> int:
    """Index of the first table header that is not inside a multi-line value."""
    for i, line in enumerate(lines):
        if _HEADER.match(line) and _loads_ok("".join(lines[:i])):
            return i
    return len(lines)


def _key_span(lines: list[str], key: re.Pattern[str], end: int) -> tuple[int, int] | None:
    for i in range(end):
        if key.match(lines[i]) and _loads_ok("".join(lines[:i])):
            for j in range(i + 1, end + 1):
                if _loads_ok("".join(lines[i:j])):
                    return i, j
    return None


def set_imports(text: str, imports: list[str] | None) -> str:
    """`text` with its top-level `imports` set to `imports` (None: the key removed), every other
    line as it was; checked by reading both back."""
    before = tomllib.loads(text)
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    end = _top_level_end(lines)
    span = _key_span(lines, _IMPORTS_KEY, end)
    new = [] if imports is None else [f"imports = {_toml_value(imports)}\n"]
    if span is not None:
        lines[span[0]:span[1]] = new
    elif new:
        version = _key_span(lines, _VERSION_KEY, end)
        at = version[1] if version is not None else 0
        lines[at:at] = new
    out = "".join(lines)
    expected = dict(before)
    if imports is None:
        expected.pop("imports", None)
    else:
        expected["imports"] = imports
    if tomllib.loads(out) != expected:
        raise _fail("cannot edit `imports` of containerd's config in place; add the drop-in to it by hand")
    return out


# --- the plan ------------------------------------------------------------------------------------

@dataclass
class Options:
    containerd_config: str = DEFAULT_CONTAINERD_CONFIG
    dropin_dir: str | None = None  # default: conf.d beside the main config
    snapguard_config: str = DEFAULT_SNAPGUARD_CONFIG
    state_file: str = DEFAULT_STATE_FILE
    runtime_name: str = DEFAULT_RUNTIME_NAME
    containerd: str | None = None  # the containerd binary, for its version
    snapguard_runc: str | None = None  # default: beside this interpreter
    # the C launcher: None builds it where its source is found unless snapguard_runc is given
    # (then BinaryName is that, as given); True requires it, False leaves it out
    launcher: bool | None = None
    launcher_path: str | None = None  # default: snapguard-runc-launcher beside snapguard-runc
    cc: str = DEFAULT_CC
    candidates: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(CANDIDATES))

    @property
    def dropin_path(self) -> str:
        directory = self.dropin_dir or os.path.join(os.path.dirname(self.containerd_config), "conf.d")
        return os.path.join(directory, f"99-{self.runtime_name}.toml")


@dataclass
class Change:
    path: str
    action: str  # create, replace, edit, remove, restore, unchanged, keep
    before: bytes | None
    after: bytes | None
    mode: int = 0o644
    summary: str = ""
    binary: bool = False
    render: Callable[[], bytes] | None = None  # the bytes, computed when applied (after the changes before it)

    @property
    def changes(self) -> bool:
        return self.action not in ("unchanged", "keep")

    def diff(self) -> str:
        if self.binary:
            size = "removed" if self.after is None else f"{len(self.after)} bytes"
            return f"binary {self.path}: {size}\n"
        a = (self.before or b"").decode("utf-8", "replace").splitlines(keepends=True)
        b = (self.after or b"").decode("utf-8", "replace").splitlines(keepends=True)
        text = "".join(difflib.unified_diff(a, b, self.path if self.before is not None else "/dev/null",
                                            self.path if self.after is not None else "/dev/null"))
        return text if text.endswith("\n") or not text else text + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "action": self.action, "summary": self.summary,
                "diff": self.diff() if self.changes else ""}


@dataclass
class Plan:
    operation: str  # install, uninstall
    changes: list[Change] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    state: dict[str, Any] | None = None  # what the state file holds after apply (None: remove it)
    state_file: str = DEFAULT_STATE_FILE
    dirs: list[str] = field(default_factory=list)  # directories apply creates (install)
    remove_dirs: list[str] = field(default_factory=list)  # directories uninstall removes when empty
    runtime_name: str = DEFAULT_RUNTIME_NAME

    @property
    def changed(self) -> bool:
        return any(c.changes for c in self.changes)

    def to_dict(self) -> dict[str, Any]:
        out = {"operation": self.operation, "changed": self.changed, "facts": self.facts, "notes": self.notes,
               "changes": [c.to_dict() for c in self.changes]}
        if self.operation == "install":
            out["runtimeclass"] = runtimeclass_manifest(self.runtime_name)
        return out

    def to_text(self, dry_run: bool) -> str:
        out = []
        f = self.facts
        if self.operation == "install":
            where = f" ({f['containerd']})" if f.get("containerd") else ""
            out.append(f"snapguard install: containerd {f.get('containerd_version') or '(binary not found)'}{where}, "
                       f"config version {f['config_version']} (from {f['config_version_from']})")
            rt = f["default_runtime"]
            out.append(f"  default runtime `{rt['name']}`: BinaryName {rt['binary'] or '(runc from PATH)'}"
                       f"{' (NVIDIA)' if rt['nvidia'] else ''}, SystemdCgroup "
                       f"{'not set' if rt['systemd_cgroup'] is None else str(rt['systemd_cgroup']).lower()}")
        else:
            out.append("snapguard install --uninstall:")
        for c in self.changes:
            verb = f"would {c.action}" if dry_run and c.changes else c.action
            out.append(f"  {verb:<14} {c.path}{'  (' + c.summary + ')' if c.summary else ''}")
        out += [f"  note: {n}" for n in self.notes]
        if dry_run:
            out += [c.diff().rstrip("\n") for c in self.changes if c.changes]
        if not self.changed:
            out.append("nothing to change")
        elif dry_run:
            out.append("nothing written (--dry-run)")
        else:
            out.append("restart containerd to load it: systemctl restart containerd")
        if self.operation == "install":
            out.append("RuntimeClass (kubectl apply -f -):")
            out.append(runtimeclass_manifest(self.runtime_name).rstrip("\n"))
        return "\n".join(out) + "\n"


def runtimeclass_manifest(name: str = DEFAULT_RUNTIME_NAME) -> str:
    """The Kubernetes RuntimeClass that selects the drop-in's runtime: its handler is the name."""
    return ("apiVersion: node.k8s.io/v1\n"
            "kind: RuntimeClass\n"
            "metadata:\n"
            f"  name: {name}\n"
            f"handler: {name}  # the containerd runtime `snapguard install` adds\n")


def _containerd_version(binary: str) -> tuple[str, int] | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    # containerd github.com/containerd/containerd 1.6.20~ds1 ...; containerd github.com/containerd/containerd/v2 2.1.9
    m = re.search(r"\bv?(\d+)\.(\d+)\.(\d+)\S*", out.stdout)
    return (m.group(0).lstrip("v"), int(m.group(1))) if out.returncode == 0 and m else None


def _find_containerd(opts: Options) -> str | None:
    for candidate in ([opts.containerd] if opts.containerd else list(CONTAINERD_CANDIDATES)):
        try:
            return resolve_trusted(candidate, "exec")
        except UntrustedPathError as e:
            if opts.containerd and not e.missing:
                raise _fail(f"containerd {e}", Reason.UNTRUSTED_PATH if not e.unusable else Reason.USAGE_ERROR) from None
    if opts.containerd:
        raise _fail(f"no containerd at {opts.containerd}")
    return None


def _snapguard_runc(opts: Options) -> str:
    path = opts.snapguard_runc or os.path.join(os.path.dirname(sys.executable), "snapguard-runc")
    try:
        return resolve_trusted(path, "exec")
    except UntrustedPathError as e:
        raise _fail(f"snapguard-runc {e}: containerd's shim runs it as root, so it must be root's alone "
                    "(install snapguard as root, e.g. the Debian package, or pass --snapguard-runc)",
                    Reason.UNTRUSTED_PATH if not e.unusable else Reason.USAGE_ERROR) from None


def launcher_source_dir() -> str | None:
    """Where the launcher's C source is: snapguard/_c_helpers/ (a built package: setup.py copies it
    there), or c_helpers/ beside the package (a source or editable install)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for directory in (os.path.join(here, "_c_helpers"), os.path.join(os.path.dirname(here), "c_helpers")):
        if all(os.path.isfile(os.path.join(directory, name)) for name in LAUNCHER_SOURCES):
            return directory
    return None


def _c_literal(text: str) -> str:
    """`text` as a C string literal, every byte but [A-Za-z0-9/._+-] escaped."""
    safe = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._+-"
    return '"' + "".join(chr(b) if b in safe else f"\\{b:03o}" for b in os.fsencode(text)) + '"'


def build_launcher(config_path: str, *, cc: str = DEFAULT_CC, route_test: bool = False,
                   source_dir: str | None = None) -> bytes:
    """The launcher compiled for `config_path` (its pinned file beside it), as bytes.

    The compiler is the pinned `cc`, run by the canonical path that was checked, with a PATH of
    root's directories only; the sources are read through checked descriptors into a private
    directory and compiled there. `route_test` builds the program that prints the route for its
    argv (the tests hold it to the Python parser).
    """
    if not os.path.isabs(config_path):
        raise _fail(f"the launcher's config must be an absolute path, got {config_path!r}")
    source_dir = source_dir or launcher_source_dir()
    if source_dir is None:
        raise _fail("the launcher's C source (c_helpers/runc_launcher.c) is not installed with snapguard")
    try:
        compiler = resolve_trusted(cc, "exec")
    except UntrustedPathError as e:
        if e.unusable:
            raise CompilerMissingError(Reason.USAGE_ERROR,
                                       f"no C compiler at {cc} ({e.why}) to build snapguard-runc's launcher: "
                                       "install gcc (apt-get install gcc libc6-dev), or pass --no-launcher "
                                       "(containerd then runs the Python snapguard-runc)") from None
        raise _fail(f"C compiler {e}", Reason.UNTRUSTED_PATH) from None
    work = tempfile.mkdtemp(prefix="snapguard-launcher-")
    try:
        for name in LAUNCHER_SOURCES:
            raw = _read_trusted(os.path.join(source_dir, name), "the launcher's source")
            if raw is None:
                raise _fail(f"the launcher's source {os.path.join(source_dir, name)} is missing")
            with open(os.path.join(work, name), "wb") as f:
                f.write(raw)
        defines = [f"-DSG_CONFIG_PATH={_c_literal(config_path)}",
                   f"-DSG_PIN_PATH={_c_literal(launcher_pin_path(config_path))}"]
        if route_test:
            defines.append("-DSG_ROUTE_TEST")
        argv = [compiler, *LAUNCHER_CFLAGS, *defines, "-o", "launcher", LAUNCHER_SOURCES[0]]
        try:
            out = subprocess.run(argv, cwd=work, env=BUILD_ENV, capture_output=True, text=True, timeout=300,
                                 stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            raise _fail(f"building snapguard-runc's launcher with {compiler}: {e}") from None
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise _fail(f"building snapguard-runc's launcher with {compiler} failed: {last}")
        with open(os.path.join(work, "launcher"), "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _trusted_path(key: str, path: str) -> str | None:
    try:
        if key == "criu_libdir":
            return check_trusted_libdir(path)
        return resolve_trusted(path, "exec")
    except UntrustedPathError:
        return None


def _load_state(path: str) -> dict[str, Any]:
    raw = _read_trusted(path, "install state")
    if raw is None:
        return {}
    try:
        state = json.loads(raw)
    except ValueError:
        raise _fail(f"the install state {path} is not JSON; move it away to start afresh") from None
    return state if isinstance(state, dict) else {}


def _render_config(values: dict[str, Any]) -> bytes:
    lines = ["# snapguard's pinned paths (written by `snapguard install`; keys set here are kept when it",
             "# runs again, except `runc` where containerd's default runtime is NVIDIA's). Each binary must be",
             "# root-owned and writable by root alone; nothing is looked up in PATH."]
    for key in DEFAULTS:
        if key in values:
            lines.append(f"{key} = {_toml_value(values[key])}  # {CONFIG_COMMENTS[key]}")
    return ("\n".join(lines) + "\n").encode()


def _table(d: Any, key: str) -> dict[str, Any]:
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, dict) else {}


def _absent_dirs(path: str) -> list[str]:
    """The directories up to `path` that do not exist yet, outermost first."""
    out: list[str] = []
    while path and path != os.path.dirname(path) and not os.path.isdir(path):
        out.insert(0, path)
        path = os.path.dirname(path)
    return out


def plan_install(opts: Options) -> Plan:
    name = opts.runtime_name
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
        raise _fail(f"--runtime-name {name!r}: a RuntimeClass handler is a DNS label (a-z, 0-9, -)")
    for what, path in (("--containerd-config", opts.containerd_config), ("--config", opts.snapguard_config),
                       ("--state-file", opts.state_file), ("--dropin-dir", opts.dropin_dir or "/")):
        if not os.path.isabs(path):
            raise _fail(f"{what} must be an absolute path, got {path!r}")
    main_path = os.path.normpath(opts.containerd_config)
    dropin = os.path.normpath(opts.dropin_path)
    state = _load_state(opts.state_file)
    if state.get("runtime_name") not in (None, name):
        raise _fail(f"snapguard install ran here with runtime `{state['runtime_name']}`: "
                    "run `snapguard install --uninstall` first to change the name")
    records: dict[str, Any] = dict(state.get("files", {}))
    plan = Plan("install", state_file=opts.state_file, runtime_name=name)
    facts = plan.facts

    # which containerd, which config version
    binary = _find_containerd(opts)
    found = _containerd_version(binary) if binary else None
    facts["containerd"] = binary
    facts["containerd_version"] = found[0] if found else None
    major = found[1] if found else None
    main_raw = _read_trusted(main_path, "containerd's config")
    main = _parse(main_raw, main_path) if main_raw is not None else {}
    if main_raw is not None and "version" in main:
        version = main["version"]
        if version not in CRI_PLUGINS:
            raise _fail(f"{main_path} has config version {version!r}; snapguard install writes versions 2 and 3")
        facts["config_version_from"] = main_path
    elif main_raw is not None:
        raise _fail(f"{main_path} sets no `version`, so containerd reads it as version 1, which snapguard install "
                    "does not write: set `version = 2` (containerd 1.x; 2.x: `containerd config migrate`) and run again")
    elif major is None:
        raise _fail(f"no {main_path} and no containerd binary to tell the config version: pass --containerd")
    else:
        version = 3 if major >= 2 else 2
        facts["config_version_from"] = f"containerd {facts['containerd_version']}"
    if major is not None and major < 2 and version == 3:
        plan.notes.append(f"containerd {facts['containerd_version']} cannot read config version 3")
    facts["config_version"] = version
    plugin = CRI_PLUGINS[version]
    replace_plugins = major is None or major < 2  # containerd 1.x replaces whole plugin tables
    facts["dropin_copies_cri_settings"] = replace_plugins

    # containerd's default runtime, as it loads its config today (without the drop-in)
    eff = _effective(main_path, main, replace_plugins, skip=dropin)
    plan.notes += [f"containerd's config imports {m}, which does not exist" for m in eff.missing]
    cri = copy.deepcopy(_table(eff.plugins, plugin))
    runtimes = _table(_table(cri, "containerd"), "runtimes")
    default_name = _table(cri, "containerd").get("default_runtime_name") or "runc"
    default_opts = _table(_table(runtimes, default_name), "options")
    default_binary = default_opts.get("BinaryName") or ""
    default_binary = default_binary if isinstance(default_binary, str) else ""
    nvidia = os.path.basename(default_binary).startswith(NVIDIA_RUNTIME)
    systemd = default_opts.get("SystemdCgroup")
    facts["default_runtime"] = {"name": default_name, "binary": default_binary, "nvidia": nvidia,
                                "systemd_cgroup": systemd}
    if default_name == name:
        plan.notes.append(f"containerd's default runtime is `{name}` itself")
    elif name in runtimes and eff.sources.get(plugin) != dropin:
        plan.notes.append(f"runtime `{name}` is already defined in {eff.sources.get(plugin)}; the drop-in's wins")

    # the drop-in
    snapguard_runc = _snapguard_runc(opts)
    launcher = _plan_launcher(opts, snapguard_runc, records, plan)
    binary_name = launcher.path if launcher is not None else snapguard_runc
    facts["binary_name"] = binary_name
    facts["launcher"] = launcher.path if launcher is not None else None
    # the default runtime's settings (runtime_path, sandboxer, options: SystemdCgroup, Root, ...), as
    # nvidia-ctk derives its runtime from runc's: only BinaryName differs, so a pod behaves the same
    # under either; a default that is no runc shim (kata, say) lends nothing, `runc` then does
    base = next((n for n in (default_name, "runc") if n != name and _table(runtimes, n).get("runtime_type")
                 in (RUNC_SHIM, None) and n in runtimes), None)
    ours: dict[str, Any] = copy.deepcopy(_table(runtimes, base)) if base else {}
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
    facts["copied_from_runtime"] = base
    if replace_plugins:
        body = cri
        body.setdefault("containerd", {}).setdefault("runtimes", {})[name] = ours
        why = ("# containerd 1.x replaces a plugin's whole table with an imported file's, so this file carries the\n"
               f"# CRI plugin's settings as {eff.sources.get(plugin) or 'the defaults'} gave them when it was written:\n"
               "# after changing them there, run `snapguard install` again.\n")
    else:
        body = {"containerd": {"runtimes": {name: ours}}}
        why = ""
    data = {"version": version, "plugins": {plugin: body}}
    dropin_text = (f"# Written by `snapguard install` (snapguard {__version__}); `snapguard install --uninstall` removes\n"
                   f"# it. The CRI runtime `{name}`: containerd's runc shim runs snapguard-runc in place of runc;\n"
                   f"# a Kubernetes RuntimeClass with handler `{name}` selects it.\n{why}\n" + dump_toml(data)).encode()
    before = _read_trusted(dropin, "the drop-in")
    rec = records.get(dropin)
    if before is not None and before != dropin_text and (rec is None or rec.get("sha256") != _sha(before)):
        raise _fail(f"{dropin} exists and was not written by snapguard install (or was changed since): "
                    "move it away and run again")
    summary = f"runtime `{name}`: {RUNC_SHIM}, BinaryName {binary_name}" + (
        f", the rest as `{base}`" if base else "")
    dirs = _absent_dirs(os.path.dirname(dropin))
    plan.dirs += dirs
    plan.changes.append(Change(dropin, "unchanged" if before == dropin_text else "replace" if before else "create",
                               before, dropin_text, summary=summary))
    records[dropin] = {"kind": "dropin", "sha256": _sha(dropin_text),
                       "created_dirs": (rec or {}).get("created_dirs") or dirs}

    # the main config imports it
    rec = records.get(main_path)
    if main_raw is None:
        main_after = {"version": version, "imports": [dropin]}
        text = f"version = {version}\nimports = {_toml_value([dropin])}\n".encode()
        dirs = [d for d in _absent_dirs(os.path.dirname(main_path)) if d not in plan.dirs]
        plan.dirs[:0] = dirs
        plan.changes.append(Change(main_path, "create", None, text, summary=f"imports {dropin}"))
        records[main_path] = {"kind": "main", "created": True, "sha256": _sha(text), "import": dropin,
                              "created_dirs": dirs}
    else:
        imports = main.get("imports", [])
        if not isinstance(imports, list):
            raise _fail(f"{main_path}: `imports` is not a list")
        if _imports_cover(main_path, imports, dropin):
            main_after = main
            plan.changes.append(Change(main_path, "unchanged", main_raw, main_raw, summary=f"imports {dropin}"))
        else:
            main_after = {**main, "imports": [*imports, dropin]}
            text = set_imports(main_raw.decode(), [*imports, dropin]).encode()
            plan.changes.append(Change(main_path, "edit", main_raw, text, summary=f"imports += {dropin}"))
            records[main_path] = {"kind": "main", "created": False, "import": dropin,
                                  "imports_key_added": "imports" not in main}

    # the drop-in must be what containerd ends up with: nothing imported after it may replace it
    after = _effective(main_path, main_after, replace_plugins, extra=(dropin, data))
    got = _table(_table(_table(_table(after.plugins, plugin), "containerd"), "runtimes"), name)
    if dropin not in after.files:
        raise _fail(f"internal error: {main_path} would not import {dropin}")
    if _table(got, "options").get("BinaryName") != binary_name:
        raise _fail(f"{after.sources.get(plugin)} is imported after {dropin} and replaces the CRI plugin's settings "
                    "(containerd 1.x): fold it into the main config, or rename it to load before, and run again")

    # snapguard's own config, then the launcher and its pinned file (read from the config as written)
    ours_binaries = [snapguard_runc] + ([launcher.path] if launcher is not None else [])
    config_change = _plan_config(opts, records, facts, nvidia, default_binary, ours_binaries, plan)
    plan.changes.append(config_change)
    if launcher is not None:
        plan.changes.append(launcher)
        plan.changes.append(_plan_pin(opts, config_change, snapguard_runc, records, plan))
    plan.state = {"snapguard": __version__, "runtime_name": name, "files": records}
    return plan


def _launcher_wanted(opts: Options) -> bool:
    if opts.launcher is not None:
        return opts.launcher
    # by default, where it can be built: no compiler is a note and the Python entry, not a failure
    # (--launcher demands it, and says what is missing)
    return opts.snapguard_runc is None and launcher_source_dir() is not None and os.path.exists(opts.cc or DEFAULT_CC)


def _plan_launcher(opts: Options, snapguard_runc: str, records: dict[str, Any], plan: Plan) -> Change | None:
    """The launcher's Change (built now, in a private directory), or None without it; without it,
    a launcher and pinned file an earlier install wrote are removed."""
    config_path = os.path.normpath(opts.snapguard_config)
    if not _launcher_wanted(opts):
        if opts.launcher is None and opts.snapguard_runc is None:
            why = ("its source is not installed with snapguard" if launcher_source_dir() is None else
                   f"there is no C compiler at {opts.cc or DEFAULT_CC} (install gcc, or pass --cc)")
            plan.notes.append(f"snapguard-runc's C launcher is not built: {why}, so containerd runs the Python "
                              "snapguard-runc for every verb")
        for path, rec in list(records.items()):
            if rec.get("kind") in ("launcher", "launcher-pin"):
                current = _read_trusted(path, "file")
                if current is not None and (rec["kind"] == "launcher-pin" or _sha(current) == rec.get("sha256")):
                    plan.changes.append(Change(path, "remove", current, None, mode=0o755,
                                               binary=rec["kind"] == "launcher", summary="the launcher is not used"))
                del records[path]
        return None
    path = os.path.normpath(opts.launcher_path or os.path.join(os.path.dirname(snapguard_runc), LAUNCHER_NAME))
    if not os.path.isabs(path):
        raise _fail(f"the launcher's path must be absolute, got {path!r}")
    data = build_launcher(config_path, cc=opts.cc)
    before = _read_trusted(path, "snapguard-runc's launcher")
    rec = records.get(path)
    if before is not None and before != data and (rec is None or rec.get("sha256") != _sha(before)):
        raise _fail(f"{path} exists and was not written by snapguard install (or was changed since): "
                    "move it away and run again")
    dirs = [d for d in _absent_dirs(os.path.dirname(path)) if d not in plan.dirs]
    plan.dirs += dirs
    records[path] = {"kind": "launcher", "sha256": _sha(data), "created_dirs": (rec or {}).get("created_dirs") or dirs}
    action = "unchanged" if before == data else "replace" if before is not None else "create"
    return Change(path, action, before, data, mode=0o755, binary=True,
                  summary=f"snapguard-runc's launcher: runc for every verb but checkpoint and restore, "
                          f"{snapguard_runc} for those")


def _plan_pin(opts: Options, config_change: Change, entry: str, records: dict[str, Any], plan: Plan) -> Change:
    """The launcher's pinned file: the config's runc as the config loader reads it from the file
    written, with that file's identity; computed again when applied, after the config is written."""
    config_path = os.path.normpath(opts.snapguard_config)
    path = launcher_pin_path(config_path)

    def render() -> bytes:
        try:
            config = _load({"SNAPGUARD_CONFIG": config_path}, ("runc",))
        except ConfigError as e:
            raise _fail(f"snapguard's config as written: {e}", Reason[e.reason]) from None
        assert config.source_stat is not None
        try:
            return render_launcher_pin(config_path, pin_stamp(config.source_stat), config.runc, entry)
        except ValueError as e:
            raise _fail(str(e)) from None

    found = read_launcher_pin(path)
    before = found[0] if found is not None else _read_trusted(path, "the launcher's pinned file")
    if before is not None and found is None and path not in records:
        raise _fail(f"{path} exists and was not written by snapguard install: move it away and run again")
    after = render() if config_change.action == "unchanged" else None
    records[path] = {"kind": "launcher-pin"}
    action = "unchanged" if after is not None and before == after else "replace" if before is not None else "create"
    preview = after or (f"{LAUNCHER_PIN_HEADER}\nconfig {config_path}\nstamp (the config file as written)\n"
                        f"runc (its runc)\nentry {entry}\n").encode()
    return Change(path, action, before, preview, mode=0o644, render=None if action == "unchanged" else render,
                  summary="the launcher's pinned file: the config's runc, the Python snapguard-runc")


def _plan_config(opts: Options, records: dict[str, Any], facts: dict[str, Any], nvidia: bool,
                 default_binary: str, ours: list[str], plan: Plan) -> Change:
    path = os.path.normpath(opts.snapguard_config)
    before = _read_trusted(path, "snapguard's config")
    existing = _parse(before, path) if before is not None else {}
    unknown = sorted(set(existing) - set(DEFAULTS))
    if unknown:
        raise _fail(f"{path}: unknown key(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, default in DEFAULTS.items():
        if key in existing:
            values[key], sources[key] = existing[key], f"kept from {path}"
            continue
        found = None
        if key == "runc" and os.path.isabs(default_binary) \
                and os.path.basename(default_binary) not in ("snapguard-runc", LAUNCHER_NAME) \
                and os.path.realpath(default_binary) not in {os.path.realpath(p) for p in ours}:
            found = _trusted_path(key, default_binary)
        for candidate in opts.candidates.get(key, ()):
            found = found or _trusted_path(key, candidate)
        if found:
            values[key], sources[key] = found, "found"
        else:
            values[key], sources[key] = default, "default" if key not in CANDIDATES else "not found: the default"
    if nvidia:
        nv = _trusted_path("runc", default_binary)
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
    text = _render_config(written)
    if before is not None and existing == written:
        text = before  # the same settings: the file stays as it is, comments and all
    rec = records.get(path)
    if rec is None:
        dirs = [d for d in _absent_dirs(os.path.dirname(path)) if d not in plan.dirs]
        plan.dirs += dirs
        rec = {"kind": "config", "previous": before.decode("utf-8", "surrogateescape") if before is not None else None,
               "created_dirs": dirs}
    rec["sha256"] = _sha(text)
    records[path] = rec
    action = "unchanged" if before == text else "create" if before is None else "replace"
    summary = ", ".join(f"{k} {values[k]}" for k in ("runc", "criu", "criu_libdir", "cuda_checkpoint"))
    return Change(path, action, before, text, mode=0o644, summary=summary)


def plan_uninstall(opts: Options) -> Plan:
    state = _load_state(opts.state_file)
    plan = Plan("uninstall", state_file=opts.state_file, runtime_name=state.get("runtime_name", opts.runtime_name))
    records: dict[str, Any] = state.get("files", {})
    plan.state = None
    if not records:
        plan.notes.append(f"nothing recorded in {opts.state_file}: snapguard install has not run here")
        return plan
    for path, rec in records.items():
        current = _read_trusted(path, "file")
        kind = rec.get("kind")
        if kind == "main" and not rec.get("created"):
            if current is None:
                plan.changes.append(Change(path, "keep", None, None, summary="gone"))
                continue
            imports = _parse(current, path).get("imports", [])
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
        elif _sha(current) != rec.get("sha256"):
            plan.changes.append(Change(path, "keep", current, current, summary="changed since snapguard install wrote it",
                                       binary=kind == "launcher"))
        elif kind == "config" and rec.get("previous") is not None:
            prev = rec["previous"].encode("utf-8", "surrogateescape")
            plan.changes.append(Change(path, "restore", current, prev, summary="the file it replaced"))
        else:
            plan.changes.append(Change(path, "remove", current, None, binary=kind == "launcher"))
    plan.remove_dirs = sorted(set(plan.remove_dirs), key=lambda d: -d.count("/"))
    return plan


# --- applying ------------------------------------------------------------------------------------

def _write_atomic(path: str, data: bytes, mode: int) -> None:
    """Whole or not at all: a temporary file beside it, root's, `mode`, fsynced, renamed over it."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
            if os.geteuid() == 0:
                os.fchown(f.fileno(), 0, 0)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _check_dir(path: str) -> None:
    """A directory snapguard writes a root-only decision into must itself be root's alone."""
    try:
        resolve_trusted(path, "dir")
    except UntrustedPathError as e:
        raise _fail(f"{e}", Reason.UNTRUSTED_PATH if not e.unusable else Reason.USAGE_ERROR) from None


def apply(plan: Plan) -> None:
    if os.geteuid() != 0:
        raise _fail("snapguard install writes root's files: run it as root (or with --dry-run)",
                    Reason.INSUFFICIENT_PRIVILEGE)
    for d in plan.dirs:
        os.makedirs(d, mode=0o755, exist_ok=True)
        os.chmod(d, 0o755)
    for c in plan.changes:
        if not c.changes:
            continue
        _check_dir(os.path.dirname(c.path))
        if c.render is not None:
            c.after = c.render()
        if c.after is None:
            os.unlink(c.path)
        else:
            _write_atomic(c.path, c.after, c.mode)
    for d in plan.remove_dirs:
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty: someone else's files are there
    if plan.state is not None:
        directory = make_private_dir(os.path.dirname(plan.state_file))
        data = (json.dumps(plan.state, indent=2, sort_keys=True) + "\n").encode()
        if _read_trusted(plan.state_file, "install state") != data:
            _write_atomic(os.path.join(directory, os.path.basename(plan.state_file)), data, 0o600)
    elif os.path.exists(plan.state_file):
        os.unlink(plan.state_file)
        try:
            os.rmdir(os.path.dirname(plan.state_file))
        except OSError:
            pass
