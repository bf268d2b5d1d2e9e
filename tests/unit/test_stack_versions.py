"""`snapguard preflight --node`: the known bad pairings of runc and containerd versions, on
fabricated versions (fabricated binaries, which only root runs, are in
tests/system/test_root_stack_versions.py; the real stacks in tests/system/test_containerd.py)."""

from __future__ import annotations

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
