"""The preflight before a snapshot: where its time goes (the result record's `preflight_checks_s`,
each check run then, none of those reused from earlier host checks) and the per-boot memory of a
passed `cuda-checkpoint -h` probe, on a real bare process with real CRIU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapguard import pipeline, preflight
from snapguard.config import load
from snapguard.preflight import host
from snapguard_lab.targets import COUNTER

pytestmark = [pytest.mark.root, pytest.mark.stack]


@pytest.fixture
def counter(tmp_path: Path):
    log = tmp_path / "counter.log"
    proc = subprocess.Popen([sys.executable, "-c", COUNTER, str(log)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (log.exists() and log.read_text().count("\n") >= 5):
        assert time.monotonic() < deadline, "the counter did not start"
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def test_the_record_says_where_the_preflight_went_and_leaves_reused_checks_out(
        counter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    monkeypatch.setenv("SNAPGUARD_CONFIG", str(cfg))
    monkeypatch.setenv("SNAPGUARD_STATE_DIR", str(tmp_path / "state"))
    config = load()
    runner = pipeline.CriuRunner(config.criu, counter.pid)
    cold = pipeline.checkpoint(runner, pipeline.Request(str(tmp_path / "a"), leave_running=True), config)
    checks = cold["preflight_checks_s"]
    assert {"privileges", "criu", "nvidia-driver", "host-memory"} <= set(checks)  # host and workload checks
    # the host checks run at once: each took no longer than the whole preflight (their sum may)
    assert max(checks.values()) <= cold["timings"]["preflight_s"]

    ahead = preflight.host_checks_ahead(config, gpu_required=False, network_lock=False)
    warm = pipeline.checkpoint(runner, pipeline.Request(str(tmp_path / "b"), leave_running=True), config,
                               host_checks=ahead)
    checks = warm["preflight_checks_s"]
    assert "criu" not in checks and "privileges" not in checks  # reused: they took no time here
    assert "nvidia-driver" in checks and "host-memory" in checks  # always run anew
    assert warm["timings"]["host_checks_age_s"] >= 0


def test_a_passed_cuda_checkpoint_probe_is_remembered_for_that_binary_until_it_changes(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    tool = tmp_path / "cuda-checkpoint"
    tool.write_text(f"#!/bin/sh\necho x >> {runs}\necho 'usage: cuda-checkpoint --action lock|checkpoint'\n")
    tool.chmod(0o755)
    state = tmp_path / "state"

    def ran() -> int:
        return runs.read_text().count("x") if runs.exists() else 0

    assert host._cuda_checkpoint_probe(str(tool), str(state)) is None
    assert host._cuda_checkpoint_probe(str(tool), str(state)) is None
    assert ran() == 1  # the second answer came from the state directory
    st = tool.stat()
    os.utime(tool, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # another binary at that path
    assert host._cuda_checkpoint_probe(str(tool), str(state)) is None
    assert ran() == 2
    tool.write_text("#!/bin/sh\necho 'no such flag'\n")  # fails: the failure is never remembered
    assert host._cuda_checkpoint_probe(str(tool), str(state)) is not None
    assert host._cuda_checkpoint_probe(str(tool), None) is not None


def test_the_driver_api_read_from_libcuda_is_remembered_for_that_file_until_it_changes(tmp_path: Path) -> None:
    import json
    import shutil

    from snapguard.cuda import libcuda_checkpoint_symbols

    lib = tmp_path / "libcuda.so.1"  # a real ELF without the checkpoint API: every symbol is False
    shutil.copy(os.path.realpath("/lib/x86_64-linux-gnu/libc.so.6"), lib)
    state = tmp_path / "state"
    first = host.checkpoint_api(str(lib), str(state))
    assert first == libcuda_checkpoint_symbols(str(lib)) and not any(first.values())
    cache = state / "libcuda-symbols.json"
    assert (cache.stat().st_mode & 0o777) == 0o600
    said = json.loads(cache.read_text())
    said["symbols"] = {k: True for k in said["symbols"]}  # what a second read returns is the file's
    cache.write_text(json.dumps(said))
    assert all(host.checkpoint_api(str(lib), str(state)).values())
    st = lib.stat()
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a driver upgrade: read anew
    assert host.checkpoint_api(str(lib), str(state)) == first
