"""`snapguard install --store`: a store URL that a unit file cannot carry, or that names no
store, is a typed one-line USAGE_ERROR and nothing is planned; the CLI's --json carries the
next steps. (Writing the drop-in needs root: tests/system/test_root_install.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from snapguard import install
from snapguard.install.store_env import unit_dropin
from snapguard.reasons import Reason, SnapguardError
from tests.unit.test_install import DEBIAN_12_CONFIG, SNAPGUARD, Node, node

__all__ = ["node"]  # the shared fixture


@pytest.mark.parametrize("url", ["http://snaps", "file://relative/dir", "file:relative", "s3:///no-bucket",
                                 "s3://snaps/with space", 's3://snaps/"quoted"', "s3://snaps/back\\slash",
                                 "s3://snaps/\nExecStartPre=/bin/sh", "s3://snaps/é"])
def test_a_store_url_a_unit_cannot_carry_is_refused(node: Node, url: str) -> None:
    with pytest.raises(SnapguardError) as refused:
        install.plan_install(node.options(store=url, systemd_dir=str(node.tmp / "units")))
    assert refused.value.reason is Reason.USAGE_ERROR and "\n" not in str(refused.value)


def test_the_dropin_doubles_percent_signs() -> None:
    assert b'Environment="SNAPGUARD_STORE=file:///mnt/a%%20b"\n' in unit_dropin("file:///mnt/a%20b")


def test_cli_json_says_what_is_left_to_do(node: Node, tmp_path: Path) -> None:
    node.main.parent.mkdir(parents=True)
    node.main.write_text(DEBIAN_12_CONFIG)
    args = ["--containerd-config", str(node.main), "--config", str(node.config), "--state-file", str(node.state),
            "--containerd", str(node.containerd), "--systemd-dir", str(tmp_path / "units"), "--dry-run"]
    out = subprocess.run([SNAPGUARD, "install", *args, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    steps = json.loads(out.stdout)["next"]
    assert any("SNAPGUARD_STORE" in s for s in steps) and steps[-1].startswith("kubectl apply")
    bad = subprocess.run([SNAPGUARD, "install", *args, "--store", "ftp://x"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("snapguard USAGE_ERROR: --store ftp://x"), bad.stderr
    assert "Traceback" not in bad.stderr
