"""Shared by the unit tests that read mountinfo: a fake procfs root (for procfs.using_procfs)."""

from __future__ import annotations

from pathlib import Path


def with_mountinfo(tmp_path: Path, *lines: str) -> Path:
    """A procfs root under `tmp_path` whose self/mountinfo holds `lines`, one mount each."""
    root = tmp_path / "proc"
    (root / "self").mkdir(parents=True)
    (root / "self" / "mountinfo").write_text("".join(line + "\n" for line in lines))
    return root
