"""`snapguard checkpoint --pid` / `snapguard restore --images` on real processes with real CRIU."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from snapguard import image, prefetch
from snapguard.takepoint import protocol
from snapguard.config import load
from snapguard_lab.counter import values, wait_lines
from snapguard_lab.targets import COUNTER
from snapguard_lab.testbed import MODULUS, expected_hash


def snapguard(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "snapguard")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    return {"SNAPGUARD_CONFIG": str(cfg), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}


@pytest.fixture
def counter(tmp_path: Path):
    log = tmp_path / "counter.log"
    proc = subprocess.Popen([sys.executable, "-c", COUNTER, str(log)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_lines(log, 10)
    yield proc, log
    proc.kill()
    proc.wait()


def test_leave_running_then_stop_and_restore(counter, env: dict[str, str], tmp_path: Path) -> None:
    proc, log = counter
    images = tmp_path / "img"
    out = snapguard("checkpoint", "--pid", str(proc.pid), "--images", str(images), "--leave-running", "--json",
                    env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] and result["image_bytes"] > 0 and result["leave_running"]
    n = len(values(log))
    wait_lines(log, n + 5)  # still running
    assert (images / image.MARKER_NAME).exists()
    assert (os.stat(images).st_mode & 0o777) == 0o700

    # the original still holds its pid: refused before CRIU runs
    busy = snapguard("restore", "--images", str(images), env=env)
    assert busy.returncode == 1 and busy.stderr.startswith("snapguard PID_CONFLICT: ")

    stop = tmp_path / "stop"
    out = snapguard("checkpoint", "--pid", str(proc.pid), "--images", str(stop), env=env)
    assert out.returncode == 0, out.stderr
    proc.wait(timeout=10)
    last = values(log)[-1][0]
    log.rename(tmp_path / "before.log")
    out = snapguard("restore", "--images", str(stop), "--json", env=env)
    assert out.returncode == 0, out.stderr
    restored = json.loads(out.stdout)["pid"]
    try:
        wait_lines(log, 5)
        first = values(log)[0]
        assert first == (last + 1, expected_hash(last + 1))  # exactly where it stopped
        assert all(b == (a[0] + 1, (a[1] * 31 + a[0] + 1) % MODULUS) for a, b in zip(values(log), values(log)[1:]))
    finally:
        subprocess.run(["kill", "-9", str(restored)], check=False)


def test_corrupt_image_refused_with_json_record(counter, env: dict[str, str], tmp_path: Path) -> None:
    proc, _ = counter
    images = tmp_path / "img"
    assert snapguard("checkpoint", "--pid", str(proc.pid), "--images", str(images), "--leave-running",
                     env=env).returncode == 0
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[-1] ^= 0xFF
    pages.write_bytes(bytes(data))
    out = snapguard("restore", "--images", str(images), "--json", env=env)
    assert out.returncode == 1 and out.stderr.startswith("snapguard IMAGE_CORRUPT: ")
    record = json.loads(out.stdout)
    assert record["reason"] == "IMAGE_CORRUPT" and record["phase"] == "restore"
    assert not (images / "restore.log").exists()


def test_missing_pid_is_typed(env: dict[str, str], tmp_path: Path) -> None:
    out = snapguard("checkpoint", "--pid", str(2**22 + 11), "--images", str(tmp_path / "i"), env=env)
    assert out.returncode == 1 and out.stderr.startswith("snapguard PROCESS_NOT_FOUND: ")
    assert "Traceback" not in out.stderr and not (tmp_path / "i").exists()


HELD_TRAINER = """
import sys, time, torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
i = h = 0
while True:
    opt.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # the take point holds the trainer here, after a whole step
    i += 1
    h = (h * 31 + i) % 1000000007
    with open(sys.argv[1], "a") as f:
        f.write(f"{i} {h}\\n")
    time.sleep(0.01)
