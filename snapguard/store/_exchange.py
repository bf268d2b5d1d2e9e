"""Deadlines a store enforces itself: one for each exchange with the store, one for a whole
push or pull.

An exchange is one request with all of it: the connect, the request's body, the answer's headers
and body, and the retries the client makes. It runs in a thread of its own; the caller waits for
it at most its budget (`budget_s`: a base for a small request plus the body's size at the slowest
rate allowed), then raises STORE_TOO_SLOW. At that moment the sockets the exchange used are shut
down, so that a peer that never answers or trickles its answer a byte at a time cannot hold the
thread either, and a retry it would start is refused. Per-read socket timeouts alone bound no
exchange: a peer that sends one byte per timeout keeps a read alive for ever.

A push or pull runs inside `operation(deadline_s)`: every exchange's budget is cut to what is left
of it, and `check()` (called between parts and by Progress on every update) raises STORE_TOO_SLOW
once it has passed. Threads that work for an operation carry it with `carry()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..reasons import Reason, SnapguardError

__all__ = ["EXCHANGE_S", "MIN_RATE_BPS", "Exchange", "budget_s", "by_size", "carry", "cleanup", "check", "operation",
           "overall_s",
           "remaining", "track_connections"]

T = TypeVar("T")

EXCHANGE_S = 30.0  # a small request, connect to last byte, retries included
MIN_RATE_BPS = 1 << 20  # the slowest a body may move: 1 MiB/s
CONNECT_S = 5.0

_end: contextvars.ContextVar[tuple[float, float, str] | None] = contextvars.ContextVar("snapguard_store_deadline",
                                                                                        default=None)
# inside an operation: whether its deadline was given (True) or is still to come from its size (False)
_explicit: contextvars.ContextVar[bool | None] = contextvars.ContextVar("snapguard_store_deadline_given",
                                                                        default=None)
_local = threading.local()  # the exchange the current thread runs, for the connection pools


def budget_s(size: int = 0, base_s: float = EXCHANGE_S, min_rate_bps: float = MIN_RATE_BPS) -> float:
    """The allowance of one exchange that moves `size` bytes."""
    return base_s + size / min_rate_bps


def overall_s(total: int, base_s: float = EXCHANGE_S, min_rate_bps: float = MIN_RATE_BPS) -> float:
    """The default deadline of a whole push or pull of `total` bytes."""
    return 4 * base_s + total / min_rate_bps


@contextlib.contextmanager
def operation(deadline_s: float | None, what: str) -> Iterator[None]:
    """Bound everything inside by `deadline_s` from now (None: by the enclosing operation only, or
    by what `by_size` sets once the size is known)."""
    outer = _end.get()
    cur = outer
    if deadline_s is not None:
        end = time.monotonic() + max(0.0, deadline_s)
        if outer is None or end < outer[0]:
            cur = (end, deadline_s, what)
    token, given = _end.set(cur), _explicit.set(cur is not None)
    try:
        yield
    finally:
        _explicit.reset(given)
        _end.reset(token)


@contextlib.contextmanager
def cleanup(what: str, seconds: float = EXCHANGE_S) -> Iterator[None]:
    """Best-effort removal after a failure: a short deadline of its own in place of the
    operation's (which may be what has just passed)."""
    token, given = _end.set((time.monotonic() + seconds, seconds, what)), _explicit.set(True)
    try:
        yield
    finally:
        _explicit.reset(given)
        _end.reset(token)


def by_size(total: int, what: str) -> None:
    """Inside `operation`: where no deadline was given, the default one for `total` bytes
    (`overall_s`) from now."""
    if _explicit.get() is not False:  # given, or not inside an operation at all
        return
    _explicit.set(True)
    seconds = overall_s(total)
    _end.set((time.monotonic() + seconds, seconds, what))


def remaining() -> float | None:
    """Seconds left of the operation under way (None: none is)."""
    cur = _end.get()
    return None if cur is None else cur[0] - time.monotonic()


