"""Files made for the trust and image-verification tests (unit and root): an executable of a given
mode, the one-line reason `resolve_trusted` refuses a path with, and a sealed image directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from snapguard import image
from snapguard.procfs import host_facts
from snapguard.trust import UntrustedPathError, resolve_trusted

__all__ = ["image_fields", "make_exe", "sealed_image", "why_untrusted"]


def make_exe(path: Path, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(mode)
    return path


def why_untrusted(path: str | Path, kind: str = "exec") -> str:
    """Why `resolve_trusted` refuses `path` (it must): one line, the path first."""
    with pytest.raises(UntrustedPathError) as e:
        resolve_trusted(str(path), kind)
    assert "\n" not in str(e.value) and str(e.value) == f"{path}: {e.value.why}"
    return e.value.why


def image_fields() -> dict[str, Any]:
    """The manifest fields `image.seal` is given for a container image of no processes."""
    return {"container_id": "c", "criu_version": "4.2.1", "host": host_facts(), "processes": []}


def sealed_image(d: Path) -> Path:
    """`d` made a sealed image: a 300 kB page file and a core file."""
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(300_000))
    (d / "core-1.img").write_bytes(b"core")
    image.seal(str(d), image_fields())
    return d
