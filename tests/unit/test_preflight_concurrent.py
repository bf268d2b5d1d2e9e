"""The host checks run all at once (`host.run_concurrently`): the preflight waits for the slowest
probe, not their sum; the report keeps the plan's order and each check's own facts; a check that
does not answer by the deadline is a typed 'could not check', the others' results kept."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from snapguard import preflight
from snapguard.config import Config, load
from snapguard.preflight import gpu, host
from snapguard.reasons import Finding, Reason, SnapguardError

PROBE_S = 0.3  # each stand-in probe's own time: three of them one after another take 0.9 s


@pytest.fixture
def config(tmp_path: Path) -> Config:
    f = tmp_path / "config.toml"
    f.write_text("")
    return load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")})


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, float]]:
    """The criu, CUDA plugin and NVML probes each take PROBE_S; (check, start, end) of each call."""
    spans: list[tuple[str, float, float]] = []

    def timed(name: str, value: object) -> object:
        t = time.monotonic()
        time.sleep(PROBE_S)
        spans.append((name, t, time.monotonic()))
        return value

    def criu(path: str, state_dir: str | None, facts: dict[str, object]) -> list[Finding]:
        facts["criu_version"] = "4.2.1"
        return timed("criu", [])  # type: ignore[return-value]

    monkeypatch.setattr(host, "check_privileges", lambda: [])
    monkeypatch.setattr(host, "check_criu", criu)
    monkeypatch.setattr(host, "check_network_lock",
                        lambda: [Finding(Reason.NETWORK_LOCK_UNAVAILABLE, "no iptables-restore here")])
    monkeypatch.setattr(host, "check_cuda_plugin", lambda config, required: timed("cuda-plugin", []))
    monkeypatch.setattr(gpu, "gpu_facts", lambda: timed("nvidia-driver", None))
    return spans


def test_host_checks_overlap_and_keep_their_order_and_facts(slow: list[tuple[str, float, float]],
                                                           config: Config) -> None:
    t = time.monotonic()
    report = preflight.Report("--pid 1")
    preflight.host_checks(report, config, gpu_required=True, network_lock=True)
    took = time.monotonic() - t
    assert [c.name for c in report.checks] == ["privileges", "criu", "network-lock", "cuda-plugin", "nvidia-driver"]
    assert [c.status for c in report.checks] == ["ok", "ok", "blocked", "ok", "ok"]
    assert report.host.criu_version == "4.2.1" and report.host.knows("gpu") and report.host.gpu is None
    # the three probes ran at the same time: each began before any other ended
    assert len(slow) == 3 and max(s for _, s, _ in slow) < min(e for _, _, e in slow), slow
    assert took < 2 * PROBE_S, took
    assert all(c.duration_s >= PROBE_S * 0.9 for c in report.checks if c.name in ("criu", "cuda-plugin"))


def test_ahead_results_carry_each_checks_own_facts(slow: list[tuple[str, float, float]], config: Config) -> None:
    ahead = preflight.host_checks_ahead(config, gpu_required=True)
    left = {name: facts for name, _, _, facts in ahead.results}
    assert left["criu"] == {"criu_version": "4.2.1"} and left["nvidia-driver"] == {"gpu": None}
    assert left["privileges"] == left["cuda-plugin"] == {}
    assert ahead.seconds < 2 * PROBE_S, ahead.seconds


def test_a_check_past_the_deadline_is_could_not_check(monkeypatch: pytest.MonkeyPatch, config: Config) -> None:
    monkeypatch.setattr(host, "HOST_CHECKS_DEADLINE_S", 0.2)
    monkeypatch.setattr(host, "check_privileges", lambda: [])
    monkeypatch.setattr(host, "check_criu", lambda path, state_dir, facts: time.sleep(5) or [])
    monkeypatch.setattr(host, "check_cuda_plugin", lambda config, required: [])
    monkeypatch.setattr(gpu, "gpu_facts", lambda: None)
    t = time.monotonic()
    report = preflight.Report("--pid 1")
    preflight.host_checks(report, config, gpu_required=False, network_lock=False)
    assert time.monotonic() - t < 2.0
    by = {c.name: c for c in report.checks}
    assert by["criu"].status == "error" and "did not answer within 0.2 s" in (by["criu"].error or "")
    assert by["privileges"].status == by["cuda-plugin"].status == by["nvidia-driver"].status == "ok"
    assert report.exit_code == preflight.EXIT_UNCHECKED


def test_run_concurrently_gives_values_in_order_and_errors_typed() -> None:
    def boom() -> int:
        raise ValueError("bad")

    def typed() -> int:
        raise SnapguardError(Reason.CRIU_BROKEN, "no")

    out = host.run_concurrently([("a", lambda: 1), ("b", boom), ("c", typed), ("d", lambda: 4)], deadline_s=5)
    assert out[0] == 1 and out[3] == 4
    assert isinstance(out[1], SnapguardError) and out[1].reason is Reason.PREFLIGHT_FAILED
    assert "the b check failed: ValueError: bad" in out[1].failure.detail
    assert isinstance(out[2], SnapguardError) and out[2].reason is Reason.CRIU_BROKEN
