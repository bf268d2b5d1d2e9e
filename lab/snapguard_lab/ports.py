"""A TCP port for a server a test or drill starts later: free now, and outside the kernel's
ephemeral range, so that no connect() and no bind to port 0 made meanwhile (a store's client, a
c10d backend's own listener) can take it first.

A port found by binding port 0 and closing the socket is an ephemeral one: the kernel hands the
same numbers to outgoing connections, and a test that starts a store's client before it binds the
port it picked was seen to lose it ("Address already in use"). Ports here come from below the
range's start (/proc/sys/net/ipv4/ip_local_port_range), drawn at random and checked bindable.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_LOW = 10000  # below: ports services commonly use


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(address: str = "127.0.0.1", tries: int = 200) -> int:
    """A port `address` can bind now, below the ephemeral range (RuntimeError when none is found)."""
    top = _ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(tries):
        port = rng.randrange(_LOW, max(_LOW + 1, top))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below {top} on {address} in {tries} tries")
