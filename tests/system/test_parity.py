"""Every guarantee either entry point gives holds on both: each test runs once through `snapguard
checkpoint/restore` on a bare process tree and once through `snapguard-runc checkpoint/restore` on
a runc container (snapguard_lab.targets), with real runc and CRIU.

The guarantees, one test each:
- a blocked preflight changes nothing;
- a leave-running checkpoint, then a stop checkpoint and its restore, continue exactly, and the
  image and the record are what the contract says (modes, manifest, marker, timings);
- a seal that fails is IMAGE_WRITE_FAILED, not a traceback, and marks nothing;
- the take point's wait comes from the config (`take_wait_s`) on both paths;
- a CRIU dump failure quotes CRIU's `Error (file:line)` lines and leaves the workload running;
- a restore refuses a changed image (IMAGE_CORRUPT) and an unmarked one (IMAGE_INCOMPLETE) before
  CRIU runs.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from snapguard import image
from snapguard.names import MANIFEST_NAME, MARKER_NAME, RESTORE_LOG
from snapguard_lab.targets import IDLE_TRAINER, KINDS, RuncTarget, Target, make_target, typed_lines
from snapguard_lab.testbed import expected_hash

pytestmark = pytest.mark.timeout(180)

# CRIU 4.2.1 criu/include/fault-injection.h: FI_DUMP_PAGES fails the page dump (criu/mem.c,
# `pr_err("fault: Dump VMA pages failure!")`) after the tree is seized and infected
FI_DUMP_PAGES = "3"


@pytest.fixture(params=KINDS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    t = make_target(request.param, tmp_path / "target")
    try:
        t.start()
        yield t
    finally:
        t.stop()


@pytest.fixture(params=KINDS)
def trainer(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """The counter in a process that imported torch's optimizers, run with the take-point hook,
    that never ends an optimizer step."""
    t = make_target(request.param, tmp_path / "trainer", script=IDLE_TRAINER, hook=True)
    try:
        t.start(lines=3)
        yield t
    finally:
        t.stop()


def failed(t: Target, out: Any, reason: str) -> str:
    """The run failed with exactly one typed line of `reason`, and no traceback; that line.
    Through snapguard-runc the same line is the last of runc's --log, which containerd shows."""
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = typed_lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"snapguard {reason}: "), out.stderr
    if isinstance(t, RuncTarget):
        assert t.runc_log_messages()[-1] == lines[0]
    return lines[0]


def still_running(t: Target) -> None:
    assert t.alive(), "the workload is gone"
    assert t.advancing(), "the workload stopped advancing"
    assert t.log.chain_errors() == []


def no_marker(images: Path) -> None:
    assert not (images / MARKER_NAME).exists(), f"a failed run marked {images} complete"


def check_sealed(t: Target, images: Path, record: dict[str, Any], leave_running: bool) -> dict[str, Any]:
    """The image is root's alone and whole; the manifest and the record say what the contract says."""
    assert stat.S_IMODE(os.lstat(images).st_mode) == 0o700
    modes = {p.name: os.lstat(p).st_mode for p in images.iterdir()}
    assert all(stat.S_ISREG(m) for m in modes.values()), modes
    assert {n: oct(stat.S_IMODE(m)) for n, m in modes.items() if stat.S_IMODE(m) != 0o600} == {}
    assert {MANIFEST_NAME, MARKER_NAME} <= set(modes)
    manifest = image.verify(str(images)).to_json()
    assert manifest["leave_running"] is leave_running
    assert "network_lock" in manifest
    assert manifest["processes"] and all({"pid", "nspid"} <= set(p) for p in manifest["processes"])
    if t.kind == "runc":
        assert 1 in {p["nspid"] for p in manifest["processes"]}  # the container's init, in its namespace
    assert record["ok"] is True and record["operation"] == "checkpoint"
    assert {"preflight_s", "dump_s", "seal_s", "total_s"} <= set(record["timings"]), record["timings"]
    assert isinstance(record["criu_marks"], dict) and "dumped" in record["criu_marks"], record["criu_marks"]
    return manifest


def test_blocked_preflight_changes_nothing(target: Target, tmp_path: Path) -> None:
    target.configure(criu=str(tmp_path / "no-such-criu"))
    images, work = tmp_path / "img", tmp_path / "work"
    # a stop checkpoint: the one that would end the workload had it gone on
    out = target.checkpoint(images, work)
    line = failed(target, out, "CRIU_MISSING")
    assert str(tmp_path / "no-such-criu") in line
    assert not images.exists(), "a refused checkpoint made the image directory"
    record = target.record(images, work)
    if target.kind == "bare":
        assert record is None  # `snapguard checkpoint` writes its record only into an existing image dir
        # ... so ask again with the directory there: the record, and nothing else
        images.mkdir(mode=0o700)
        failed(target, target.checkpoint(images, work), "CRIU_MISSING")
        record = target.record(images, work)
        assert sorted(p.name for p in images.iterdir()) == ["snapguard-result.json"]
    assert record is not None
    assert record["reason"] == "CRIU_MISSING" and record["phase"] == "preflight"
    assert record["workload_intact"] is True and record["ok"] is False
    still_running(target)


