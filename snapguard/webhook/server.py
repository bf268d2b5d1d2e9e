"""The webhook's HTTPS server: AdmissionReview v1 POSTs on MUTATE_PATH, a health check on
HEALTH_PATH, nothing else.

Each connection has its own thread (at most `MAX_CONNECTIONS`; more are closed unanswered), its
TLS handshake and every read and write bound by `io_timeout_s`; a body larger than
`max_body_bytes` is refused unread (413). The certificate and key are read again when their
files change (a Secret's rotation), the old pair kept while a new one does not load.

Answers:
  200  an AdmissionReview response: `allowed: true` always, a JSONPatch when the pod changes,
       warnings for what was skipped and why (failurePolicy Ignore semantics: a webhook fault
       never blocks a pod); a fault inside the webhook is a warning, never a traceback
  400  the body is not an AdmissionReview v1 (a meta/v1 Status, ADMISSION_REVIEW_INVALID)
  404, 405, 411, 413, 415   another path, method, no length, too large, not JSON (a Status)
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import socket
import socketserver
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from ..reasons import Reason, SnapguardError, failure_from
from . import mutate, review
from .snapshots import SnapshotSource

__all__ = ["HEALTH_PATH", "MUTATE_PATH", "ServerConfig", "Webhook", "handle", "tls_context"]

log = logging.getLogger("snapguard.webhook")

MUTATE_PATH, HEALTH_PATH = "/mutate", "/healthz"
MAX_CONNECTIONS = 64


@dataclass(frozen=True)
class ServerConfig:
    """Where the server listens and its bounds."""

    tls_cert: str
    tls_key: str
    address: str = "0.0.0.0"
    port: int = 8443
    max_body_bytes: int = 4 << 20  # an AdmissionReview of the largest pod etcd stores (1.5 MiB), twice
    io_timeout_s: float = 10.0  # the API server's own timeoutSeconds is at most 30
    lookup_timeout_s: float = 3.0  # the store's answer; past it the pod starts as written


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context of the PEM pair; WEBHOOK_TLS_UNUSABLE when it does not load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as e:
        raise SnapguardError(Reason.WEBHOOK_TLS_UNUSABLE, f"{e.filename}: no such file") from None
    except (OSError, ssl.SSLError) as e:
        raise SnapguardError(Reason.WEBHOOK_TLS_UNUSABLE, f"{cert} and {key}: {getattr(e, 'strerror', None) or e}"
                             ) from None
    return ctx


class _Lookups:
    """The store's answers, each within a deadline, on a few threads: a store that hangs costs
    a warning per pod, never the pod."""

    def __init__(self, source: SnapshotSource | None, timeout_s: float) -> None:
        self.source, self.timeout_s = source, timeout_s
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="snapguard-webhook-lookup")

    def restorable(self, job: str) -> Any:
        assert self.source is not None
        future = self.pool.submit(self.source.restorable, job)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            future.cancel()
            raise SnapguardError(Reason.STORE_TOO_SLOW, f"the store did not answer for job {job} within "
                                 f"{self.timeout_s:g} s") from None


def handle(body: bytes, config: mutate.WebhookConfig, lookups: Any) -> review.Answer:
    """The answer to one AdmissionReview body (ADMISSION_REVIEW_INVALID when it is not one); a
    fault while the pod's patch is made is the answer's warning, the pod admitted as it came."""
    rv = review.parse(body)
    answer = review.Answer(rv.uid, rv.subject)
    try:
        return _mutate(rv, config, lookups, answer)
    except Exception as e:
        failure = failure_from(e)
        log.error("review %s %s: %s", rv.uid, rv.subject, failure.message)
        return review.Answer(rv.uid, rv.subject, warnings=[f"snapguard: pod not changed: {failure.message}"],
                             actions=["unchanged: the webhook failed"])


def _mutate(rv: review.Review, config: mutate.WebhookConfig, lookups: Any, answer: review.Answer) -> review.Answer:
    if not rv.is_pod_create or rv.object is None:
        return answer
    pod = rv.object
    problem = review.pod_problem(pod)
    if problem:
        answer.warn(f"snapguard: pod not changed: it cannot be read ({problem})")
        return answer
    job, why = mutate.opted_in(pod, config)
    if job is None:
        answer.actions.append(f"not opted in: {why}")
        if (pod.get("metadata", {}).get("annotations") or {}).get(mutate.JOB_ANNOTATION) is not None:
            answer.warn(f"snapguard: pod not changed: {why}")
        return answer
    if config.inject:
        mutate.take_point_patch(pod, config, answer)
    if lookups is not None and lookups.source is not None:
        try:
            found = lookups.restorable(job)
        except Exception as e:  # the store's fault is the pod's warning, never its refusal
            failure = failure_from(e)
            answer.warn(f"{failure.message}; the pod starts as written")
        else:
            if found.image is None:
                answer.actions.append(f"no restore: {found.why_not}")
            else:
                mutate.restore_patch(pod, found.image, found.attempt_epoch, answer)
    return answer


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Webhook
    protocol_version = "HTTP/1.1"
    server_version = "snapguard-webhook"
    sys_version = ""

    def setup(self) -> None:
        self.request.settimeout(self.server.config.io_timeout_s)
        self.request = self.server.context().wrap_socket(self.request, server_side=True)
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, code: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, code: int, reason: str, message: str, unread: bool = True) -> None:
        """A Status answer, and the connection closed; `unread`: the body is still coming."""
        log.warning("refused %s %s: %d %s", self.command, self.path[:100], code, message)
        self.close_connection = True
        self._send(code, review.status(code, reason, message))
        if unread:
            self._linger()

    def _linger(self) -> None:
        """Read and drop what the client still sends (for a second, a few MiB at most) before the
        close: a close with unread bytes resets the connection, and the client would lose the answer."""
        import time

        self.wfile.flush()
        deadline, left = time.monotonic() + 1.0, 8 << 20
        try:
            while left > 0 and time.monotonic() < deadline:
                self.request.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = self.request.recv(min(left, 65536))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    def do_GET(self) -> None:
        if self.path == HEALTH_PATH:
            data = b"ok\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        code, why = (405, "MethodNotAllowed") if self.path == MUTATE_PATH else (404, "NotFound")
        self._refuse(code, why, f"snapguard webhook: GET {self.path[:100]}: POST AdmissionReviews to {MUTATE_PATH}",
                     unread=False)

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != MUTATE_PATH:
            self._refuse(404, "NotFound", f"snapguard webhook: no {self.path[:100]}; POST AdmissionReviews to "
                         f"{MUTATE_PATH}")
            return
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            self._refuse(415, "UnsupportedMediaType", f"snapguard webhook: Content-Type {ctype[:60]!r}, not "
                         "application/json")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._refuse(411, "LengthRequired", "snapguard webhook: a Content-Length is required")
            return
        limit = self.server.config.max_body_bytes
        if int(length) > limit:
            self._refuse(413, "RequestEntityTooLarge", f"snapguard {Reason.ADMISSION_REVIEW_INVALID.name}: the "
                         f"body of {int(length)} bytes is larger than {limit}")
            return
        body = self.rfile.read(int(length))
        try:
            answer = handle(body, self.server.webhook, self.server.lookups)
        except SnapguardError as e:
            self._refuse(400, "BadRequest", e.failure.message, unread=False)
            return
        except Exception as e:  # the boundary: a fault of the webhook's is a typed line, never a traceback
            failure = failure_from(e)
            log.error("review failed: %s", failure.message)
            self._refuse(500, "InternalError", failure.message, unread=False)
            return
        log.info("review %s %s: %s%s", answer.uid, answer.subject, "; ".join(answer.actions) or "unchanged",
                 "".join(f"; warning: {w}" for w in answer.warnings))
        self._send(200, answer.review())


class Webhook(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """The server: `serve_forever()` answers until `shutdown()`; `server_close()` releases the port."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, config: ServerConfig, webhook: mutate.WebhookConfig, source: SnapshotSource | None) -> None:
        self.config, self.webhook = config, webhook
        self.lookups = _Lookups(source, config.lookup_timeout_s)
        self._tls_lock = threading.Lock()
        self._tls_stamp = self._stamp()
        self._tls = tls_context(config.tls_cert, config.tls_key)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        if ":" in config.address:
            self.address_family = socket.AF_INET6
        super().__init__((config.address, config.port), _Handler)

    def server_bind(self) -> None:
        # http.server's would look the address up in DNS (getfqdn): a start that can hang
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def _stamp(self) -> tuple[Any, ...]:
        out = []
        for path in (self.config.tls_cert, self.config.tls_key):
            try:
                st = os.stat(path)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def context(self) -> ssl.SSLContext:
        """The TLS context, loaded again when the files changed (the old one while a new one fails)."""
        stamp = self._stamp()
        with self._tls_lock:
            if stamp != self._tls_stamp:
                self._tls_stamp = stamp
                try:
                    self._tls = tls_context(self.config.tls_cert, self.config.tls_key)
                    log.info("TLS certificate and key loaded again")
                except SnapguardError as e:
                    log.error("%s; the previous certificate stays in use", e.failure.message)
            return self._tls

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("more than %d connections: %s closed unanswered", MAX_CONNECTIONS, client_address)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that left mid TLS handshake or mid request: one line, never a traceback
        import sys

        e = sys.exc_info()[1]
        log.info("connection from %s ended: %s", client_address[0] if client_address else "?",
                 failure_from(e).detail if e else "?")

    def server_close(self) -> None:
        super().server_close()
        self.lookups.pool.shutdown(wait=False, cancel_futures=True)
