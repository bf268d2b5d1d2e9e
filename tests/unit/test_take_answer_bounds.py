"""The executor reads a take point's answer with bounds: a real unix socket pair, the far end
answering as a hostile trainer would (nested thousands of levels deep, larger than the cap, not an
object): each is a ValueError, which every caller of the reader turns into its typed outcome
(not a trainer, a take refused, TAKE_POINT_TIMEOUT), never a RecursionError."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from snapguard.takepoint import client


def _answer(reply: bytes) -> dict:
    ours, theirs = socket.socketpair()

    def trainer() -> None:
        with theirs:
            theirs.recv(4096)
            try:
                theirs.sendall(reply)
            except OSError:
                pass  # the executor stopped reading an answer over the cap, and closed

    t = threading.Thread(target=trainer)
    t.start()
    try:
        ours.settimeout(5.0)
        with ours:
            answer, fds = client._exchange(ours, '{"op": "status"}\n')
        assert fds == []
        return answer
    finally:
        t.join(10)


@pytest.mark.parametrize("reply", [
    b"[" * 100_000 + b"]" * 100_000 + b"\n",
    b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"\n",
    b'{"trainer": true, "pool": ' + b"[" * 40 + b"]" * 40 + b"}\n",
    b'{"trainer": true, "x": "' + b"a" * (2 << 20) + b'"}\n',
    b"[1, 2]\n",
    b"not json\n",
])
def test_a_hostile_answer_is_a_value_error(reply: bytes) -> None:
    with pytest.raises(ValueError):
        _answer(reply)


def test_brackets_inside_strings_do_not_count() -> None:
    deep_text = "[{" * 1000 + '\\"' + "}]" * 1000
    reply = json.dumps({"trainer": True, "pool": {"pids": [1, 2]}, "note": deep_text}).encode() + b"\n"
    assert _answer(reply) == json.loads(reply)


@pytest.mark.parametrize("reply", [b"", b"\n", b"  \n"])
def test_a_connection_closed_without_an_answer_says_so(reply: bytes) -> None:
    """A trainer that exits with a take pending (it ended before the step asked for) closes the
    connection: the reason names that, not a JSON parser's complaint."""
    with pytest.raises(ValueError, match="closed the connection without an answer"):
        _answer(reply)
