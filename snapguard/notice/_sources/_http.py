"""The notice sources' HTTP/1.1 client: one deadline for the whole exchange with a peer.

A metadata service or an API server is a peer snapguard does not trust to behave: a per-read
timeout does not bound a response sent a byte at a time, or headers that never end. Here every
exchange (connect, TLS, request, status line, headers, body or a watch's event stream) runs
against one `time.monotonic()` deadline checked after every read; headers are bounded in size
(`MAX_HEADERS`), bodies by the caller's `max_body`, a streamed line by `max_line`. No proxy and
no redirect (a 3xx is an answer like any other status), no keep-alive (`Connection: close`).

A source raises NOTICE_SOURCE_UNAVAILABLE for what is the network's or the peer's state (refused,
reset, timed out, a non-2xx status) and NOTICE_MALFORMED for an answer that is not HTTP as the
RFCs write it.
"""

from __future__ import annotations

import socket
import ssl
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from ...reasons import Reason, SnapguardError
from ._retry import retry

__all__ = ["MAX_HEADERS", "Exchange", "Response", "malformed", "request", "unavailable"]

MAX_HEADERS = 64 * 1024
_READ = 64 * 1024


def unavailable(name: str, url: str, why: str) -> SnapguardError:
    return SnapguardError(Reason.NOTICE_SOURCE_UNAVAILABLE, f"{name} notice source {url}: {why}",
                          evidence={"source": name, "url": url})


def malformed(name: str, url: str, why: str, body: bytes | str = b"") -> SnapguardError:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return SnapguardError(Reason.NOTICE_MALFORMED, f"{name} notice source {url}: {why}",
                          evidence={"source": name, "url": url, "body": text[:200]})


@dataclass(frozen=True)
class Response:
    """A whole answer: status, headers (lower-case names), body."""

    status: int
    reason: str
    headers: dict[str, str]
    body: bytes


class _Timeout(Exception):
    pass


