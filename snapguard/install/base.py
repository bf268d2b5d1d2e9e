"""What every step of `snapguard install` shares: its error, its paths, reading root's files."""

from __future__ import annotations

import hashlib
import os

try:
    import tomllib
except ImportError:  # Python < 3.11: the same parser, as the tomli package
    import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
from typing import Any

from ..files import write_atomic
from ..reasons import Reason, SnapguardError
from ..trust import UntrustedPathError, open_trusted

__all__ = ["CompilerMissingError", "DEFAULT_CONTAINERD_CONFIG", "DEFAULT_RUNTIME_NAME", "DEFAULT_SNAPGUARD_CONFIG",
           "DEFAULT_STATE_FILE", "DEFAULT_SYSTEMD_DIR", "InstallError", "absent_dirs", "fail", "parse_toml", "read_trusted", "sha", "table",
           "write_root_file"]

DEFAULT_RUNTIME_NAME = "snapguard"
DEFAULT_CONTAINERD_CONFIG = "/etc/containerd/config.toml"
DEFAULT_SNAPGUARD_CONFIG = "/etc/snapguard/config.toml"
DEFAULT_STATE_FILE = "/var/lib/snapguard/install.json"
DEFAULT_SYSTEMD_DIR = "/etc/systemd/system/containerd.service.d"  # containerd's unit's drop-ins
MAX_FILE_BYTES = 1 << 20


class InstallError(SnapguardError):
    """snapguard install refused or failed: a typed reason and one line."""


class CompilerMissingError(InstallError):
    """The pinned C compiler is missing or not executable: the launcher cannot be built."""


def fail(detail: str, reason: Reason = Reason.USAGE_ERROR) -> InstallError:
    """An InstallError (USAGE_ERROR unless told) with one line."""
    return InstallError(reason, detail)


def read_trusted(path: str, what: str) -> bytes | None:
    """The bytes of a file root alone controls, None when it does not exist."""
    try:
        fd = open_trusted(path, "file")
    except UntrustedPathError as e:
        if e.missing:
            return None
        raise fail(f"{what} {e}", Reason.UNTRUSTED_PATH if not e.unusable else Reason.USAGE_ERROR) from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise fail(f"{what} {path} is larger than {MAX_FILE_BYTES} bytes")
    return raw


def parse_toml(raw: bytes, path: str) -> dict[str, Any]:
    """The TOML table of `raw`, read from `path`; a one-line InstallError otherwise."""
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise fail(f"{path} is not valid TOML: {' '.join(str(e).split())}") from None


def sha(data: bytes) -> str:
    """The SHA-256 of `data`, hex."""
    return hashlib.sha256(data).hexdigest()


def table(d: Any, key: str) -> dict[str, Any]:
    """d[key] where both are tables, else an empty one."""
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, dict) else {}


def absent_dirs(path: str) -> list[str]:
    """The directories up to `path` that do not exist yet, outermost first."""
    out: list[str] = []
    while path and path != os.path.dirname(path) and not os.path.isdir(path):
        out.insert(0, path)
        path = os.path.dirname(path)
    return out


def write_root_file(path: str, data: bytes, mode: int) -> None:
    """Whole or not at all (snapguard.files.write_atomic), `mode`, root's where run as root."""
    write_atomic(path, data, mode)
    if os.geteuid() == 0:
        st = os.stat(path, follow_symlinks=False)
        if (st.st_uid, st.st_gid) != (0, 0):
            os.chown(path, 0, 0, follow_symlinks=False)
