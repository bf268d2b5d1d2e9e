"""snapguard-runc's C launcher: its compile with the pinned compiler, and its pinned file.

The launcher (c_helpers/runc_launcher.c) execs runc for every verb but checkpoint and restore
without starting Python, and the Python snapguard-runc for those two. It is compiled for the config
path it reads, into `snapguard-runc-launcher` beside the Python snapguard-runc: on the node, or where
a package carries one built for that config path (`PREBUILT_DIR`: the Debian package's, built with
the package), that one, with no compiler on the node. Beside the config, its pinned file
(snapguard.config's `_pin`) gives it the config's runc.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from ..config import LAUNCHER_PIN_HEADER, ConfigError, launcher_pin_path, load_with, pin_stamp, read_launcher_pin
from ..config import render_launcher_pin
from ..reasons import Reason
from ..trust import UntrustedPathError, resolve_trusted
from .base import CompilerMissingError, absent_dirs, fail, read_trusted, sha
from .changes import Change, Plan
from .options import DEFAULT_CC, Options

__all__ = ["BUILD_ENV", "LAUNCHER_NAME", "LAUNCHER_SOURCES", "PREBUILT_DIR", "build_launcher", "launcher_source_dir",
           "launcher_wanted", "plan_launcher", "plan_pin", "prebuilt_launcher"]

# snapguard-runc's C launcher: the installed name (beside the Python snapguard-runc), its sources
# (c_helpers/), and how it is compiled (with the pinned compiler, options.DEFAULT_CC).
LAUNCHER_NAME = "snapguard-runc-launcher"
LAUNCHER_SOURCES = ("runc_launcher.c", "runc_argv_table.h")
LAUNCHER_CFLAGS = ("-std=gnu11", "-O2", "-Wall", "-Wextra", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong",
                   "-fPIE", "-pie", "-Wl,-z,relro,-z,now", "-s")
# the compiler finds its assembler and linker through PATH: only root's directories
BUILD_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
# a launcher built with the package for one config path: `runc-launcher` and `config-path` (that
# path, one line) under the installation's prefix (packaging/build-deb.sh puts them there)
PREBUILT_DIR = os.path.join(sys.prefix, "share", "snapguard", "launcher")


def launcher_source_dir() -> str | None:
    """Where the launcher's C source is: snapguard/_c_helpers/ (a built package: setup.py copies it
    there), or c_helpers/ beside the package (a source or editable install)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # snapguard/
    for directory in (os.path.join(here, "_c_helpers"), os.path.join(os.path.dirname(here), "c_helpers")):
        if all(os.path.isfile(os.path.join(directory, name)) for name in LAUNCHER_SOURCES):
            return directory
    return None


def prebuilt_launcher(config_path: str) -> bytes | None:
    """The launcher built with the package, where it was built for `config_path` (root's files
    alone), else None."""
    if not os.path.exists(os.path.join(PREBUILT_DIR, "config-path")):
        return None  # no package's launcher here: nothing to check
    built_for = read_trusted(os.path.join(PREBUILT_DIR, "config-path"), "the prebuilt launcher's config path")
    if built_for is None or built_for.decode("utf-8", "replace").strip() != os.path.normpath(config_path):
        return None
    return read_trusted(os.path.join(PREBUILT_DIR, "runc-launcher"), "the prebuilt launcher")


def _c_literal(text: str) -> str:
    """`text` as a C string literal, every byte but [A-Za-z0-9/._+-] escaped."""
    safe = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._+-"
    return '"' + "".join(chr(b) if b in safe else f"\\{b:03o}" for b in os.fsencode(text)) + '"'


