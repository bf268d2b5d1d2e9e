"""A proxy on loopback in front of the real radosgw (snapguard_lab.s3): it forwards every request
as it came, its signature intact, except those a subclass's `intercept` answers itself. The
hostile-store tests make a store that misbehaves only where they say (a page file's upload
dropped, or never answered) out of the real one."""

from __future__ import annotations

import http.client
import socket
import threading

__all__ = ["S3Proxy"]


class S3Proxy:
    """Listens on 127.0.0.1:`port`; one thread per connection, keep-alive, Expect: 100-continue
    answered, responses re-framed with their Content-Length."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def intercept(self, method: str, target: str, body: bytes, conn: socket.socket) -> bool:
        """Whether this request was answered here (or left unanswered on purpose); False: forwarded."""
        return False

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: list[tuple[str, str]] = []
                while (h := f.readline()) not in (b"\r\n", b""):
                    k, v = h.decode("latin-1").split(":", 1)
                    headers.append((k.strip(), v.strip()))
                hd = {k.lower(): v for k, v in headers}
                if hd.get("expect", "").lower() == "100-continue":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = f.read(int(hd.get("content-length", "0")))
                if not self.intercept(method, target, body, conn):
                    self._forward(conn, method, target, headers, body)
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def _forward(self, conn: socket.socket, method: str, target: str, headers: list[tuple[str, str]],
                 body: bytes) -> None:
        up = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        up.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for k, v in headers:
            if k.lower() != "expect":
                up.putheader(k, v)
        up.endheaders(body)
        r = up.getresponse()
        data = r.read()
        out = f"HTTP/1.1 {r.status} {r.reason}\r\n"
        for k, v in r.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                out += f"{k}: {v}\r\n"
        conn.sendall(out.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() +
                     (b"" if method == "HEAD" else data))
        up.close()
