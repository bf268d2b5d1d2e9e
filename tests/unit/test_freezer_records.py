"""The freezer records a killed executor leaves (snapguard.runc.FreezerGuard) are state-dir
contents a later run acts on as root: one that is not a record, names a file that is no
cgroup's freezer, or a value a freezer does not take is removed and never written through;
one whose executor still runs is left to it; the groups' sweep leaves them all to snapguard.runc."""

from __future__ import annotations

import json
import os
from pathlib import Path

from snapguard import children, procfs, runc


def _record(directory: Path, pid: int, **body: object) -> Path:
    start = procfs.start_ticks(pid)
    path = directory / f"{children.FREEZER_PREFIX}{pid}-{start}.json"
    path.write_text(json.dumps({"pid": pid, "start": start, "executor": 1 << 22, "executor_start": 1,
                                "boot": procfs.boot_id(), "container": "c", "root": None, **body}))
    return path


def test_records_that_would_write_elsewhere_are_removed_unread(tmp_path: Path) -> None:
    me = os.getpid()
    target = tmp_path.parent / f"{tmp_path.name}-freezer.state"
    target.write_text("FROZEN\n")
    hostile = [
        _record(tmp_path, me, freezer=str(target), value="THAWED"),  # not under /sys/fs/cgroup
        _record(tmp_path, os.getppid(), freezer="/sys/fs/cgroup/freezer/../../../etc/freezer.state", value="THAWED"),
        _record(tmp_path, 1, freezer="/sys/fs/cgroup/freezer/x/freezer.state", value="0"),  # v2's value, v1's file
    ]
    (tmp_path / f"{children.FREEZER_PREFIX}1-2.json").write_text("not json")
    assert children.sweep(str(tmp_path)) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(children.FREEZER_PREFIX)) == \
        sorted([p.name for p in hostile] + [f"{children.FREEZER_PREFIX}1-2.json"])  # not the groups' sweep's
    assert runc.sweep_freezers(str(tmp_path)) == [] and runc.put_back_freezers(str(tmp_path), "c", None) == []
    assert target.read_text() == "FROZEN\n"
    assert list(tmp_path.iterdir()) == []


def test_a_record_whose_executor_runs_is_its_own(tmp_path: Path) -> None:
    me = os.getpid()
    mine = _record(tmp_path, me, freezer="/sys/fs/cgroup/freezer/x/freezer.state", value="THAWED",
                   executor=me, executor_start=procfs.start_ticks(me))
    assert runc.sweep_freezers(str(tmp_path)) == [] and runc.put_back_freezers(str(tmp_path), "c", None) == []
    assert mine.exists()
