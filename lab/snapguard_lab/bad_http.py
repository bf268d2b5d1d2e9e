"""Loopback HTTP peers that misbehave, for tests of the bounds on every exchange snapguard has
with a peer: each accepts on 127.0.0.1 (port 0) in a daemon thread, reads the request's headers,
then answers in one of these ways:

- `trickle`: a well-formed answer (`status`, `headers`, `body`) sent one byte every `gap_s`;
- `endless_headers`: a status line, then header lines for ever, one every `gap_s`;
- `answer`: a well-formed answer at once (a deep or huge body, say), for the parsers' bounds.

`hits` counts the connections served.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

__all__ = ["BadHttp"]


class BadHttp:
    def __init__(self, mode: str, *, body: bytes = b"", status: str = "200 OK", gap_s: float = 0.05,
                 headers: dict[str, str] | None = None) -> None:
        assert mode in ("trickle", "endless_headers", "answer"), mode
        self.mode, self.body, self.status, self.gap_s = mode, body, status, gap_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.hits = 0
        self._stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.hits += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data and len(data) < 65536:
                piece = conn.recv(4096)
                if not piece:
                    return
                data += piece
            head = (f"HTTP/1.1 {self.status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
                    + f"Content-Length: {len(self.body)}\r\n\r\n").encode() + self.body
            if self.mode == "answer":
                conn.sendall(head)
            elif self.mode == "trickle":
                for i in range(len(head)):
                    if self._stop.is_set():
                        return
                    conn.sendall(head[i:i + 1])
                    time.sleep(self.gap_s)
            else:
                conn.sendall(f"HTTP/1.1 {self.status}\r\n".encode())
                n = 0
                while not self._stop.is_set():
                    conn.sendall(f"X-Never-Ending-{n}: yes\r\n".encode())
                    n += 1
                    time.sleep(self.gap_s)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()

    def __enter__(self) -> BadHttp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
