"""runc's version decides how CRIU is pinned: `--criu` for runc < 1.2, PATH alone from 1.2 on
(1.4 refuses the flag); read once per binary and cached in the state dir."""

from __future__ import annotations

import os
from pathlib import Path

from snapguard import runc
from snapguard.config import load
from snapguard.shim._argv import split_global
from snapguard.shim._criu import runc_args


def _fake_runc(tmp_path: Path, version: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(mode=0o700, exist_ok=True)
    path = bindir / f"runc-{version}"
    calls = tmp_path / f"calls-{version}"
    path.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'runc version {version}'\necho 'spec: 1.2.0'\n")
    os.chmod(path, 0o755)
    return path


def test_version_is_read_once_per_binary(tmp_path: Path) -> None:
    fake = _fake_runc(tmp_path, "1.3.6")
    state = str(tmp_path / "state")
    assert runc.version(str(fake), state) == (1, 3, 6)
    assert runc.version(str(fake), state) == (1, 3, 6)
    assert (tmp_path / "calls-1.3.6").read_text().count("x") == 1, "the second call ran runc again"


def test_criu_pinned_by_flag_only_before_runc_1_2(tmp_path: Path) -> None:
    args = ["--root", "/r", "checkpoint", "--image-path", "/i", "c1"]
    for version, flagged in (("1.1.5", True), ("1.3.6", False), ("1.4.0", False)):
        fake = _fake_runc(tmp_path, version)
        config = load({"SNAPGUARD_CONFIG": str(_empty_config(tmp_path)), "SNAPGUARD_RUNC": str(fake),
                       "SNAPGUARD_STATE_DIR": str(tmp_path / f"state-{version}")})
        got = runc_args(args, split_global(args), config)
        assert ("--criu" in got) is flagged, version
        assert got[-len(args):] == args


def _empty_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    return cfg
