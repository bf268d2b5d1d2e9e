"""Files made for the trust and image-verification tests (unit and root): an executable of a given
mode, the one-line reason `resolve_trusted` refuses a path with, the private-directory checks under
a umask, and a sealed image directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from snapguard import image
from snapguard.files import ensure_private_dir
from snapguard.procfs import host_facts
from snapguard.trust import UntrustedPathError, make_private_dir, resolve_trusted

__all__ = ["image_fields", "make_exe", "private_dirs_under_umask", "sealed_image", "why_untrusted"]


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


def private_dirs_under_umask(tmp: Path, umask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `umask`, the directories make_private_dir and ensure_private_dir make (or find) are 0700
    and this user's, every parent they create included."""
    old = os.umask(umask)
    try:
        target = tmp / "state" / "run" / "snap"
        assert make_private_dir(str(target)) == str(target)
        for d in (tmp / "state", tmp / "state" / "run", target):
            st = d.stat()
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), d
        existing = tmp / "existing"
        existing.mkdir(mode=0o755)
        assert make_private_dir(str(existing)) == str(existing)
        assert stat.S_IMODE(existing.stat().st_mode) == 0o700
        # the files.py entry point callers use, relative paths taken from the cwd
        monkeypatch.chdir(tmp)
        assert ensure_private_dir("images/a") == str(tmp / "images" / "a")
        assert stat.S_IMODE((tmp / "images").stat().st_mode) == 0o700
    finally:
        os.umask(old)