class Exchange:
    """One request and its answer over a fresh connection, every step bounded by `deadline`.

    `open()` sends the request and reads the status line and headers; then `body(max_body)` reads
    the whole body, or `lines(max_line)` yields the body's lines as they arrive (a watch) and ends
    quietly at the deadline. Use as a context manager: the socket is closed on exit."""

    def __init__(self, name: str, url: str, deadline: float, *, method: str = "GET",
                 headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None) -> None:
        self.name, self.url, self.deadline, self.method = name, url, deadline, method
        self.headers_out = headers or {}
        self.context = context
        self.sock: socket.socket | None = None
        self._buf = b""
        self._eof = False
        self.status = 0
        self.reason = ""
        self.headers: dict[str, str] = {}

    # -- plumbing ---------------------------------------------------------------------------------
    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Timeout()
        return left

    def _fill(self) -> bool:
        """Read more into the buffer: False at the end of the stream."""
        if self._eof:
            return False
        assert self.sock is not None
        self.sock.settimeout(self._left())
        try:
            data = self.sock.recv(_READ)
        except (TimeoutError, socket.timeout):
            raise _Timeout() from None
        if time.monotonic() > self.deadline:  # a trickle: each read in time, the whole too late
            raise _Timeout()
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    def _until(self, sep: bytes, limit: int, what: str) -> bytes:
        while True:
            i = self._buf.find(sep)
            if i >= 0:
                out, self._buf = self._buf[:i], self._buf[i + len(sep):]
                return out
            if len(self._buf) > limit:
                raise malformed(self.name, self.url, f"{what} over {limit} bytes")
            if not self._fill():
                if not self._buf and not self.status:  # closed before a byte of an answer: the peer's state
                    raise unavailable(self.name, self.url, "the connection closed before any answer")
                raise malformed(self.name, self.url, f"the connection closed in the middle of the {what}")

    def _exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._fill():
                raise malformed(self.name, self.url, "the connection closed in the middle of the body")
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    # -- the exchange -----------------------------------------------------------------------------
    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def open(self) -> Exchange:
        try:
            self._open()
        except _Timeout:
            raise self.timed_out() from None
        except ssl.SSLError as e:
            err = unavailable(self.name, self.url, f"TLS: {e.reason or e}")
            raise (_permanent(err) if isinstance(e, ssl.SSLCertVerificationError) else err) from None
        except OSError as e:
            raise unavailable(self.name, self.url, e.strerror or f"{type(e).__name__}: {e}") from None
        return self

    def timed_out(self) -> SnapguardError:
        return unavailable(self.name, self.url, "timed out (the whole exchange is bounded by the poll's deadline)")

    def _open(self) -> None:
        u = urllib.parse.urlsplit(self.url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise _permanent(unavailable(self.name, self.url, "not an http:// or https:// URL"))
        port = u.port or (443 if u.scheme == "https" else 80)
        self.sock = socket.create_connection((u.hostname, port), timeout=self._left())
        if u.scheme == "https":
            ctx = self.context or ssl.create_default_context()
            self.sock.settimeout(self._left())
            self.sock = ctx.wrap_socket(self.sock, server_hostname=u.hostname)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        host = u.netloc.rpartition("@")[2]
        lines = [f"{self.method} {target} HTTP/1.1", f"Host: {host}", "Connection: close",
                 "User-Agent: snapguard-agent", "Accept-Encoding: identity"]
        if self.method in ("PUT", "POST"):
            lines.append("Content-Length: 0")
        for k, v in self.headers_out.items():
            if any(c in f"{k}{v}" for c in "\r\n\0"):
                raise _permanent(unavailable(self.name, self.url, f"header {k!r} holds a line break"))
            lines.append(f"{k}: {v}")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.sock.settimeout(self._left())
        self.sock.sendall(data)
        head = self._until(b"\r\n\r\n", MAX_HEADERS, "response headers")
        status_line, _, rest = head.partition(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
            raise malformed(self.name, self.url, f"not an HTTP status line: {status_line[:80]!r}")
        self.status = int(parts[1])
        self.reason = parts[2].decode("latin-1", "replace") if len(parts) > 2 else ""
        for raw in rest.split(b"\r\n") if rest else []:
            k, sep, v = raw.partition(b":")
            if not sep or not k.strip():
                raise malformed(self.name, self.url, f"not an HTTP header: {raw[:80]!r}")
            self.headers[k.strip().decode("latin-1").lower()] = v.strip().decode("latin-1")

    def _chunks(self, limit: int, close_ends: bool = False) -> Iterator[bytes]:
        """The body's pieces as they arrive (chunked, a Content-Length, or up to the close). With
        `close_ends`, a close between two chunks ends the body (a watch a proxy cut)."""
        if self.method == "HEAD" or self.status in (204, 304) or 100 <= self.status < 200:
            return
        te = self.headers.get("transfer-encoding", "").lower()
        if te:
            if te != "chunked":
                raise malformed(self.name, self.url, f"Transfer-Encoding {te!r}")
            total = 0
            while True:
                if close_ends and not self._buf and not self._fill():
                    return
                size_line = self._until(b"\r\n", 1024, "chunk size").split(b";")[0].strip()
                try:
                    size = int(size_line, 16)
                except ValueError:
                    raise malformed(self.name, self.url, f"chunk size {size_line[:20]!r}") from None
                if size == 0:
                    return  # trailers are not read: the connection closes
                total += size
                if total > limit:
                    raise malformed(self.name, self.url, f"body over {limit} bytes")
                data = self._exactly(size)
                self._exactly(2)
                yield data
        length = self.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise malformed(self.name, self.url, f"Content-Length {length[:20]!r}")
            n = int(length)
            if n > limit:
                raise malformed(self.name, self.url, f"body of {n} bytes (at most {limit})")
            if n:
                yield self._exactly(n)
            return
        total = len(self._buf)
        while self._fill():
            total = len(self._buf)
            if total > limit:
                raise malformed(self.name, self.url, f"body over {limit} bytes")
        out, self._buf = self._buf, b""
        yield out

    def body(self, max_body: int) -> bytes:
        try:
            return b"".join(self._chunks(max_body))
        except _Timeout:
            raise self.timed_out() from None
        except OSError as e:
            raise unavailable(self.name, self.url, e.strerror or f"{type(e).__name__}: {e}") from None

    def lines(self, max_line: int, max_total: int = 1 << 40) -> Iterator[bytes]:
        """The body's newline-separated lines as they arrive; ends at the end of the body or,
        quietly, at the deadline (a watch ends there by design)."""
        pending = b""
        try:
            for piece in self._chunks(max_total, close_ends=True):
                pending += piece
                while True:
                    i = pending.find(b"\n")
                    if i < 0:
                        break
                    line, pending = pending[:i], pending[i + 1:]
                    if line.strip():
                        yield line
                if len(pending) > max_line:
                    raise malformed(self.name, self.url, f"a line over {max_line} bytes")
        except _Timeout:
            return
        except OSError as e:
            raise unavailable(self.name, self.url, e.strerror or f"{type(e).__name__}: {e}") from None
        if pending.strip():
            yield pending


def request(name: str, url: str, deadline: float, *, method: str = "GET", headers: dict[str, str] | None = None,
            context: ssl.SSLContext | None = None, max_body: int = 1 << 20, ok: tuple[int, ...] = ()) -> Response:
    """One whole exchange by `deadline`. A 2xx, or a status in `ok`, is returned; any other is
    NOTICE_SOURCE_UNAVAILABLE `HTTP <code> <reason>`. A transient failure (the connection
    refused, reset or cut short, HTTP 429 or 5xx) is tried again with jittered backoff while
    another attempt fits before `deadline` (_retry); a 4xx or an answer that is not HTTP is not."""
    def once() -> Response:
        with Exchange(name, url, deadline, method=method, headers=headers, context=context) as ex:
            ex.open()
            body = ex.body(max_body)
        if not (200 <= ex.status < 300) and ex.status not in ok:
            raise _Status(ex.status, unavailable(name, url, f"HTTP {ex.status} {ex.reason}".strip()))
        return Response(ex.status, ex.reason, ex.headers, body)

    try:
        return retry(once, deadline, _transient)
    except _Status as e:
        raise e.error from None


class _Status(Exception):
    """A status the caller does not take: NOTICE_SOURCE_UNAVAILABLE, retried when transient."""

    def __init__(self, status: int, error: SnapguardError) -> None:
        super().__init__(status)
        self.status, self.error = status, error


def _permanent(err: SnapguardError) -> SnapguardError:
    """A failure no retry can mend (a bad URL or header, a certificate that does not verify)."""
    err.permanent = True  # type: ignore[attr-defined]
    return err


def _transient(e: Exception) -> bool:
    if isinstance(e, _Status):
        return e.status == 429 or e.status >= 500
    return isinstance(e, SnapguardError) and e.reason is Reason.NOTICE_SOURCE_UNAVAILABLE and \
        not getattr(e, "permanent", False)
