"""The restore's digest check of a held workload's image, run beside CRIU (`_Digests`): it waits
for CRIU to start (its log written) before its reads fill the disk's queue, and no longer than
that, on a real sealed image."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from snapguard import image
from snapguard.pipeline._sequence import _Digests, _written_since
from snapguard.procfs import host_facts
from snapguard.reasons import Reason


@pytest.fixture
def sealed(tmp_path: Path) -> Path:
    d = tmp_path / "img"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(300_000))
    (d / "core-1.img").write_bytes(b"core")
    image.seal(str(d), {"container_id": "c", "criu_version": "4.2.1", "host": host_facts(), "processes": []})
    return d


def test_written_since_sees_a_log_created_truncated_or_grown_and_nothing_else(tmp_path: Path) -> None:
    log = tmp_path / "restore.log"
    fresh = _written_since(str(log))
    assert not fresh()
    log.write_bytes(b"")
    assert not fresh()  # created, nothing in it yet
    log.write_bytes(b"(00.000000) CRIU run id = x\n")
    assert fresh()

    old = _written_since(str(log))  # a log left by an earlier restore
    assert not old()
    time.sleep(0.01)
    log.write_bytes(b"(00.000000) CRIU run id = y\n")  # truncated and rewritten: same size
    assert old()


def test_the_check_waits_for_criu_to_start_then_reads_the_image(sealed: Path) -> None:
    """Bytes changed after the thread began but before CRIU started are caught: it read them after."""
    up = threading.Event()
    digests = _Digests(image.inspect(str(sealed)), held=True)
    digests.start(up.is_set)
    time.sleep(0.2)
    with open(sealed / "pages-1.img", "r+b") as f:
        f.write(b"\0" * 16)
    up.set()
    error = digests.result()
    assert error is not None and error.reason is Reason.IMAGE_CORRUPT, error


def test_a_criu_that_never_logs_delays_the_check_no_longer_than_its_end(sealed: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Digests, "STARTUP_S", 60.0)
    digests = _Digests(image.inspect(str(sealed)), held=True)
    digests.start(lambda: False)
    t0 = time.monotonic()
    assert digests.result() is None  # CRIU ended: checked at once, and intact
    assert time.monotonic() - t0 < 5.0

    monkeypatch.setattr(_Digests, "STARTUP_S", 0.1)
    digests = _Digests(image.inspect(str(sealed)), held=True)
    digests.start(lambda: False)
    time.sleep(0.5)  # past STARTUP_S the check runs without CRIU's log
    with open(sealed / "pages-1.img", "r+b") as f:
        f.write(b"\0" * 16)
    assert digests.result() is None  # read before the change: it did not wait for the end
