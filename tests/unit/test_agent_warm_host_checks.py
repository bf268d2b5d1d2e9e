"""The agent's warm host checks (`WarmHostChecks`): run at start and then every `every_s` in a
thread of their own; `latest()` hands the newest result no older than `max_age_s`, never waits
for a run under way, and the thread stops with the agent. No run starts while a notice is acted on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from snapguard.config import Config, load
from snapguard.notice import _agent
from snapguard.notice._warm import WarmHostChecks
from snapguard.preflight import CheckResult, HostChecks
from snapguard.reasons import Finding, Reason


@pytest.fixture
def config(tmp_path: Path) -> Config:
    f = tmp_path / "config.toml"
    f.write_text("")
    return load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")})


def checks(config: Config, age_s: float = 0.0) -> HostChecks:
    return HostChecks(config.as_dict(), {}, (("privileges", (), CheckResult("privileges"), {}),), 0.01,
                      started=time.monotonic() - age_s)


def wait_for(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_none_before_the_first_run_then_fresh_then_stale(config: Config) -> None:
    made: list[HostChecks] = []

    def run(c: Config) -> HostChecks:
        made.append(checks(c))
        return made[-1]

    warm = WarmHostChecks(config, every_s=0.2, max_age_s=0.5, run=run)
    assert warm.max_age_s == 0.5 and warm.latest() is None  # nothing run yet
    assert warm.refresh() is made[0] and warm.latest() is made[0]
    time.sleep(0.6)
    assert warm.latest() is None  # older than max_age_s: not handed
    assert WarmHostChecks(config, every_s=30, run=run).max_age_s == 60  # default: twice the period


def test_a_stale_result_is_not_handed(config: Config) -> None:
    warm = WarmHostChecks(config, every_s=60, run=lambda c: checks(c, age_s=121))
    warm.refresh()
    assert warm.latest() is None
    warm = WarmHostChecks(config, every_s=60, run=lambda c: checks(c, age_s=119))
    warm.refresh()
    got = warm.latest()
    assert got is not None and 119 <= got.age_s() < 121


def test_the_thread_refreshes_and_stops(config: Config) -> None:
    said: list[tuple[HostChecks | None, str | None]] = []
    warm = WarmHostChecks(config, every_s=0.05, run=checks, said=lambda v, e: said.append((v, e)))
    warm.start()
    try:
        wait_for(lambda: warm.runs >= 3)
        first = warm.latest()
        assert first is not None
        wait_for(lambda: warm.latest() is not first)  # replaced by a newer run
        assert [t.name for t in threading.enumerate()].count(WarmHostChecks.THREAD) == 1
    finally:
        warm.stop()
    assert not warm.running and WarmHostChecks.THREAD not in [t.name for t in threading.enumerate()]
    runs = warm.runs
    time.sleep(0.2)
    assert warm.runs == runs  # no run after stop
    assert said and all(v is not None and e is None for v, e in said)


def test_latest_never_waits_for_a_run_under_way(config: Config) -> None:
    release = threading.Event()
    started = threading.Event()
    first = checks(config)

    def run(c: Config) -> HostChecks:
        if started.is_set():
            release.wait(30)  # the second run hangs (a wedged check, under its own deadline)
        started.set()
        return first if not release.is_set() else checks(c)

    warm = WarmHostChecks(config, every_s=0.01, max_age_s=60, run=run)
    warm.start()
    try:
        wait_for(lambda: warm.latest() is first)
        time.sleep(0.1)  # the second run is under way, hung
        t = time.monotonic()
        assert warm.latest() is first and time.monotonic() - t < 0.05
    finally:
        release.set()
        warm.stop()
    assert not warm.running


def test_stop_does_not_wait_past_its_bound_for_a_run_under_way(config: Config) -> None:
    release = threading.Event()

    def run(c: Config) -> HostChecks:
        release.wait(30)
        return checks(c)

    warm = WarmHostChecks(config, every_s=60, run=run)
    warm.start()
    time.sleep(0.05)
    t = time.monotonic()
    warm.stop(wait_s=0.2)
    assert time.monotonic() - t < 1.0 and warm.latest() is None
    release.set()
    wait_for(lambda: not warm.running)  # it ends once its run does, and starts no other
    assert warm.runs == 1


def test_a_run_that_raises_keeps_the_previous_result_to_age_out(config: Config) -> None:
    results: list[object] = [checks(config), RuntimeError("NVML fell over")]
    said: list[tuple[HostChecks | None, str | None]] = []

    def run(c: Config) -> HostChecks:
        got = results.pop(0)
        if isinstance(got, Exception):
            raise got
        assert isinstance(got, HostChecks)
        return got

    warm = WarmHostChecks(config, every_s=60, run=run, said=lambda v, e: said.append((v, e)))
    first = warm.refresh()
    assert warm.refresh() is None and warm.latest() is first
    assert said[-1][0] is None and "NVML fell over" in str(said[-1][1])


def test_no_run_starts_while_a_notice_is_acted_on(config: Config) -> None:
    warm = WarmHostChecks(config, every_s=0.02, run=checks)
    with warm.acting():
        warm.start()
        time.sleep(0.3)
        assert warm.runs == 0 and warm.latest() is None
    try:
        wait_for(lambda: warm.runs >= 1)
    finally:
        warm.stop()


def test_every_must_be_positive(config: Config) -> None:
    with pytest.raises(ValueError):
        WarmHostChecks(config, every_s=0)


def test_the_agent_journals_what_the_warm_checks_say_only_when_it_changes(config: Config) -> None:
    agent = _agent.Agent(config, [], host_checks_every_s=60)
    ok = checks(config)
    blocked = HostChecks(config.as_dict(), {}, (("criu", ("/x",), CheckResult("criu", findings=[
        Finding(Reason.CRIU_CHECK_FAILED, "no")]), {}),), 0.01, started=time.monotonic())
    for value, error in ((ok, None), (ok, None), (blocked, None), (None, "it raised"), (None, "it raised"), (ok, None)):
        agent._note_host_checks(value, error)
    said = [e for e in agent.read_journal() if e["event"] == "host_checks"]
    assert [e.get("checks") or e.get("error") for e in said] == [
        {"privileges": "ok"}, {"criu": "CRIU_CHECK_FAILED"}, "it raised", {"privileges": "ok"}]
