"""The loopback HTTP servers' one setup: a ThreadingHTTPServer on 127.0.0.1 (port 0: the kernel
picks) serving from a daemon thread, optionally over TLS, each request handed to the owner.

The servers that stand in for the parts that cannot run here (the capacity owners' metadata
services in `metadata_servers`, kube-apiserver's list+watch in `kube_watch`) subclass
`LoopbackHttp` and answer in `_request(handler, method)`; the handler's `reply(code, body,
headers)` sends one whole answer with its Content-Length. Nothing listens on another address.
"""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["LoopbackHttp"]


class LoopbackHttp:
    """A loopback server in a thread; `url` is its base, `cond` the lock its state is kept under
    (notified on `close`, which sets `closed`), `tls=(cert, key)` serves HTTPS."""

    METHODS = ("GET", "PUT")

    def __init__(self, tls: tuple[str, str] | None = None) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                owner._serve(self, "GET")

            def do_PUT(self) -> None:
                owner._serve(self, "PUT")

            def reply(self, code: int, body: bytes | str, headers: dict[str, str] | None = None) -> None:
                data = body.encode() if isinstance(body, str) else body
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.cond = threading.Condition()
        self.closed = False
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.httpd.server_address[1]}"

    def _serve(self, h: Any, method: str) -> None:
        if method not in self.METHODS:
            return h.send_error(501, f"Unsupported method ({method!r})")
        return self._request(h, method)

    def _request(self, h: Any, method: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
