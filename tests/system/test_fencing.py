"""Fencing with the reference's semantics, driven through `snapguard` on three "nodes" (three
state directories on this host) sharing a file:// store, with a bare counter process and real
CRIU: a later restore of an image the job was restored from is ALREADY_RESTORED and leaves the
live copy unfenced; a restore whose CRIU fails after taking the epoch rolls it back; two racing
restores start one copy; a late push from the old node is FENCED and changes nothing. The race for an attempt runs on
file:// and on a real radosgw (S3 `If-None-Match: *`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from snapguard import tally
from snapguard.store import open_store
from snapguard_lab.counter import node_env as node
from snapguard_lab.counter import values, wait_lines
from snapguard_lab.targets import COUNTER
from snapguard_lab.testbed import expected_hash

pytest_plugins = ("snapguard_lab.s3",)  # rgw: one real radosgw for the session

SNAPGUARD = os.path.join(os.path.dirname(sys.executable), "snapguard")
pytestmark = pytest.mark.root  # CRIU


def sg(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([SNAPGUARD, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def reason(out: subprocess.CompletedProcess) -> str:
    return (out.stderr.splitlines() or ["(none)"])[0].split(":")[0].removeprefix("snapguard ")


def ended(pid: int | None) -> None:
    if pid:
        subprocess.run(["kill", "-9", str(pid)], check=False)


def snapshot(tmp: Path, job: str, url: str, env: dict[str, str], python: str) -> tuple[Path, str, int, int]:
    """A counter run by `python` on node a, checkpointed (stopped) and pushed: (image, its name, last
    value, lines in its log). The log stays where it is: a dump that caught the counter between its
    open and its close restores that open file by its path."""
    log = tmp / f"{job}.log"
    proc = subprocess.Popen([python, "-c", COUNTER, str(log)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_lines(log, 5)
        img = tmp / "a" / f"{job}-img"
        out = sg("checkpoint", "--pid", str(proc.pid), "--images", str(img), env=env)
        assert out.returncode == 0, out.stderr
        proc.wait(timeout=10)
    finally:
        proc.kill()
    lines = values(log)
    out = sg("push", "--images", str(img), "--store", url, "--job", job, "--json", env=env)
    assert out.returncode == 0, out.stderr
    return img, json.loads(out.stdout)["image"], lines[-1][0], len(lines)


def epochs(url: str, job: str) -> list[str]:
    return [k.rsplit("/", 1)[1] for k in open_store(url)._list(f"{job}/epochs/")]


def test_later_restore_is_refused_and_the_old_nodes_push_is_fenced(tmp_path: Path) -> None:
    """Node b restores the job (epoch 1); node c's later restore of the same image is
    ALREADY_RESTORED, takes nothing, so node b's push still goes through; --force is what takes
    a newer epoch. Node a's late push is FENCED and writes nothing."""
    url = f"file://{tmp_path}/store"
    a, b, c = (node(tmp_path / n) for n in "abc")
    img, name, last, seen = snapshot(tmp_path, "train", url, a, sys.executable)
    restored = None
    try:
        out = sg("restore", "--store", url, "--job", "train", "--images", str(tmp_path / "b" / "img"), "--json", env=b)
        assert out.returncode == 0, out.stderr
        restored = json.loads(out.stdout)["pid"]
        assert json.loads(out.stdout)["fence_epoch"] == 1
        log = tmp_path / "train.log"
        wait_lines(log, seen + 3)
        assert values(log)[seen] == (last + 1, expected_hash(last + 1))
        later = sg("restore", "--store", url, "--job", "train", "--image", name, env=c)
        assert (later.returncode, reason(later)) == (1, "ALREADY_RESTORED"), later.stderr
        assert epochs(url, "train") == ["000000000001"]
        ok = sg("push", "--images", str(img), "--store", url, "--job", "train", env=b)  # the live copy: unfenced
        assert ok.returncode == 0, ok.stderr
        store = open_store(url)
        before = store._list("")
        late = sg("push", "--images", str(img), "--store", url, "--job", "train", env=a)
        assert (late.returncode, reason(late)) == (1, "FENCED"), late.stderr
        assert store._list("") == before
        # forced, on a node whose pids are taken: refused by the preflight, before any epoch
        forced = sg("restore", "--store", url, "--job", "train", "--image", name, "--force", env=c)
        assert (forced.returncode, reason(forced)) == (1, "PID_CONFLICT"), forced.stderr
        assert store.current_epoch("train") == 1 and epochs(url, "train") == ["000000000001"]
        # each node's executor runs tallied in its state dir (the operations metrics' source)
        assert tally.load(a["SNAPGUARD_STATE_DIR"])["counts"] == {"snapshot": {"ok none": 1}}
        assert tally.load(b["SNAPGUARD_STATE_DIR"])["counts"] == {"restore": {"ok none": 1}}
        assert tally.load(c["SNAPGUARD_STATE_DIR"])["counts"]["restore"].get("failed PID_CONFLICT") == 1
    finally:
        ended(restored)


