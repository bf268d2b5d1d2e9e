"""`snapguard preflight --node`: the runc and containerd versions and the known bad pairings, on
fabricated versions and fabricated binaries (the real stacks are in tests/system/test_containerd.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapguard.preflight import host
from snapguard.reasons import Reason, Severity

V = tuple[int, int, int]


@pytest.mark.parametrize("containerd,runc", [
    ((1, 6, 20), (1, 1, 5)),   # Debian 12
    ((2, 1, 9), (1, 3, 6)),    # Debian unstable (the compat stack)
    ((1, 6, 20), (1, 3, 6)),   # containerd 1.6.39 itself is tested with runc 1.3.0
    ((1, 7, 27), (1, 2, 5)),
    ((2, 0, 0), (1, 2, 1)),
    ((2, 0, 0), (1, 4, 0)),    # containerd 2.x has no CriuPath
    ((1, 7, 27), (1, 4, 2)),   # containerd 1.7 ignores CriuPath
    ((2, 3, 0), (1, 4, 2)),
    ((1, 5, 0), (1, 0, 0)),    # older than any rule
])
def test_good_pairings_say_nothing(containerd: V, runc: V) -> None:
    assert host.runtime_pairing(containerd, runc) == []


@pytest.mark.parametrize("containerd,runc,recommended", [
    ((2, 1, 9), (1, 1, 5), "1.3"),
    ((2, 0, 3), (1, 1, 12), "1.2"),
    ((2, 2, 0), (1, 2, 9), "1.3"),
    ((2, 3, 1), (1, 3, 6), "1.4"),
    ((2, 9, 0), (1, 3, 6), "1.4"),   # newer than the table: at least what the newest known asks
    ((1, 6, 0), (1, 0, 3), "1.1"),
])
def test_runc_older_than_containerd_is_tested_with_warns(containerd: V, runc: V, recommended: str) -> None:
    [f] = host.runtime_pairing(containerd, runc, {"containerd_path": "/usr/bin/containerd"})
    assert f.severity is Severity.WARNING and f.reason is Reason.RUNTIME_PAIRING_UNTESTED
    assert f"tested with runc {recommended}" in f.detail and "docs/RUNC.md" in f.detail
    assert f.evidence["runc_recommended"] == recommended
    assert f.evidence["containerd_path"] == "/usr/bin/containerd"
    assert f.evidence["runc_version"] == ".".join(map(str, runc))


@pytest.mark.parametrize("containerd", [(1, 6, 0), (1, 6, 20), (1, 6, 39)])
@pytest.mark.parametrize("runc", [(1, 4, 0), (1, 5, 0)])
def test_containerd_1_6_with_runc_without_criu_flag_warns(containerd: V, runc: V) -> None:
    [f] = host.runtime_pairing(containerd, runc)
    assert f.severity is Severity.WARNING
    assert "--criu" in f.detail and "CriuPath" in f.detail


# --- the check on fabricated binaries ----------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="snapguard runs only root's binaries")


def _tool(path: Path, says: str, rc: int = 0) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' '{says}'\nexit {rc}\n")
    path.chmod(0o755)
    return str(path)


@needs_root
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


@needs_root
def test_bad_pairing_found_on_the_node(tmp_path: Path) -> None:
    runc = _tool(tmp_path / "bin" / "runc", "runc version 1.1.5+ds1")
    first = _tool(tmp_path / "a" / "containerd", "containerd github.com/containerd/containerd/v2 2.1.9 x")
    later = _tool(tmp_path / "b" / "containerd", "containerd github.com/containerd/containerd 1.6.20 x")
    facts: dict[str, object] = {"runc_version": "1.1.5+ds1"}  # as the runc check leaves it
    [f] = host.check_runtime_versions(runc, str(tmp_path / "state"), facts, (first, later))
    assert facts["containerd_path"] == first and facts["runc_version"] == "1.1.5+ds1"
    assert f.severity is Severity.WARNING and f.evidence["containerd_path"] == first
    assert f.evidence["runc_path"] == runc


@needs_root
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
