"""`snapguard preflight --node` on this machine's real node checks, which run CRIU as root: in
process and through the CLI, with the missing pieces simulated (no iptables, a CRIU whose shared
libraries are missing). The gate's logic on fabricated results is in tests/unit/test_preflight_gate.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from junitparser import Failure, JUnitXml

from snapguard import preflight
from snapguard.config import load
from snapguard.preflight import CAPABILITY_NAMES, Report, host
from snapguard.reasons import Reason

pytestmark = [pytest.mark.root, pytest.mark.stack]

EXCEPTION_NAMES = re.compile(r"\b\w*(Error|Exception|Broken)\w*|Traceback")


def _no_exception_names(text: str) -> None:
    """No Python exception class name anywhere (typed reasons such as RUNC_UNUSABLE are upper case)."""
    hits = [m.group(0) for m in EXCEPTION_NAMES.finditer(text) if not m.group(0).isupper()]
    assert not hits, f"exception names in the output: {hits}"


def _caps(report: Report) -> dict[str, str]:
    return {c.name: c.status for c in report.capabilities}


def snapguard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "snapguard")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


BROKEN_CRIU = ("#!/bin/sh\necho 'criu: error while loading shared libraries: libnet.so.1: cannot open shared object "
               "file: No such file or directory' >&2\nexit 127\n")


def _root_only_criu(tmp_path: Path) -> Path:
    """A root-owned CRIU whose shared libraries are missing, in pytest's root-only tmp_path."""
    criu = tmp_path / "bin" / "criu"
    criu.parent.mkdir(mode=0o755)
    criu.write_text(BROKEN_CRIU)
    criu.chmod(0o755)
    return criu


def test_node_without_iptables_is_ready_for_host_netns_containers(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "IPTABLES_RESTORE", (str(tmp_path / "iptables-restore"),))
    config = load({"SNAPGUARD_STATE_DIR": str(tmp_path / "state")})
    report = preflight.node_report(config, ("host-netns-containers", "bare-processes"))
    caps = _caps(report)
    assert caps["host-netns-containers"] == caps["bare-processes"] == "ready", report.to_text()
    assert caps["own-netns-containers"] == caps["tcp-carry"] == "blocked"
    assert report.exit_code == preflight.EXIT_READY
    blockers = report.to_dict()["capabilities"]["own-netns-containers"]["blockers"]
    assert [b["reason"] for b in blockers] == ["NETWORK_LOCK_UNAVAILABLE"]
    assert preflight.node_report(config, ("own-netns-containers",)).exit_code == preflight.EXIT_BLOCKED


def test_node_with_a_broken_criu_in_process(tmp_path: Path) -> None:
    criu = _root_only_criu(tmp_path)
    config = load({"SNAPGUARD_CRIU": str(criu), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")})
    report = preflight.node_report(config, ("bare-processes",))
    [finding] = next(c for c in report.checks if c.name == "criu").findings
    assert finding.reason is Reason.CRIU_BROKEN
    assert "libnet.so.1: cannot open shared object file" in finding.detail and "127" in finding.detail
    assert report.exit_code == preflight.EXIT_BLOCKED


def test_cli_gate_ready_here_with_json_and_junit(tmp_path: Path) -> None:
    junit = tmp_path / "reports" / "preflight.xml"
    junit.parent.mkdir()
    out = snapguard("preflight", "--node", "--json", "--require", "host-netns-containers", "--junit", str(junit),
                    env={"SNAPGUARD_STATE_DIR": str(tmp_path / "state")})
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["verdict"] == "ready" and report["required"] == ["host-netns-containers"]
    assert set(report["capabilities"]) == set(CAPABILITY_NAMES)
    assert report["capabilities"]["host-netns-containers"]["status"] == "ready"
    assert junit.stat().st_mode & 0o777 == 0o644
    suites = {s.name: s for s in JUnitXml.fromfile(str(junit))}
    assert suites["snapguard preflight --node capabilities"].failures == 0
    assert {c.name for c in suites["snapguard preflight --node"]} >= {"privileges", "criu", "runc", "network-lock"}


def test_cli_broken_criu_is_criu_broken_with_the_loaders_message(tmp_path: Path) -> None:
    criu = _root_only_criu(tmp_path)
    junit = tmp_path / "preflight.xml"
    env = {"SNAPGUARD_CRIU": str(criu), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}
    out = snapguard("preflight", "--node", "--junit", str(junit), env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "CRIU_BROKEN: " in out.stdout and "libnet.so.1: cannot open shared object file" in out.stdout
    assert "PREFLIGHT_FAILED" not in out.stdout
    _no_exception_names(out.stdout + out.stderr + junit.read_text())
    [failure] = next(c for s in JUnitXml.fromfile(str(junit)) for c in s if c.name == "criu").result
    assert isinstance(failure, Failure) and failure.type == "CRIU_BROKEN" and "libnet.so.1" in failure.message
    assert f"remedy: {Reason.CRIU_BROKEN.remedy}" in failure.text
    as_json = snapguard("preflight", "--node", "--json", env=env)
    criu_check = next(c for c in json.loads(as_json.stdout)["checks"] if c["name"] == "criu")
    assert criu_check["findings"][0]["reason"] == "CRIU_BROKEN" and criu_check["error"] is None
    _no_exception_names(as_json.stdout + as_json.stderr)