"""


MOVED_TRAINER = """
import hashlib, sys, time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
x = torch.randn(16, 64)
i = 0
while True:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()  # the take point holds the trainer here
    i += 1
    # a copy's bytes: .numpy() on a parameter itself would make its storage not resizable
    digest = hashlib.sha256(b"".join(p.detach().clone().numpy().tobytes() for p in model.parameters())).digest()
    with open(sys.argv[1], "a") as f:
        f.write(f"{i} {int.from_bytes(digest[:6], 'big')}\\n")
    time.sleep(0.01)
"""


def _moved_trainer_reference(steps: int) -> dict[int, int]:
    """MOVED_TRAINER's lines, computed here without any snapshot."""
    import hashlib

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        x = torch.randn(16, 64)
        out = {}
        for i in range(1, steps + 1):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            digest = hashlib.sha256(b"".join(p.detach().clone().numpy().tobytes()
                                             for p in model.parameters())).digest()
            out[i] = int.from_bytes(digest[:6], "big")
        return out
    finally:
        torch.set_num_threads(threads)


HOLD_S = 8  # the trainer's hold limit: well past a snapshot on a busy CI machine


def test_take_point_moves_the_optimizers_tensors_through_a_snapshot_and_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """The take point's move of the optimizer's tensors (on the GPU: off the device), run on CPU
    tensors (SNAPGUARD_TAKE_OFFLOAD_DEVICE=cpu): emptied at the hold, moved into a file of the
    trainer's own on a tmpfs (its spill), which the executor takes into the image (CRIU never sees
    it) through a leave-running snapshot and through a stop snapshot, CRIU's restore and the release
    with the image's copy, and back each time: the trainer's weights follow the uninterrupted
    run's, step for step, and no spill file is left behind. The stop snapshot is restored after
    the trainer's hold limit (SNAPGUARD_TAKE_HOLD_S) has passed: the restored hold finds its
    deadline gone and its file's name removed, and waits for the release's file. With
    SNAPGUARD_TAKE_SPILL=0 the bytes stay in the process's memory, and CRIU writes them."""
    pytest.importorskip("torch")
    from snapguard_lab.targets import BareTarget

    spill_dir = Path(tempfile.mkdtemp(prefix="snapguard-test-", dir="/dev/shm"))  # a tmpfs, as by default
    request.addfinalizer(lambda: shutil.rmtree(spill_dir, ignore_errors=True))
    monkeypatch.setenv("SNAPGUARD_TAKE_OFFLOAD_DEVICE", "cpu")
    monkeypatch.setenv("SNAPGUARD_TAKE_SPILL_DIR", str(spill_dir))
    monkeypatch.setenv("SNAPGUARD_TAKE_HOLD_S", str(HOLD_S))
    for spill in (True, False):
        monkeypatch.setenv("SNAPGUARD_TAKE_SPILL", "1" if spill else "0")
        with BareTarget(tmp_path / f"moved-{spill}", script=MOVED_TRAINER, hook=True) as t:
            t.start(lines=3)
            for name, leave_running in (("lr", True), ("stop", False)):
                images = tmp_path / f"{name}-{spill}-img"
                out = t.checkpoint(images, images, leave_running=leave_running)
                assert out.returncode == 0, out.stderr
                ((pid, figures),) = image.verify(str(images)).to_json()["take_point"].items()
                offload = figures["offload"]
                # 4 parameters, their 4 gradients, AdamW's 3 state tensors each
                assert offload["state"] == "moved" and offload["storages"] == 20, offload
                parts = figures["trim_parts_s"]  # the trim, part by part, adds up to it
                assert sorted(parts) == ["caches", "gc", "move", "stack", "sync"], parts
                assert all(v >= 0 for v in parts.values()) and sum(parts.values()) <= figures["trim_s"] + 1e-3
                if spill:
                    held = images / offload["spill"]["file"]
                    assert held.name == f"snapguard-take-{pid}.bin" and held.stat().st_size == offload["spill"]["bytes"]
                    assert "spill_write_s" in json.loads(out.stdout)["timings"]
                else:
                    assert "spill" not in offload and not list(images.glob("snapguard-take-*")), offload
                if spill:
                    # recorded while its name may stay: a leave-running trainer's until a later
                    # sweep finds it reloaded, a stop snapshot's gone with its name (and the sweep
                    # before it dropped the leave-running one's)
                    records = list((t.state_dir / "spills").iterdir())
                    assert len(records) == (1 if leave_running else 0), records
                if not leave_running:
                    assert not list(spill_dir.iterdir()), "the stopped trainer's spill file was left"
                    # past the hold limit, counted from the hold's start (the trainer's clock is ours)
                    time.sleep(max(0.0, figures["held_at"] + HOLD_S + 1 - time.time()))
                    out = t.restore(images, images)
                    assert out.returncode == 0, out.stderr
                assert t.advancing(), f"the trainer does not step after the {name} snapshot"
                assert not list(spill_dir.iterdir()), "the reloaded trainer's spill file was left"
            values = t.values()
        expected = _moved_trainer_reference(max(i for i, _ in values))
        assert [h for _, h in values] == [expected[i] for i, _ in values]