def check(store_url: str = "") -> None:
    """STORE_TOO_SLOW once the operation under way is past its deadline."""
    cur = _end.get()
    if cur is not None and time.monotonic() >= cur[0]:
        raise SnapguardError(Reason.STORE_TOO_SLOW, f"{cur[2]}: not done within its {cur[1]:g} s deadline",
                             evidence={"store": store_url, "deadline_s": cur[1]})


def carry(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` to run in another thread under the caller's operation deadline."""
    ctx = contextvars.copy_context()
    return lambda *a, **kw: ctx.copy().run(fn, *a, **kw)


class _Expired(Exception):
    """Raised in an abandoned exchange's thread when its client would send again."""


class Exchange:
    """One request run under its budget (see the module docstring)."""

    def __init__(self, what: str, store_url: str, budget: float) -> None:
        self.what, self.store_url = what, store_url
        left = remaining()
        self.budget = budget if left is None else min(budget, left)
        cur = _end.get()
        self.cut_by = cur if cur is not None and left is not None and left < budget else None
        self.conns: list[Any] = []
        self.expired = False
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T]) -> T:
        check(self.store_url)
        box: list[Any] = []
        done = threading.Event()

        def work() -> None:
            _local.exchange = self
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the caller, which raises it
                box.append((False, e))
            finally:
                _local.exchange = None
                done.set()

        t = threading.Thread(target=carry(work), name=f"store {self.what}"[:60], daemon=True)
        t.start()
        if not done.wait(max(0.0, self.budget)):
            self.expire()
            if self.cut_by is not None:
                raise SnapguardError(Reason.STORE_TOO_SLOW, f"{self.cut_by[2]}: not done within its "
                                     f"{self.cut_by[1]:g} s deadline ({self.store_url}: {self.what} under way)",
                                     evidence={"store": self.store_url, "deadline_s": self.cut_by[1]})
            raise SnapguardError(Reason.STORE_TOO_SLOW, f"{self.store_url}: {self.what}: no whole answer within "
                                 f"{self.budget:.3g} s", evidence={"store": self.store_url, "budget_s": self.budget})
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def expire(self) -> None:
        """Shut down every socket the exchange used: its thread's reads and writes end at once."""
        with self._lock:
            self.expired = True
            conns = list(self.conns)
        for conn in conns:
            sock = getattr(conn, "sock", None)
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def used(self, conn: Any) -> None:
        with self._lock:
            self.conns.append(conn)
            expired = self.expired
        if expired:
            raise _Expired(self.what)

    @staticmethod
    def current() -> Exchange | None:
        return getattr(_local, "exchange", None)


def _refuse_if_expired(**_: Any) -> None:
    ex = Exchange.current()
    if ex is not None and ex.expired:
        raise _Expired(ex.what)


def track_connections(client: Any) -> bool:
    """Have a boto3 client's connection pools tell the exchange under way which connection it
    uses, and refuse a retry once the exchange expired. False where this botocore's session does
    not have the pools where they are looked for (the exchange then ends at its deadline for the
    caller, and its thread at the socket's read timeout)."""
    client.meta.events.register("before-send", _refuse_if_expired)
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    pools = getattr(session, "_pool_classes_by_scheme", None)
    if not isinstance(pools, dict):
        return False
    for scheme, cls in list(pools.items()):
        if not isinstance(cls, type) or getattr(cls, "_snapguard_tracked", False):
            continue

        def _get_conn(self: Any, timeout: Any = None, _base: Any = cls) -> Any:
            conn = _base._get_conn(self, timeout)
            ex = Exchange.current()
            if ex is not None:
                ex.used(conn)
            return conn

        pools[scheme] = type(f"Tracked{cls.__name__}", (cls,), {"_get_conn": _get_conn, "_snapguard_tracked": True})
    return True
