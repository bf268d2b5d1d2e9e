"""The config's pinned binaries as root, whose rule is that root alone may write them: a runc
anyone can write is refused (the rest of the pinned-binary checks are in tests/unit/test_config.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapguard.config import check_pinned_binary

pytestmark = pytest.mark.root


def test_a_pinned_runc_others_can_write_is_refused(tmp_path: Path) -> None:
    exe = tmp_path / "fake-runc"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o777)
    assert "writable by root alone" in (check_pinned_binary(str(exe), "runc") or "")
