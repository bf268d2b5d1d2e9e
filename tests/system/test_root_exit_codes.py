"""One exit-code contract for `snapguard` and `snapguard-runc`: 0 done, 1 refused or failed (one
typed line), 2 the command line, the configuration or the install is unusable (nothing was
tried; an untrusted config file is UNTRUSTED_PATH), 3 restore --from's fallback. A config file
owned by another user (nobody: chown, so root) is refused with 2 by both, as checkpoint's --help
says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from snapguard.shim.entry import main as runc_main

pytestmark = pytest.mark.root


@pytest.fixture
def untrusted_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    os.chmod(tmp_path, 0o755)
    path = tmp_path / "config.toml"
    path.write_text("")
    os.chown(path, 65534, 65534)
    monkeypatch.setenv("SNAPGUARD_CONFIG", str(path))
    return path


def test_a_trust_refusal_exits_2_from_snapguard_runc(untrusted_config: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = runc_main(["snapguard-runc", "checkpoint", "--image-path", str(tmp_path / "img"),
                      "--work-path", str(tmp_path / "work"), "ctr"])
    assert code == 2 and "UNTRUSTED_PATH" in capsys.readouterr().err


def test_a_trust_refusal_exits_2_from_snapguard_as_its_help_says(untrusted_config: Path, tmp_path: Path) -> None:
    env = {**os.environ, "SNAPGUARD_CONFIG": str(untrusted_config)}
    cli = [sys.executable, "-m", "snapguard.cli"]
    done = subprocess.run([*cli, "checkpoint", "--pid", "1", "--images", str(tmp_path / "img")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "UNTRUSTED_PATH" in done.stderr, done.stderr
    helped = subprocess.run([*cli, "checkpoint", "--help"], capture_output=True, text=True, timeout=60)
    assert "2 usage, configuration or an untrusted install" in " ".join(helped.stdout.split()), helped.stdout
