"""snapguard-runc keeps each guarded run's record in its state directory (snapguard.shim._records):
the newest per verb and container, private, the oldest pruned, never written through a link."""

from __future__ import annotations

import json
import os
from pathlib import Path

from snapguard.shim import _records


def test_the_newest_records_are_kept_privately_and_the_oldest_pruned(tmp_path: Path) -> None:
    state = tmp_path / "state"
    for i in range(_records.KEEP + 3):
        path = _records.keep(str(state), "checkpoint", f"c{i}", {"ok": True, "i": i})
        assert path is not None
        os.utime(path, ns=(i * 10**9, i * 10**9))  # their order, whatever the clock's grain
    runs = state / _records.RUNS_DIR
    names = sorted(p.name for p in runs.iterdir())
    assert len(names) == _records.KEEP and "checkpoint-c0.json" not in names and "checkpoint-c2.json" not in names
    assert f"checkpoint-c{_records.KEEP + 2}.json" in names
    assert runs.stat().st_mode & 0o777 == 0o700 and (runs / "checkpoint-c3.json").stat().st_mode & 0o777 == 0o600
    # the same verb and container again: replaced, not added
    _records.keep(str(state), "checkpoint", "c3", {"ok": False, "reason": "CRIU_DUMP_FAILED"})
    assert json.loads((runs / "checkpoint-c3.json").read_text())["reason"] == "CRIU_DUMP_FAILED"
    assert _records.kept_path(str(state), "checkpoint", "c3") == str(runs / "checkpoint-c3.json")


def test_nothing_is_kept_through_a_link_or_for_a_strange_name(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / _records.RUNS_DIR).symlink_to(elsewhere)
    assert _records.keep(str(state), "restore", "c1", {"ok": True}) is None
    assert list(elsewhere.iterdir()) == []
    for verb, cid in (("run", "c1"), ("restore", ""), ("restore", "../x"), ("restore", "..")):
        assert _records.keep(str(tmp_path / "other"), verb, cid, {"ok": True}) is None
