"""The torch drill's machinery on the CPU: the same arms as on the GPU (leave-running and stop
snapshots, untrimmed and trimmed, the file-checkpoint baseline, the runc container through
snapguard-runc) with a small model, through the real CRIU and runc, compared bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snapguard.config import load
from snapguard_lab.torch_drill import run_torch_drill

pytest.importorskip("torch")  # in the test extra: a skip here means the install is broken

pytestmark = pytest.mark.stack  # CRIU, runc

SMALL_CPU = ("--device", "cpu", "--width", "48", "--layers", "1", "--batch", "1")


def test_drill_arms_bit_identical_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("SNAPGUARD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("SNAPGUARD_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "drill.json"
    rc = run_torch_drill(load(), str(tmp_path / "work"), steps=40, at=15, json_path=str(out),
                         arms=("snapshots", "file", "container"), trainer_args=SMALL_CPU)
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["arm"]: r for r in report["rows"]}
    assert rc == 0 and report["ok"], printed
    assert set(rows) == {"reference", "leave-running-untrimmed", "leave-running-trimmed", "stop-untrimmed",
                         "stop-trimmed", "file-checkpoint", "container-stop-trimmed"}
    for name in ("stop-trimmed", "container-stop-trimmed"):
        row = rows[name]
        assert row["bit_identical"] and row["steps_compared"] == 40
        assert row["first_new_step"] == row["snapshot_at_step"] + 1 or row["first_new_step"] > 15
        (figures,) = row["take_point"].values()
        assert figures["ok"] and figures["host_anon_after"] > 0
        # where the time went, read from CRIU's own logs
        assert {"seized", "dump_pages", "dumped"} <= set(row["dump_marks"])
        assert "fork" in row["restore_marks"]
    assert rows["leave-running-trimmed"]["stall_s"] >= 0
    assert rows["file-checkpoint"]["stall_s"] > 0 and rows["file-checkpoint"]["bit_identical"]
    assert "torch drill: PASS" in printed
    # nothing stays mounted in the drill's directory: removing it must not reach the host
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if str(tmp_path) in line]


def test_drill_refuses_a_used_workdir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "old.log").write_text("step 1 0 0 0\n")
    assert run_torch_drill(load({}), str(tmp_path), arms=("snapshots",)) == 2
    assert "is not empty" in capsys.readouterr().err