def test_a_spill_left_by_an_executor_killed_after_its_stop_dump_goes_with_the_next_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """The executor is SIGKILLed right after CRIU's stop dump of a spilling trainer (CRIU ended the
    trainer; the executor never reached its cleanup): the trainer's spill stays in its tmpfs,
    recorded in the state directory's spill journal. The next snapshot of a spilling trainer on
    the node sweeps it: the name is gone, the record too, the result counts it."""
    pytest.importorskip("torch")
    from snapguard_lab.targets import BareTarget, criu_wrapper

    spill_dir = Path(tempfile.mkdtemp(prefix="snapguard-test-", dir="/dev/shm"))
    request.addfinalizer(lambda: shutil.rmtree(spill_dir, ignore_errors=True))
    monkeypatch.setenv("SNAPGUARD_TAKE_OFFLOAD_DEVICE", "cpu")
    monkeypatch.setenv("SNAPGUARD_TAKE_SPILL_DIR", str(spill_dir))
    with BareTarget(tmp_path / "first", script=MOVED_TRAINER, hook=True) as first:
        first.start(lines=3)
        first.configure(criu=str(criu_wrapper(tmp_path / "criu-kills", "kill-executor")))
        pid = first.pid()
        images = tmp_path / "first-img"
        out = first.checkpoint(images, images)
        assert out.returncode == -signal.SIGKILL, (out.returncode, out.stderr)
        (left,) = list(spill_dir.iterdir())
        named = protocol.TAKE_SPILL_SOURCE.fullmatch(left.name)
        assert named is not None and named.group(1) == str(pid), left
        journal = first.state_dir / "spills"
        assert len(list(journal.iterdir())) == 1
        deadline = time.monotonic() + 20
        while first.alive() and time.monotonic() < deadline:  # CRIU ended it; reaped here
            time.sleep(0.05)
        assert not first.alive()
        with BareTarget(tmp_path / "second", script=MOVED_TRAINER, hook=True) as second:
            second.state_dir = first.state_dir  # the same node's executor state
            second.configure()
            second.start(lines=3)
            images = tmp_path / "second-img"
            out = second.checkpoint(images, images, leave_running=True)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["counts"]["spills_removed"] == 1, out.stdout
            assert not left.exists()
            # the second trainer's own record stays while it lives (its name goes at its reload)
            assert [r.name.split("-")[0] for r in journal.iterdir()] == [str(second.pid())]


