"""Notice sources retry a transient failure (HTTP 5xx or 429, a connection cut short) with
jittered exponential backoff inside the poll's deadline, and never a refusal (4xx): against a
loopback server speaking Azure's Scheduled Events format that fails the first answers."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from snapguard.notice import Azure
from snapguard.notice._sources._retry import Backoff
from snapguard.reasons import Reason, SnapguardError

EVENTS = json.dumps({"DocumentIncarnation": 3, "Events": []}).encode()


class Flaky:
    """Answers `failures` (a list: an HTTP status, or "cut" to close without a word) in turn,
    then 200 with Scheduled Events; counts the connections."""

    def __init__(self, failures: list[int | str]) -> None:
        self.failures, self.connections = list(failures), 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                self.connections += 1
                what = self.failures.pop(0) if self.failures else 200
                if what == "cut":
                    continue
                body = EVENTS if what == 200 else b"busy"
                conn.sendall(f"HTTP/1.1 {what} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                             "Connection: close\r\n\r\n".encode() + body)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def flaky() -> Iterator[type[Flaky]]:
    made: list[Flaky] = []

    def make(failures: list[int | str]) -> Flaky:
        made.append(Flaky(failures))
        return made[-1]

    yield make  # type: ignore[misc]
    for f in made:
        f.close()


def test_two_failures_then_an_answer_is_one_good_poll(flaky) -> None:
    srv = flaky([503, "cut"])
    src = Azure(srv.url)
    assert src.poll(time.monotonic() + 10) is None
    assert srv.connections == 3 and src.incarnation == 3


def test_a_refusal_is_not_retried(flaky) -> None:
    srv = flaky([403])
    with pytest.raises(SnapguardError) as e:
        Azure(srv.url).poll(time.monotonic() + 10)
    assert e.value.reason is Reason.NOTICE_SOURCE_UNAVAILABLE and "HTTP 403" in str(e.value)
    assert srv.connections == 1


def test_retries_stop_at_the_polls_deadline(flaky) -> None:
    srv = flaky([503] * 100)
    start = time.monotonic()
    with pytest.raises(SnapguardError) as e:
        Azure(srv.url).poll(start + 1.0)
    assert "HTTP 503" in str(e.value) and time.monotonic() - start < 1.0
    assert 1 < srv.connections <= 5  # a few attempts, jittered, bounded


def test_backoff_is_jittered_exponential_and_capped() -> None:
    slept: list[float] = []
    b = Backoff(base_s=0.1, cap_s=0.3, attempts=6, min_attempt_s=0, sleep=slept.append)
    assert all(b.wait(time.monotonic() + 60) for _ in range(6)) and not b.wait(time.monotonic() + 60)
    bounds = [0.1, 0.2, 0.3, 0.3, 0.3, 0.3]
    assert all(0 <= s <= hi for s, hi in zip(slept, bounds)) and len(set(slept)) > 1
    assert not Backoff(sleep=slept.append).wait(time.monotonic() + 0.01)  # no room left: no sleep either
    assert len(slept) == 6
