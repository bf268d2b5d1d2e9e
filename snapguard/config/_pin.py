"""The C launcher's pinned file: the runc path snapguard-runc's launcher execs without Python.

snapguard-runc's launcher (c_helpers/runc_launcher.c) execs runc without starting Python, so it
cannot read TOML: it reads the runc path from this file, written by `snapguard install` beside
the config and kept in sync by the loader whenever the config is loaded. It records the config
file's identity (the stamp): where the config changed since, the launcher hands the command line
to the Python entry, whose pinned_runc() reads the config and refreshes the file.
"""

from __future__ import annotations

import os

from ..trust import UntrustedPathError, open_trusted

__all__ = ["LAUNCHER_PIN_HEADER", "LAUNCHER_PIN_NAME", "launcher_pin_path", "pin_stamp", "read_launcher_pin",
           "render_launcher_pin", "sync_launcher_pin", "write_pin_file"]

# The C launcher's pinned file (c_helpers/runc_launcher.c), beside the config it was derived from.
LAUNCHER_PIN_NAME = "runc-launcher.pin"
LAUNCHER_PIN_HEADER = "snapguard-runc-launcher 1"


def launcher_pin_path(config_path: str) -> str:
    """The launcher's pinned file for the config file at `config_path`."""
    return os.path.join(os.path.dirname(config_path), LAUNCHER_PIN_NAME)


def pin_stamp(st: os.stat_result) -> str:
    """The config file's identity as the launcher computes it from fstat."""
    return f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def render_launcher_pin(config_path: str, stamp: str, runc: str, entry: str) -> bytes:
    """The pinned file's text; ValueError where a value cannot be written on one line."""
    for value in (config_path, stamp, runc, entry):
        if not value or "\n" in value or "\0" in value:
            raise ValueError(f"cannot pin {value!r} for snapguard-runc's launcher")
    for path in (config_path, runc, entry):
        if not os.path.isabs(path):
            raise ValueError(f"cannot pin {path!r} for snapguard-runc's launcher: not an absolute path")
    text = f"{LAUNCHER_PIN_HEADER}\nconfig {config_path}\nstamp {stamp}\nrunc {runc}\nentry {entry}\n"
    return text.encode("utf-8", "surrogateescape")


def read_launcher_pin(path: str) -> tuple[bytes, dict[str, str]] | None:
    """The pinned file's bytes and fields, where root alone controls it and it is well formed;
    None otherwise (missing: the launcher is not installed for this config)."""
    try:
        fd = open_trusted(path, "file")
    except UntrustedPathError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(8192)
    except OSError:
        return None
    lines = raw.decode("utf-8", "surrogateescape").split("\n")
    if len(raw) >= 8192 or not lines or lines[0] != LAUNCHER_PIN_HEADER or lines[-1] != "":
        return None
    fields = dict(line.partition(" ")[::2] for line in lines[1:-1])
    if not {"config", "stamp", "runc", "entry"} <= set(fields):
        return None
    return raw, fields


def sync_launcher_pin(config_path: str, st: os.stat_result, runc: str) -> None:
    """Where the launcher's pinned file beside `config_path` exists (it was installed) and no
    longer says that this config file, as `st` identifies it, gives `runc`: rewrite it, whole
    (a temporary file renamed over it). Nothing is raised: a pinned file that cannot be written
    only sends the launcher's calls to the Python entry, which reads the config itself."""
    path = launcher_pin_path(config_path)
    found = read_launcher_pin(path)
    if found is None or found[1]["config"] != config_path:
        return
    try:
        text = render_launcher_pin(config_path, pin_stamp(st), runc, found[1]["entry"])
    except ValueError:
        return
    if text != found[0]:
        write_pin_file(path, text)


def write_pin_file(path: str, text: bytes) -> bool:
    """Write the pinned file whole, root's (where run as root), 0644; False where it could not."""
    from ..files import write_atomic  # only when it changed: the pass-through path stays small

    try:
        write_atomic(path, text, 0o644, exclusive_tmp=True)
        if os.geteuid() == 0 and os.stat(path).st_gid != 0:
            os.chown(path, 0, 0, follow_symlinks=False)
        return True
    except OSError:
        return False
