"""Real processes planted on this machine, each holding one thing a snapshot trips over."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

IO_URING = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
params = (ctypes.c_ubyte * 120)()
fd = libc.syscall(425, 4, params)  # io_uring_setup
if fd < 0:
    sys.exit(f"io_uring_setup failed: {os.strerror(ctypes.get_errno())}")
"""

TCP_PAIR = """
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname()); conn, _ = srv.accept()
"""

DELETED_SHM = """
import mmap, os
path = f"/dev/shm/snapguard-test-{os.getpid()}"
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, 8192)
m = mmap.mmap(fd, 8192); os.unlink(path)
"""

WRITABLE = """
import os, sys
trunc = open(sys.argv[1], "w"); app = open(sys.argv[2], "a")
"""

# Holds a device node open (argv[1]) and maps a file (argv[2]): mapping a char device such as
# /dev/zero shows up as "/dev/zero (deleted)", so the mapping is of a regular file.
DEVICE_MAP = """
import mmap, os, sys
dev = os.open(sys.argv[1], os.O_RDWR)
f = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(f, 4096)
m = mmap.mmap(f, 4096)
"""

IDLE = ""


@contextmanager
def planted(setup: str, *args: str, env: dict[str, str] | None = None) -> Iterator[int]:
    """Run `setup` in a child that then waits; yield its pid once it is ready."""
    code = setup + "\nimport sys\nsys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()\n"
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"planted process failed: {proc.stderr.read() if proc.stderr else ''}")
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