def build_launcher(config_path: str, *, cc: str = DEFAULT_CC, route_test: bool = False, help_test: bool = False,
                   source_dir: str | None = None) -> bytes:
    """The launcher compiled for `config_path` (its pinned file beside it), as bytes.

    The compiler is the pinned `cc`, run by the canonical path that was checked, with a PATH of
    root's directories only; the sources are read through checked descriptors into a private
    directory and compiled there. `route_test` builds the program that prints the route for its
    argv, `help_test` the one that says whether the app's help is asked (the tests hold both to
    the Python parser).
    """
    if not os.path.isabs(config_path):
        raise fail(f"the launcher's config must be an absolute path, got {config_path!r}")
    source_dir = source_dir or launcher_source_dir()
    if source_dir is None:
        raise fail("the launcher's C source (c_helpers/runc_launcher.c) is not installed with snapguard")
    try:
        compiler = resolve_trusted(cc, "exec")
    except UntrustedPathError as e:
        if e.unusable:
            raise CompilerMissingError(Reason.USAGE_ERROR,
                                       f"no C compiler at {cc} ({e.why}) to build snapguard-runc's launcher: "
                                       "install gcc (apt-get install gcc libc6-dev), or pass --no-launcher "
                                       "(containerd then runs the Python snapguard-runc)") from None
        raise fail(f"C compiler {e}", Reason.UNTRUSTED_PATH) from None
    work = tempfile.mkdtemp(prefix="snapguard-launcher-")
    try:
        for name in LAUNCHER_SOURCES:
            raw = read_trusted(os.path.join(source_dir, name), "the launcher's source")
            if raw is None:
                raise fail(f"the launcher's source {os.path.join(source_dir, name)} is missing")
            with open(os.path.join(work, name), "wb") as f:
                f.write(raw)
        defines = [f"-DSG_CONFIG_PATH={_c_literal(config_path)}",
                   f"-DSG_PIN_PATH={_c_literal(launcher_pin_path(config_path))}"]
        if route_test or help_test:
            defines.append("-DSG_ROUTE_TEST")
        if help_test:
            defines.append("-DSG_HELP_TEST")
        argv = [compiler, *LAUNCHER_CFLAGS, *defines, "-o", "launcher", LAUNCHER_SOURCES[0]]
        try:
            out = subprocess.run(argv, cwd=work, env=BUILD_ENV, capture_output=True, text=True, timeout=300,
                                 stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as e:
            raise fail(f"building snapguard-runc's launcher with {compiler}: {e}") from None
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise fail(f"building snapguard-runc's launcher with {compiler} failed: {last}")
        with open(os.path.join(work, "launcher"), "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def launcher_wanted(opts: Options) -> bool:
    """Whether this install builds the launcher (--launcher, --no-launcher, else where it can)."""
    if opts.launcher is not None:
        return opts.launcher
    # by default, where it can be built: no compiler is a note and the Python entry, not a failure
    # (--launcher demands it, and says what is missing)
    if opts.snapguard_runc is not None:
        return False
    if prebuilt_launcher(opts.snapguard_config) is not None:
        return True
    return launcher_source_dir() is not None and os.path.exists(opts.cc or DEFAULT_CC)


def plan_launcher(opts: Options, snapguard_runc: str, records: dict[str, Any], plan: Plan) -> Change | None:
    """The launcher's Change (built now, in a private directory), or None without it; without it,
    a launcher and pinned file an earlier install wrote are removed."""
    config_path = os.path.normpath(opts.snapguard_config)
    if not launcher_wanted(opts):
        if opts.launcher is None and opts.snapguard_runc is None:
            why = ("its source is not installed with snapguard" if launcher_source_dir() is None else
                   f"there is no C compiler at {opts.cc or DEFAULT_CC} (install gcc, or pass --cc)")
            plan.notes.append(f"snapguard-runc's C launcher is not built: {why}, so containerd runs the Python "
                              "snapguard-runc for every verb")
        for path, rec in list(records.items()):
            if rec.get("kind") in ("launcher", "launcher-pin"):
                current = read_trusted(path, "file")
                if current is not None and (rec["kind"] == "launcher-pin" or sha(current) == rec.get("sha256")):
                    plan.changes.append(Change(path, "remove", current, None, mode=0o755,
                                               binary=rec["kind"] == "launcher", summary="the launcher is not used"))
                del records[path]
        return None
    path = os.path.normpath(opts.launcher_path or os.path.join(os.path.dirname(snapguard_runc), LAUNCHER_NAME))
    if not os.path.isabs(path):
        raise fail(f"the launcher's path must be absolute, got {path!r}")
    data = prebuilt_launcher(config_path) or build_launcher(config_path, cc=opts.cc)
    before = read_trusted(path, "snapguard-runc's launcher")
    rec = records.get(path)
    if before is not None and before != data and (rec is None or rec.get("sha256") != sha(before)):
        raise fail(f"{path} exists and was not written by snapguard install (or was changed since): "
                    "move it away and run again")
    dirs = [d for d in absent_dirs(os.path.dirname(path)) if d not in plan.dirs]
    plan.dirs += dirs
    records[path] = {"kind": "launcher", "sha256": sha(data), "created_dirs": (rec or {}).get("created_dirs") or dirs}
    action = "unchanged" if before == data else "replace" if before is not None else "create"
    return Change(path, action, before, data, mode=0o755, binary=True,
                  summary=f"snapguard-runc's launcher: runc for every verb but checkpoint and restore, "
                          f"{snapguard_runc} for those")


def plan_pin(opts: Options, config_change: Change, entry: str, records: dict[str, Any], plan: Plan) -> Change:
    """The launcher's pinned file: the config's runc as the config loader reads it from the file
    written, with that file's identity; computed again when applied, after the config is written."""
    config_path = os.path.normpath(opts.snapguard_config)
    path = launcher_pin_path(config_path)

    def render() -> bytes:
        try:
            config = load_with({"SNAPGUARD_CONFIG": config_path}, ("runc",))
        except ConfigError as e:
            raise fail(f"snapguard's config as written: {e}", Reason[e.reason]) from None
        assert config.source_stat is not None
        try:
            return render_launcher_pin(config_path, pin_stamp(config.source_stat), config.runc, entry)
        except ValueError as e:
            raise fail(str(e)) from None

    found = read_launcher_pin(path)
    before = found[0] if found is not None else read_trusted(path, "the launcher's pinned file")
    if before is not None and found is None and path not in records:
        raise fail(f"{path} exists and was not written by snapguard install: move it away and run again")
    after = render() if config_change.action == "unchanged" else None
    records[path] = {"kind": "launcher-pin"}
    action = "unchanged" if after is not None and before == after else "replace" if before is not None else "create"
    preview = after or (f"{LAUNCHER_PIN_HEADER}\nconfig {config_path}\nstamp (the config file as written)\n"
                        f"runc (its runc)\nentry {entry}\n").encode()
    return Change(path, action, before, preview, mode=0o644, render=None if action == "unchanged" else render,
                  summary="the launcher's pinned file: the config's runc, the Python snapguard-runc")
