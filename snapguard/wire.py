"""One JSON line over a Unix stream socket: how the executor's cuda-checkpoint broker and the tool
talk (snapguard.cuda._broker, snapguard.cuda_tool). Standard library only: the tool imports it
inside a trainer's stall. The take point's socket has its own wire in snapguard.takepoint.protocol."""

from __future__ import annotations

import socket
import struct

__all__ = ["BROKER_ENV", "LineTooLong", "peer_uid", "recv_line"]

# The environment entry that names the executor's broker socket: set by snapguard for the CRIU it
# runs (so for CRIU's plugin and the tool it starts). A value in snapguard's own environment is
# dropped for every child snapguard.children starts with that environment and from CRIU's
# (snapguard.criu.RunDir); the tool asks only a listener of its own uid (root) in any case.
BROKER_ENV = "SNAPGUARD_CUDA_BROKER"


class LineTooLong(ValueError):
    """More than the limit before the newline."""


def recv_line(sock: socket.socket, limit: int) -> bytes:
    """Bytes up to and with the first newline (what follows it in the same read is dropped: one
    message per connection), or what came before the peer closed (maybe b"")."""
    data = b""
    while b"\n" not in data:
        chunk = sock.recv(min(65536, limit + 1 - len(data)))
        if not chunk:
            return data
        data += chunk
        if len(data) > limit and b"\n" not in data:
            raise LineTooLong(f"over {limit} bytes")
    return data[:data.index(b"\n") + 1]


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)
