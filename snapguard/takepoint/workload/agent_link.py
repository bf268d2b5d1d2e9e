"""The words between a torchrun job's workers and their elastic agent, both inside the job's tree
and both running the take point: the agent listens on <TAKE_DIR_ENV>/<its pid>.agent.sock (0600),
one request per connection, a line of words; one JSON object per reply, a line; the agent closes
its end after the reply, and the worker reads to that end, so that no connection is left open
when the executor freezes the tree.

  status                        -> the agent's stores and what it cannot release (`unreached`)
  hold <KEY> <PORT> <SECONDS>   -> every store of the agent dropped (its workers dropped theirs);
                                   the one it hosts at PORT first waits for KEY, set when every
                                   rank of the job is done with it
  rebuild <PORT> [HOST:PORT]    -> the stores made again, the one at PORT moved to HOST:PORT
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from .. import protocol

__all__ = ["HOLD", "REBUILD", "STATUS", "agent_socket", "ask", "parent_agent", "read_line"]

STATUS, HOLD, REBUILD = "status", "hold", "rebuild"
MAX_REPLY = 1 << 16  # the agent's answer is a few hundred bytes


def agent_socket(take_dir: str, pid: int) -> str:
    """The agent's socket of process `pid` (as the tree sees its pid) in `take_dir`."""
    return os.path.join(take_dir, f"{pid}.agent.sock")


def parent_agent() -> str | None:
    """This worker's agent's socket: the parent's (torchrun's agent starts its workers itself),
    when the parent runs the agent side of the take point; else None."""
    take_dir = os.environ.get(protocol.TAKE_DIR_ENV, "")
    if not take_dir:
        return None
    path = agent_socket(take_dir, os.getppid())
    return path if os.path.exists(path) else None


def ask(path: str, line: str, timeout: float) -> dict[str, Any]:
    """The agent's answer to one request, read to the end of its connection within `timeout`
    seconds; OSError or ValueError when there is none."""
    deadline = time.monotonic() + max(timeout, 0.1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(max(timeout, 0.1))
        s.connect(path)
        s.sendall(line.encode() if line.endswith("\n") else (line + "\n").encode())
        reply = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or len(reply) > MAX_REPLY:
                raise ValueError("the agent's answer is too long, or does not end")
            s.settimeout(left)
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    answer = json.loads(bytes(reply).split(b"\n", 1)[0] or b"null")
    if not isinstance(answer, dict):
        raise ValueError(f"the agent's answer is not an object: {bytes(reply)[:80]!r}")
    return answer


def read_line(conn: socket.socket, timeout: float = 5.0) -> list[str]:
    """One request's words (at most protocol.MAX_REQUEST bytes)."""
    conn.settimeout(timeout)
    data = b""
    while b"\n" not in data and len(data) < protocol.MAX_REQUEST:
        chunk = conn.recv(protocol.MAX_REQUEST)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").split("\n", 1)[0].split()
