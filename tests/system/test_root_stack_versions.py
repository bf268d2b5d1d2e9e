"""`snapguard preflight --node`'s runc and containerd versions on fabricated binaries: snapguard
runs only root's binaries, so these run as root (the pairings on fabricated versions are in
tests/unit/test_stack_versions.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapguard.preflight import host
from snapguard.reasons import Severity

pytestmark = pytest.mark.root


def _tool(path: Path, says: str, rc: int = 0) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' '{says}'\nexit {rc}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("said,version", [
    ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3", "1.6.20~ds1"),
    ("containerd github.com/containerd/containerd/v2 2.1.9+unknown ", "2.1.9+unknown"),
    ("containerd containerd.io v1.7.27 05044ec0a9a75232cad458027ca83437aae3f4da", "v1.7.27"),
])


def test_versions_become_facts(tmp_path: Path, said: str, version: str) -> None:
    runc = _tool(tmp_path / "bin" / "runc", "runc version 1.3.6+ds1")
    containerd = _tool(tmp_path / "bin" / "containerd", said)
    facts: dict[str, object] = {}
    findings = host.check_runtime_versions(runc, str(tmp_path / "state"), facts,
                                           (str(tmp_path / "none" / "containerd"), containerd))
    assert facts["runc_version"] == "1.3.6"
    assert facts["containerd_path"] == containerd and facts["containerd_version"] == version
    assert findings == []


def test_bad_pairing_found_on_the_node(tmp_path: Path) -> None:
    runc = _tool(tmp_path / "bin" / "runc", "runc version 1.1.5+ds1")
    first = _tool(tmp_path / "a" / "containerd", "containerd github.com/containerd/containerd/v2 2.1.9 x")
    later = _tool(tmp_path / "b" / "containerd", "containerd github.com/containerd/containerd 1.6.20 x")
    facts: dict[str, object] = {"runc_version": "1.1.5+ds1"}  # as the runc check leaves it
    [f] = host.check_runtime_versions(runc, str(tmp_path / "state"), facts, (first, later))
    assert facts["containerd_path"] == first and facts["runc_version"] == "1.1.5+ds1"
    assert f.severity is Severity.WARNING and f.evidence["containerd_path"] == first
    assert f.evidence["runc_path"] == runc


def test_no_containerd_and_unusable_ones_are_facts_not_findings(tmp_path: Path) -> None:
    runc = _tool(tmp_path / "bin" / "runc", "runc version 1.3.6")
    facts: dict[str, object] = {}
    assert host.check_runtime_versions(runc, None, facts, (str(tmp_path / "nothing"),)) == []
    assert facts["containerd_path"] is None and facts["containerd_version"] is None

    writable = _tool(tmp_path / "w" / "containerd", "containerd x 2.1.9")
    os.chmod(writable, 0o777)  # anyone could change it: never run as root
    facts = {}
    assert host.check_runtime_versions(runc, None, facts, (writable,)) == []
    assert facts["containerd_version"] is None and "writable" in str(facts["containerd_problem"])

    silent = _tool(tmp_path / "s" / "containerd", "", rc=3)
    facts = {}
    assert host.check_runtime_versions(runc, None, facts, (silent,)) == []
    assert facts["containerd_version"] is None
