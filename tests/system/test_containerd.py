"""End to end through containerd, its runc shim, snapguard-runc, the real runc and CRIU, on both
stacks of the `containerd` fixture: Debian 12's containerd 1.6.20 + runc 1.1.5, and Debian
unstable's containerd 2.1.9 + runc 1.3.6 (packaging/install-deps.sh's /opt/snapguard/compat)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from snapguard_lab.drill import drill_exit, drill_leave_running
from snapguard_lab.testbed import Containerd, CounterLog

pytestmark = pytest.mark.stack


def test_leave_running_checkpoint_and_restore_continue_exactly(
        containerd: Containerd, snapguard_runc: str, clean_config: Path, tmp_path: Path) -> None:
    result = drill_leave_running(containerd, snapguard_runc, tmp_path, cid="t-lr")
    assert result["kept_running"], result
    assert result["chain_errors"] == [], result
    low, high = result["snapshot_between"]
    assert low < result["first_after"] <= high + 1, result
    assert result["continued"]


def test_exit_checkpoint_and_restore_continue_exactly(
        containerd: Containerd, snapguard_runc: str, clean_config: Path, tmp_path: Path) -> None:
    result = drill_exit(containerd, snapguard_runc, tmp_path, cid="t-exit")
    assert result["stopped_at_dump"], result
    assert result["first_after"] == result["snapshot_between"][1] + 1, result
    assert result["chain_errors"] == [] and result["continued"], result
    manifest = json.loads((tmp_path / "image" / "snapguard-manifest.json").read_text())
    assert manifest["container_id"] == "t-exit" and manifest["leave_running"] is False
    assert {p["comm"] for p in manifest["processes"]} >= {"sh"}


def test_blocked_preflight_leaves_container_running(
        containerd: Containerd, snapguard_runc: str, clean_config: Path, tmp_path: Path) -> None:
    clean_config.write_text(f'criu = "{tmp_path}/no-such-criu"\n')
    out_dir, image_dir, work_dir = tmp_path / "out", tmp_path / "image", tmp_path / "work"
    log = CounterLog(out_dir / "counter.log")
    containerd.run_counter("t-refuse", str(out_dir), snapguard_runc)
    try:
        log.wait_for(5)
        refused = containerd.ctr("tasks", "checkpoint", "--image-path", str(image_dir), "--work-path",
                                 str(work_dir), "t-refuse", check=False)
        assert refused.returncode != 0
        assert f"snapguard CRIU_MISSING: criu {tmp_path}/no-such-criu" in refused.stderr
        record = json.loads((work_dir / "snapguard-result.json").read_text())
        assert record["reason"] == "CRIU_MISSING" and record["workload_intact"] is True
        assert record["phase"] == "preflight"
        assert not image_dir.exists() or not any(image_dir.iterdir())
        assert containerd.task_status("t-refuse") == "RUNNING"
        n = log.last()
        assert log.wait_for(len(log.values()) + 5) > n, "the workload stopped advancing"
        assert log.chain_errors() == []
    finally:
        containerd.remove("t-refuse")


def test_tampered_image_refused_before_restore(
        containerd: Containerd, snapguard_runc: str, clean_config: Path, tmp_path: Path) -> None:
    out_dir, image_dir = tmp_path / "out", tmp_path / "image"
    containerd.run_counter("t-tamper", str(out_dir), snapguard_runc)
    try:
        CounterLog(out_dir / "counter.log").wait_for(5)
        containerd.ctr("tasks", "checkpoint", "--image-path", str(image_dir), "--work-path",
                       str(tmp_path / "work"), "t-tamper")
    finally:
        containerd.remove("t-tamper")
    pages = sorted(image_dir.glob("pages-*.img"), key=lambda p: p.stat().st_size)[-1]
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0x01
    pages.write_bytes(bytes(data))

    runc_root, work, log = tmp_path / "runc", tmp_path / "restore-work", tmp_path / "log.json"
    out = subprocess.run([snapguard_runc, "--root", str(runc_root), "--log", str(log), "--log-format", "json",
                          "restore", "--image-path", str(image_dir), "--work-path", str(work),
                          "--bundle", str(tmp_path / "bundle"), "--detach", "-no-subreaper", "t-tampered"],
                         capture_output=True, text=True, timeout=60, env=containerd.env)
    assert out.returncode == 1
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert msg.startswith(f"snapguard IMAGE_CORRUPT: image file {pages.name} has sha256 ")
    record = json.loads((work / "snapguard-result.json").read_text())
    assert record["reason"] == "IMAGE_CORRUPT" and record["evidence"]["path"] == str(pages)
    # kept in the state directory too, where a bundle's removal does not take it
    state = Path(containerd.env["SNAPGUARD_STATE_DIR"])
    assert json.loads((state / "runs" / "restore-t-tampered.json").read_text()) == record
    kept = json.loads((state / "runs" / "checkpoint-t-tamper.json").read_text())
    assert kept["ok"] is True and kept["timings"]["total_s"] > 0
    assert (state / "runs").stat().st_mode & 0o777 == 0o700
    assert not (work / "restore.log").exists(), "runc restore ran despite the corrupt image"
    assert subprocess.run([containerd.runc, "--root", str(runc_root), "state", "t-tampered"],
                          capture_output=True).returncode != 0


def test_incomplete_image_refused(snapguard_runc: str, tmp_path: Path) -> None:
    image_dir = tmp_path / "half-copied"
    image_dir.mkdir()
    (image_dir / "pages-1.img").write_bytes(b"\0" * 4096)
    out = subprocess.run([snapguard_runc, "restore", "--image-path", str(image_dir), "--work-path",
                          str(tmp_path / "w"), "--bundle", str(tmp_path), "x"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "snapguard IMAGE_INCOMPLETE: " in out.stderr


def test_preflight_of_a_running_container(containerd: Containerd, snapguard_runc: str, clean_config: Path,
                                          tmp_path: Path) -> None:
    import os
    import sys

    containerd.run_counter("t-pre", str(tmp_path / "out"), snapguard_runc)
    try:
        CounterLog(tmp_path / "out" / "counter.log").wait_for(3)
        exe = os.path.join(os.path.dirname(sys.executable), "snapguard")
        out = subprocess.run([exe, "preflight", "--container", "t-pre", "--root", containerd.runc_root, "--json"],
                             capture_output=True, text=True, timeout=60)
        report = json.loads(out.stdout)
        assert out.returncode == 0, report["blockers"]
        assert report["target"] == "--container t-pre"
        assert {p["comm"] for p in report["facts"]["processes"]} >= {"sh"}
        missing = subprocess.run([exe, "preflight", "--container", "no-such", "--root", containerd.runc_root],
                                 capture_output=True, text=True, timeout=60)
        assert missing.returncode == 2 and "runc-state" in missing.stdout
    finally:
        containerd.remove("t-pre")


def test_node_preflight_reports_runc_and_containerd_versions(containerd: Containerd, tmp_path: Path) -> None:
    """`snapguard preflight --node --json` as containerd's environment sets it up: the stack's runc
    (SNAPGUARD_RUNC on the compat stack) and the node's containerd, the first of the pinned paths."""
    import os
    import sys

    from snapguard.preflight import host

    exe = os.path.join(os.path.dirname(sys.executable), "snapguard")
    out = subprocess.run([exe, "preflight", "--node", "--json"], capture_output=True, text=True, timeout=120,
                         env={**containerd.env, "SNAPGUARD_STATE_DIR": str(tmp_path / "state")})
    report = json.loads(out.stdout)
    said = subprocess.run([containerd.runc, "--version"], capture_output=True, text=True, check=True).stdout
    assert report["facts"]["runc_version"] == said.splitlines()[0].removeprefix("runc version ")
    node = next(p for p in host.CONTAINERD_PATHS if os.path.exists(p))
    said = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout
    assert report["facts"]["containerd_path"] == node
    assert report["facts"]["containerd_version"] == said.split()[2]
    [check] = [c for c in report["checks"] if c["name"] == "runtime-versions"]
    assert check["error"] is None
    assert check["status"] == ("warning" if host.runtime_pairing(_version(said.split()[2]), _version(
        report["facts"]["runc_version"])) else "ok"), check


def _version(text: str) -> tuple[int, int, int]:
    import re

    m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", text)
    assert m, text
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)))
