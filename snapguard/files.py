"""Writing files that hold process memory or its description: private to root, atomic."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["ensure_private_dir", "write_private_bytes", "write_private_json"]


def ensure_private_dir(path: str) -> None:
    """Create `path` (and parents) 0700, or tighten an existing directory to 0700."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


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
