"""Host checks run ahead of the image (`preflight.host_checks_ahead`, what a restore --from runs
while it fetches) and reused by the manifest's preflight (`manifest_report(..., ahead=)`): what
matches the manifest's needs is taken as it was, what differs or is missing runs then, and the
report, its order and its typed refusal are those of a preflight that ran everything itself."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from snapguard import image, preflight
from snapguard.config import Config, load
from snapguard.preflight import gpu, host
from snapguard.procfs import host_facts
from snapguard.reasons import Finding, Reason, SnapguardError


class Calls(Counter[str]):
    """The host checks' calls (the CUDA plugin's by `required`); `lock_blocked`: the network lock
    check finds no iptables."""

    lock_blocked = False


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """Every host check a stand-in that counts its calls."""
    seen = Calls()

    def privileges() -> list[Finding]:
        seen["privileges"] += 1
        return []

    def criu(path: str, state_dir: str | None, facts: dict[str, object]) -> list[Finding]:
        seen["criu"] += 1
        facts["criu_version"] = "4.2.1"
        return []

    def network_lock() -> list[Finding]:
        seen["network-lock"] += 1
        if seen.lock_blocked:
            return [Finding(Reason.NETWORK_LOCK_UNAVAILABLE, "no iptables-restore here")]
        return []

    def cuda_plugin(config: Config, required: bool) -> list[Finding]:
        seen[f"cuda-plugin:{required}"] += 1
        return [Finding(Reason.CUDA_PLUGIN_UNAVAILABLE, "no CUDA plugin")] if required else []

    def gpu_facts() -> None:
        seen["nvml"] += 1
        return None

    monkeypatch.setattr(host, "check_privileges", privileges)
    monkeypatch.setattr(host, "check_criu", criu)
    monkeypatch.setattr(host, "check_network_lock", network_lock)
    monkeypatch.setattr(host, "check_cuda_plugin", cuda_plugin)
    monkeypatch.setattr(gpu, "gpu_facts", gpu_facts)
    return seen


@pytest.fixture
def config(tmp_path: Path) -> Config:
    f = tmp_path / "config.toml"
    f.write_text("")
    return load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")})


def sealed(tmp_path: Path, *, gpu_process: bool = False, own_netns: bool = False) -> str:
    d = tmp_path / ("gpu" if gpu_process else "cpu") / ("own" if own_netns else "host")
    d.mkdir(mode=0o700, parents=True)
    (d / "pages-1.img").write_bytes(os.urandom(4096))
    image.seal(str(d), {"criu_version": "4.2.1", "host": host_facts(), "own_netns": own_netns,
                        "tcp_connections": 0, "network_lock": "skip" if not own_netns else None,
                        "processes": [{"pid": 4242, "comm": "train", "gpu": gpu_process,
                                       "gpu_memory_bytes": 0, "rss_bytes": 4096}]})
    return str(d)


def shape(report: preflight.Report) -> list[tuple[str, str, list[str]]]:
    return [(c.name, c.status, [f.reason.name for f in c.findings]) for c in report.checks]


def refusal(report: preflight.Report) -> Reason | None:
    try:
        report.raise_blockers()
    except SnapguardError as e:
        return e.reason
    return None


def test_preflight_reuses_the_host_checks_run_ahead(calls: Calls, config: Config, tmp_path: Path) -> None:
    ahead = preflight.host_checks_ahead(config, gpu_required=False)
    assert calls == Counter({"privileges": 1, "criu": 1, "network-lock": 1, "cuda-plugin:False": 1, "nvml": 1})
    assert ahead.seconds > 0 and ahead.host == host_facts()
    img = sealed(tmp_path)
    report = preflight.manifest_report(img, config, exact=True, ahead=ahead)
    assert calls == Counter({"privileges": 1, "criu": 1, "network-lock": 1, "cuda-plugin:False": 1, "nvml": 1})
    assert report.host.criu_version == "4.2.1" and report.host.knows("gpu") and report.host.gpu is None
    # the same report as a preflight that runs the host checks itself: the network lock this
    # image (host netns, no connections) does not need is dropped, not reported
    plain = preflight.manifest_report(img, config, exact=True)
    assert shape(report) == shape(plain) and "network-lock" not in [c.name for c in report.checks]
    assert report.exit_code == plain.exit_code == preflight.EXIT_READY


def test_preflight_runs_what_the_manifest_needs_beyond_the_ahead_run(calls: Calls, config: Config,
                                                                     tmp_path: Path) -> None:
    """Ahead: no GPU, no network lock assumed. A GPU image in a namespace of its own needs both:
    the CUDA plugin is checked again as required, the network lock for the first time; the rest
    is not run again."""
    ahead = preflight.host_checks_ahead(config, gpu_required=False, network_lock=False)
    calls.clear()
    img = sealed(tmp_path, gpu_process=True, own_netns=True)
    report = preflight.manifest_report(img, config, exact=True, ahead=ahead)
    assert calls == Counter({"network-lock": 1, "cuda-plugin:True": 1})
    plain = preflight.manifest_report(img, config, exact=True)
    assert shape(report) == shape(plain)
    assert refusal(report) is refusal(plain) is Reason.CUDA_PLUGIN_UNAVAILABLE


def test_preflight_refuses_with_the_reason_of_an_ahead_blocker_only_where_it_applies(
        calls: Calls, config: Config, tmp_path: Path) -> None:
    calls.lock_blocked = True
    ahead = preflight.host_checks_ahead(config, gpu_required=False)
    assert [c.status for c in ahead_checks(ahead) if c.name == "network-lock"] == ["blocked"]
    needs_lock = preflight.manifest_report(sealed(tmp_path, own_netns=True), config, exact=True, ahead=ahead)
    assert refusal(needs_lock) is Reason.NETWORK_LOCK_UNAVAILABLE
    calls.clear()
    no_lock = preflight.manifest_report(sealed(tmp_path), config, exact=True, ahead=ahead)
    assert refusal(no_lock) is None and not calls


def ahead_checks(ahead: preflight.HostChecks) -> list[preflight.CheckResult]:
    return [r for _, _, r, _ in ahead.results]


def test_preflight_ahead_of_another_config_is_not_reused(calls: Calls, config: Config,
                                                         tmp_path: Path) -> None:
    ahead = preflight.host_checks_ahead(config, gpu_required=False)
    other = tmp_path / "other.toml"
    other.write_text("")
    elsewhere = load({"SNAPGUARD_CONFIG": str(other), "SNAPGUARD_STATE_DIR": str(tmp_path / "other-state")})
    calls.clear()
    preflight.manifest_report(sealed(tmp_path), elsewhere, exact=True, ahead=ahead)
    assert calls == Counter({"privileges": 1, "criu": 1, "cuda-plugin:False": 1, "nvml": 1})


def test_preflight_with_an_image_refused_runs_no_host_check(calls: Calls, config: Config,
                                                            tmp_path: Path) -> None:
    ahead = preflight.host_checks_ahead(config)
    calls.clear()
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    report = preflight.manifest_report(str(empty), config, exact=True, ahead=ahead)
    assert [c.name for c in report.checks] == ["image"] and not calls
    assert refusal(report) is Reason.IMAGE_INCOMPLETE


def test_a_snapshot_reuses_only_what_passed_and_reads_nvml_anew(calls: Calls, config: Config) -> None:
    """What a snapshot takes from warm host checks (the agent's): those that passed, never NVML's
    inventory (it names the CUDA pids of the moment), nor a check that was blocked then: that one
    runs now, and the report and its refusal are those of a preflight that ran everything."""
    from snapguard.pipeline.checkpoint import FRESH_HOST_CHECKS

    calls.lock_blocked = True
    ahead = preflight.host_checks_ahead(config, gpu_required=False)
    reusable = ahead.passed(leave=FRESH_HOST_CHECKS)
    assert [name for name, *_ in reusable.results] == ["privileges", "criu", "cuda-plugin"]
    assert reusable.started == ahead.started and ahead.age_s() >= 0
    calls.clear()
    report = preflight.Report("--pid 1")
    preflight.host_checks(report, config, gpu_required=False, network_lock=True, ahead=reusable)
    assert calls == Counter({"network-lock": 1, "nvml": 1})
    plain = preflight.Report("--pid 1")
    preflight.host_checks(plain, config, gpu_required=False, network_lock=True)
    assert shape(report) == shape(plain) and report.host.criu_version == "4.2.1"
    assert refusal(report) is refusal(plain) is Reason.NETWORK_LOCK_UNAVAILABLE
    # the lock fixed since: the snapshot passes, not refused by the old result
    calls.lock_blocked = False
    again = preflight.Report("--pid 1")
    preflight.host_checks(again, config, gpu_required=False, network_lock=True, ahead=reusable)
    assert refusal(again) is None
    # a GPU tree needs the CUDA plugin as required: checked anew, with today's reason
    calls.clear()
    gpu_tree = preflight.Report("--pid 1")
    preflight.host_checks(gpu_tree, config, gpu_required=True, network_lock=False, ahead=reusable)
    assert calls == Counter({"cuda-plugin:True": 1, "nvml": 1})
    assert refusal(gpu_tree) is Reason.CUDA_PLUGIN_UNAVAILABLE


def test_the_agents_warm_run_leaves_nvml_alone(calls: Calls, config: Config) -> None:
    """The agent's warm host checks do not call NVML (the snapshot never reuses its inventory)."""
    from snapguard.notice._warm import warm_run

    warm = warm_run(config)
    assert calls["nvml"] == 0 and calls["privileges"] == calls["criu"] == 1
    assert [name for name, *_ in warm.results] == ["privileges", "criu", "network-lock", "cuda-plugin"]