def test_failed_criu_rolls_the_epoch_back_and_racers_start_one_copy(tmp_path: Path) -> None:
    """The counter runs from a copy of the interpreter, which is then removed: node c's restore
    passes every check, takes epoch 1, and CRIU fails (the executable is missing); the epoch is
    rolled back, so node a's copy is current again and its push goes through. With the file
    back, nodes b and c race: one restores (epoch 2), the other is refused and starts nothing."""
    url = f"file://{tmp_path}/store"
    a, b, c = (node(tmp_path / n) for n in "abc")
    python = tmp_path / "py"
    shutil.copy2(os.path.realpath(sys.executable), python)
    img, name, last, seen = snapshot(tmp_path, "job2", url, a, str(python))
    python.rename(tmp_path / "py.away")
    out = sg("restore", "--store", url, "--job", "job2", "--images", str(tmp_path / "c" / "img"), "--json", env=c)
    assert (out.returncode, reason(out)) == (1, "CRIU_RESTORE_FAILED"), out.stderr
    assert epochs(url, "job2") == ["000000000001", "000000000001-aborted"]
    assert open_store(url).current_epoch("job2") == 0
    ok = sg("push", "--images", str(img), "--store", url, "--job", "job2", env=a)
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "py.away").rename(python)
    racers = [subprocess.Popen([SNAPGUARD, "restore", "--store", url, "--job", "job2", "--image", name, "--json"],
                               env={**os.environ, **env}, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for env in (b, c)]
    outs = [(r.communicate(timeout=120), r.returncode) for r in racers]
    won = [json.loads(o) for (o, _), rc in outs if rc == 0]
    try:
        lost = [(rc, (e.splitlines() or ["(none)"])[0].split(":")[0]) for (_, e), rc in outs if rc != 0]
        assert len(won) == 1 and won[0]["fence_epoch"] == 2, outs
        assert lost[0][0] == 1 and lost[0][1] in ("snapguard FENCED", "snapguard ALREADY_RESTORED",
                                                  "snapguard PID_CONFLICT"), outs
        assert epochs(url, "job2") == ["000000000001", "000000000001-aborted", "000000000002"]
        log = tmp_path / "job2.log"
        wait_lines(log, seen + 3)
        assert values(log)[seen] == (last + 1, expected_hash(last + 1))  # one copy, where node a stopped it
        late = sg("push", "--images", str(img), "--store", url, "--job", "job2", env=a)
        assert (late.returncode, reason(late)) == (1, "FENCED"), late.stderr
    finally:
        for w in won:
            ended(w["pid"])


@pytest.fixture(params=["file", "s3"])
def store_url(request, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    import uuid

    import boto3

    gw = request.getfixturevalue("rgw")
    bucket = f"sg-{uuid.uuid4().hex[:12]}"
    boto3.session.Session().client("s3", endpoint_url=gw.endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/snaps"


def test_racing_attempts_one_takes_the_epoch_and_an_aborted_one_is_never_reused(store_url: str) -> None:
    """Eight restores race for the attempt on the same image: exactly one takes epoch 1, every
    other is refused (FENCED, or ALREADY_RESTORED when it looked after the winner) and creates
    nothing; the winner's roll-back makes epoch 0 current again and the next attempt takes 2."""
    import threading

    from snapguard.reasons import Reason, SnapguardError

    store = open_store(store_url)
    results: list[object] = []
    gate = threading.Barrier(8)

    def race() -> None:
        gate.wait()
        try:
            results.append(store.attempt_epoch("job1", 0))
        except SnapguardError as e:
            results.append(e.reason)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results.count(1) == 1 and len(results) == 8, results
    assert all(r in (Reason.FENCED, Reason.ALREADY_RESTORED) for r in results if r != 1), results
    assert [k.rsplit("/", 1)[1] for k in store._list("job1/epochs/")] == ["000000000001"]
    assert store.current_epoch("job1") == 1
    assert store.abort_epoch("job1", 1, "criu failed") and not store.abort_epoch("job1", 1, "again")
    assert store.current_epoch("job1") == 0
    store.check_epoch("job1", 0)  # the old copy's writes go through again
    assert store.attempt_epoch("job1", 0) == 2
    assert store.current_epoch("job1") == 2
