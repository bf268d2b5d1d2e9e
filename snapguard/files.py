"""Writing files that hold process memory or its description: private to root, atomic."""

from __future__ import annotations

import json
import os
from typing import Any

from .trust import make_private_dir, resolve_trusted

__all__ = ["ensure_private_dir", "write_private_bytes", "write_private_json"]


def ensure_private_dir(path: str) -> str:
    """Create `path` (and missing parents) 0700, or check and tighten an existing directory to
    0700; returns its canonical path. snapguard.trust.make_private_dir: the existing part of the
    path must be root's alone (whoever controls a directory on the way could swap what snapguard
    writes there), whatever the umask. Raises trust.UntrustedPathError (not an OSError).

    A relative path (`--images imgs`) is taken from the current directory as the kernel knows
    it (getcwd is canonical), so that the walk still sees every component."""
    path = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    if os.path.islink(path):
        # containerd's shim makes a task's work path a symlink into its own root-only state: a
        # link followed only when it and every hop are root's alone (the walk checks each)
        path = resolve_trusted(path, "dir")
    return make_private_dir(path)


def write_private_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` 0600 through a temporary file, fsync and rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_private_json(path: str, obj: Any) -> None:
    write_private_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