def test_leave_running_then_stop_and_restore_continue_exactly(target: Target, tmp_path: Path) -> None:
    live, live_work = tmp_path / "live", tmp_path / "live-work"
    out = target.checkpoint(live, live_work, leave_running=True)
    assert out.returncode == 0, out.stderr
    assert typed_lines(out.stderr) == []
    still_running(target)
    check_sealed(target, live, target.record(live, live_work) or {}, leave_running=True)

    stop, stop_work = tmp_path / "stop", tmp_path / "stop-work"
    out = target.checkpoint(stop, stop_work)
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 10
    while target.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not target.alive(), "a stop checkpoint left the workload running"
    check_sealed(target, stop, target.record(stop, stop_work) or {}, leave_running=False)
    rows = target.values()
    last = rows[-1][0]
    time.sleep(0.3)
    assert target.values() == rows, "the workload wrote after its stop checkpoint"

    restore_work = tmp_path / "restore-work"
    out = target.restore(stop, restore_work)
    assert out.returncode == 0, out.stderr
    record = target.record(stop, restore_work)
    assert record is not None and record["ok"] is True and record["operation"] == "restore"
    assert {"preflight_s", "restore_s", "total_s"} <= set(record["timings"]), record["timings"]
    still_running(target)
    assert target.values()[len(rows)] == (last + 1, expected_hash(last + 1)), "did not continue where it stopped"


@pytest.mark.parametrize("leave_running", [True, False], ids=["leave-running", "stop"])
def test_failed_seal_is_typed(target: Target, tmp_path: Path, leave_running: bool) -> None:
    """A directory planted in the image dir before the dump: CRIU ignores it, sealing refuses it."""
    images, work = tmp_path / "img", tmp_path / "work"
    images.mkdir(mode=0o700)
    (images / "planted").mkdir()
    out = target.checkpoint(images, work, leave_running=leave_running)
    failed(target, out, "IMAGE_WRITE_FAILED")
    no_marker(images)
    record = target.record(images, work)
    assert record is not None and record["reason"] == "IMAGE_WRITE_FAILED"
    if leave_running:
        assert record["workload_intact"] is True
        still_running(target)
    elif target.alive():
        still_running(target)  # refused before the dump
    else:
        # CRIU stopped the workload and the image cannot be sealed: the record must say so
        assert record["workload_intact"] is False, \
            f"the workload is gone but the record says workload_intact={record['workload_intact']}"
    # whatever was dumped cannot be restored through snapguard: it was never marked whole
    restore_work = tmp_path / "restore-work"
    refused = target.restore(images, restore_work)
    failed(target, refused, "IMAGE_INCOMPLETE")


def test_take_wait_comes_from_the_config(trainer: Target, tmp_path: Path) -> None:
    """A trainer that runs the take-point hook but never ends a step is waited for `take_wait_s`
    seconds of the config (2 here; the default is 10), then the snapshot goes on. It goes as far
    as CRIU's page dump, which fails (CRIU_FAULT): no memory is written, and the failure's record
    carries the take point's warning."""
    trainer.configure(take_wait_s=2)
    images, work = tmp_path / "img", tmp_path / "work"
    t0 = time.monotonic()
    out = trainer.checkpoint(images, work, leave_running=True, extra_env={"CRIU_FAULT": FI_DUMP_PAGES})
    took = time.monotonic() - t0
    failed(trainer, out, "CRIU_DUMP_FAILED")
    record = trainer.record(images, work)
    assert record is not None
    waits = [w for w in record["warnings"] if w["reason"] == "TAKE_POINT_TIMEOUT"]
    assert len(waits) == 1 and "within 2 s" in waits[0]["detail"], record["warnings"]
    assert 2 <= took < 10, took
    still_running(trainer)


def test_criu_dump_failure_quotes_criu_errors(target: Target, tmp_path: Path) -> None:
    images, work = tmp_path / "img", tmp_path / "work"
    # a stop checkpoint: had the dump succeeded, the workload would be gone
    out = target.checkpoint(images, work, extra_env={"CRIU_FAULT": FI_DUMP_PAGES})
    line = failed(target, out, "CRIU_DUMP_FAILED")
    assert re.search(r"Error \(criu/mem\.c:\d+\): fault: Dump VMA pages failure!", line), line
    record = target.record(images, work)
    assert record is not None and record["reason"] == "CRIU_DUMP_FAILED" and record["workload_intact"] is True
    assert any(e["where"].startswith("criu/mem.c:") for e in record["evidence"]["errors"]), record["evidence"]
    no_marker(images)
    still_running(target)


def test_restore_refuses_changed_and_unmarked_images(target: Target, tmp_path: Path) -> None:
    images, work = tmp_path / "img", tmp_path / "work"
    assert target.checkpoint(images, work, leave_running=True).returncode == 0
    pid = target.pid()

    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0x01
    pages.write_bytes(bytes(data))
    restore_work = tmp_path / "restore-work"
    line = failed(target, target.restore(images, restore_work), "IMAGE_CORRUPT")
    assert pages.name in line
    record = target.record(images, restore_work)
    assert record is not None and record["reason"] == "IMAGE_CORRUPT" and record["phase"] == "restore"
    assert not (images / RESTORE_LOG).exists() and not (restore_work / RESTORE_LOG).exists(), "CRIU ran"

    (images / MARKER_NAME).unlink()
    restore_work = tmp_path / "restore-work-2"
    failed(target, target.restore(images, restore_work), "IMAGE_INCOMPLETE")
    record = target.record(images, restore_work)
    assert record is not None and record["reason"] == "IMAGE_INCOMPLETE"
    assert not (images / RESTORE_LOG).exists() and not (restore_work / RESTORE_LOG).exists(), "CRIU ran"
    assert target.pid() == pid  # nothing was restored over the running workload
    still_running(target)

