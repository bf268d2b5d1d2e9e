"""The agent's snapshot schedule (snapguard.notice._schedule) over timed callables, the registry's
bounded reading, and the settings checked where they are given."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import pytest

from snapguard.notice._schedule import Target, estimate_s, measured_rate, schedule
from snapguard.notice._state import Registry
from snapguard.reasons import Reason, SnapguardError


def _timed(seconds: float, log: list, lock: threading.Lock, name: str):
    def run(left):
        with lock:
            log.append(("start", name, time.monotonic()))
        time.sleep(seconds)
        with lock:
            log.append(("end", name, time.monotonic()))
        return None
    return run


def test_two_fit_concurrently_and_the_third_falls_back():
    events, runs, lock = [], [], threading.Lock()
    rate = 100 << 20
    deadline = time.time() + 3.0
    mib = 1 << 20
    targets = [
        Target("pid:3", "big", "pid", 2000 * mib, deadline, _timed(0.1, runs, lock, "big"), lambda: "/ckpt/big"),
        Target("pid:1", "a", "pid", 50 * mib, deadline, _timed(1.0, runs, lock, "a")),
        Target("pid:2", "b", "pid", 60 * mib, deadline, _timed(1.0, runs, lock, "b")),
    ]
    start = time.monotonic()
    out = schedule(targets, notice="n1", journal=lambda ev, **f: events.append({"event": ev, **f}),
                   log=lambda line: None, rate_bps=rate, workers=2)
    took = time.monotonic() - start
    assert [o.key for o in out] == ["pid:1", "pid:2", "pid:3"]  # smallest first
    assert [o.status for o in out] == ["snapshotted", "snapshotted", "fell_back"]
    assert out[2].reason == "NOTICE_TOO_SHORT" and out[2].file_checkpoint == "/ckpt/big"
    assert "big" not in {r[1] for r in runs}  # never started
    starts = {r[1]: r[2] for r in runs if r[0] == "start"}
    ends = {r[1]: r[2] for r in runs if r[0] == "end"}
    assert starts["b"] < ends["a"] and starts["a"] < ends["b"]  # concurrent
    assert took < 1.8
    kinds = [e["event"] for e in events]
    assert kinds[0] == "schedule" and kinds[-1] == "schedule_done"
    fb = [e for e in events if e["event"] == "fell_back"]
    assert fb == [{**fb[0], "key": "pid:3", "reason": "NOTICE_TOO_SHORT", "file_checkpoint": "/ckpt/big"}]
    assert events[-1]["fit"] == ["pid:1", "pid:2"] and events[-1]["fell_back"] == {"pid:3": "NOTICE_TOO_SHORT"}


def test_a_failed_run_falls_back_typed_and_the_others_go_on():
    events = []
    from snapguard.reasons import Failure

    def bad(left):
        return Failure(Reason.CRIU_DUMP_FAILED if hasattr(Reason, "CRIU_DUMP_FAILED") else Reason.USAGE_ERROR, "no")

    def boom(left):
        raise RuntimeError("x")

    targets = [Target("pid:1", "a", "pid", 1, None, bad), Target("pid:2", "b", "pid", 2, None, boom),
               Target("pid:3", "c", "pid", 3, None, lambda left: None)]
    out = schedule(targets, notice="n", journal=lambda ev, **f: events.append({"event": ev, **f}),
                   log=lambda line: None, workers=1)
    assert [o.status for o in out] == ["fell_back", "fell_back", "snapshotted"]
    assert out[1].reason == "INTERNAL_ERROR" or out[1].reason  # typed, whatever it maps to
    assert events[-1]["fit"] == ["pid:3"]


def test_measured_rate_from_the_journal_orders_and_estimates():
    assert measured_rate([]) is None
    ev = [{"event": "snapshot_sealed", "image_bytes": 100 << 20, "seconds": 1.5}]
    assert measured_rate(ev) == pytest.approx(100 << 20)
    assert estimate_s(100 << 20, measured_rate(ev)) == pytest.approx(1.5)
    assert measured_rate([{"event": "snapshot_sealed", "image_bytes": "x", "seconds": True}]) is None


def _registry(tmp_path, doc) -> Registry:
    os.chmod(tmp_path, 0o700)
    path = tmp_path / "registry.json"
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    os.chmod(path, 0o600)
    return Registry(str(tmp_path))


def test_a_bad_registry_entry_is_skipped_and_kept(tmp_path):
    good = {"kind": "pid", "pid": 5, "start_time": 7, "job": "a", "state": "protected"}
    reg = _registry(tmp_path, {"workloads": {"pid:5": good, "pid:6": {"kind": "pid", "pid": "6", "job": "b"},
                                             "pid:7": [1, 2]}})
    assert list(reg.load()) == ["pid:5"]
    assert set(reg.refused) == {"pid:6", "pid:7"} and "AGENT_STATE_INVALID" in reg.refused["pid:6"]
    reg.update("pid:5", state="gone")
    saved = json.loads((tmp_path / "registry.json").read_text())["workloads"]
    assert saved["pid:7"] == [1, 2] and saved["pid:5"]["state"] == "gone"


@pytest.mark.parametrize("doc", [b"{" * 5000, b"[]", b"not json", b'{"workloads": []}', b" " * (5 << 20)])
def test_a_corrupt_registry_is_typed_and_never_overwritten(tmp_path, doc):
    reg = _registry(tmp_path, doc)
    with pytest.raises(SnapguardError) as e:
        reg.load()
    assert e.value.reason is Reason.AGENT_STATE_INVALID
    with pytest.raises(SnapguardError):
        with reg.locked():
            pass
    assert (tmp_path / "registry.json").read_bytes() == doc


def test_settings_refused_where_they_are_given(tmp_path):
    from snapguard.cli.agent import _check_store, interval_seconds
    from snapguard.cli.protect import epoch_number
    from snapguard.notice._state import check_job

    with pytest.raises(SnapguardError) as e:
        _check_store("ftp://host/x")
    assert e.value.reason is Reason.USAGE_ERROR
    _check_store(f"file://{tmp_path}")
    for bad in ("0.000001", "0", "1e9"):
        with pytest.raises(argparse.ArgumentTypeError):
            interval_seconds(bad)
    assert interval_seconds("5") == 5.0
    with pytest.raises(argparse.ArgumentTypeError):
        epoch_number("-1")
    assert epoch_number("3") == 3
    for job in ("", ".x", "a/b", "a b", "x" * 200):
        with pytest.raises(SnapguardError):
            check_job(job)
    assert check_job("train-1") == "train-1"


def test_the_fallback_skips_a_bad_file_checkpoint_record_for_an_older_good_one(tmp_path):
    from snapguard.notice._targets import fallback_for
    from snapguard.store import open_store

    root = tmp_path / "store"
    root.mkdir()
    url = f"file://{root}"
    store = open_store(url)
    store.register_file_checkpoint("job-a", "/ckpt/good.pt")
    time.sleep(0.01)
    newer = store.register_file_checkpoint("job-a", "/ckpt/newer.pt")
    (root / "job-a" / "file-checkpoints" / f"{newer}.json").write_text('{"location": [' * 40)
    assert fallback_for({"job": "job-a"}, url)() == "/ckpt/good.pt"
    assert fallback_for({"job": "job-a", "file_checkpoint": "/x"}, url)() == "/x"
    events = []
    out = schedule([Target("pid:1", "job-a", "pid", 1 << 40, time.time() + 2, lambda left: None,
                           fallback_for({"job": "job-a"}, url))], notice="n",
                   journal=lambda ev, **f: events.append({"event": ev, **f}), log=lambda line: None)
    assert out[0].file_checkpoint == "/ckpt/good.pt" and out[0].reason == "NOTICE_TOO_SHORT"


def test_the_agent_probes_its_store_at_start(tmp_path):
    from snapguard.notice._upload import Uploads

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    said, journal = [], []
    up = Uploads(f"file://{blocker}/store", None, journal=lambda ev, **f: journal.append({"event": ev, **f}),
                 log=said.append, registry=None, discard=None)
    prom = tmp_path / "agent.prom"
    assert up.probe(str(prom)) is False
    assert journal[0]["writable"] is False and journal[0]["record"]["reason"] == "STORE_NOT_WRITABLE"
    assert said and said[0].startswith("WARNING: snapguard STORE_NOT_WRITABLE")
    assert "snapguard_agent_store_writable 0.0" in prom.read_text()
    good = tmp_path / "good"
    good.mkdir()
    up = Uploads(f"file://{good}", None, journal=lambda ev, **f: journal.append({"event": ev, **f}),
                 log=said.append, registry=None, discard=None)
    assert up.probe(str(prom)) is True and "snapguard_agent_store_writable 1.0" in prom.read_text()
    assert not [p for p in good.rglob("*") if p.is_file()]  # the probe object is gone