def test_held_workload_is_verified_while_criu_restores_it_and_never_released_corrupt(tmp_path: Path) -> None:
    """A workload held at its take point when dumped waits there after the restore: its image is
    hashed while CRIU reads it (no checksum pass before CRIU), and a digest that differs ends the
    restored copy before anything releases it. A workload not held is verified before CRIU."""
    pytest.importorskip("torch")
    from snapguard_lab.targets import BareTarget, typed_lines

    def snapshot(t: BareTarget, name: str) -> Path:
        images = tmp_path / name
        out = t.checkpoint(images, images)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert 0 < result["timings"]["criu_s"] <= result["timings"]["dump_s"], result
        assert "spans_hashed_while_dumping" in result["counts"], result  # hash_while_dumping is on
        return images

    with BareTarget(tmp_path / "held", script=HELD_TRAINER, hook=True) as t:
        t.start(lines=3)
        images = snapshot(t, "held-img")
        manifest = image.verify(str(images)).to_json()
        assert manifest["take_point"] and all(f["ok"] for f in manifest["take_point"].values())
        pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
        data = bytearray(pages.read_bytes())
        data[len(data) // 2] ^= 0xFF
        pages.write_bytes(bytes(data))
        last = t.values()[-1][0]
        out = t.restore(images, images)
        lines = typed_lines(out.stderr)
        assert out.returncode == 1 and len(lines) == 1 and lines[0].startswith("snapguard IMAGE_CORRUPT: "), out.stderr
        record = t.record(images, images)
        assert record["evidence"]["restored_tree_ended"] is True and record["workload_intact"] is False, record
        time.sleep(0.5)
        assert t.values()[-1][0] == last, "the corrupt copy ran past its take point"
        assert t.pid() is None or not t.alive()
        data[len(data) // 2] ^= 0xFF  # put it back: the same image restores and goes on
        pages.write_bytes(bytes(data))
        out = t.restore(images, images)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        timings = result["timings"]
        assert "verify_wait_s" in timings and "verify_s" not in timings, timings
        # read ahead of the digest check: at least CRIU and its libraries, and CRIU's small files
        small = [n for n, f in manifest["files"].items() if f["size"] <= 4 << 20]
        criu_files = prefetch.closure(load(t.env()).criu)
        assert len(criu_files) > 1 and result["counts"]["read_ahead_files"] >= len(criu_files) + len(small), result
        assert "read_ahead_s" in timings, timings
        assert t.advancing(), "the restored trainer does not step"
    with BareTarget(tmp_path / "counter") as c:  # not held: the whole image first, as always
        c.start(lines=3)
        images = snapshot(c, "counter-img")
        out = c.restore(images, images, extra_env={"SNAPGUARD_RESTORE_PREFETCH_ON": "0"})
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        timings = result["timings"]
        assert "verify_s" in timings and 0 < timings["criu_s"] <= timings["restore_s"], timings
        checks = result["preflight_checks_s"]  # where the restore's preflight went, check by check
        assert {"pid-conflicts", "children"} <= set(checks) and all(v >= 0 for v in checks.values()), checks
        assert sum(checks.values()) <= timings["preflight_s"], (checks, timings)
        assert "read_ahead_files" not in result.get("counts", {}) and "read_ahead_s" not in timings, result  # switched off


def test_take_point_drops_the_stepped_optimizers_gradients_when_asked(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """SNAPGUARD_TAKE_DROP_GRADS=1: the hold sets the stepped optimizer's gradients to None, so the
    image carries none (Linear(4, 4): 20 fp32 values, 80 bytes), and the trainer steps on after
    the release; without it they stay."""
    pytest.importorskip("torch")
    from snapguard_lab.targets import BareTarget

    for drop, expected in (("1", 80), (None, None)):
        if drop is None:
            monkeypatch.delenv("SNAPGUARD_TAKE_DROP_GRADS", raising=False)
        else:
            monkeypatch.setenv("SNAPGUARD_TAKE_DROP_GRADS", drop)
        with BareTarget(tmp_path / f"drop-{drop}", script=HELD_TRAINER, hook=True) as t:
            t.start(lines=3)
            images = tmp_path / f"img-{drop}"
            out = t.checkpoint(images, images, leave_running=True)
            assert out.returncode == 0, out.stderr
            # left running, the page files are hashed by the seal alone, after the stall: never
            # during the dump or the CUDA resume, which it would slow
            assert "spans_hashed_while_dumping" not in json.loads(out.stdout).get("counts", {})
            (figures,) = image.verify(str(images)).to_json()["take_point"].values()
            assert figures.get("grads_dropped_bytes") == expected, figures
            assert t.advancing(), "the trainer does not step after the release"
