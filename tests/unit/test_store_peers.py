"""s3:// stores against loopback servers that misbehave the way a hostile or broken endpoint does:
one that accepts and never answers, one that trickles its answer a byte at a time, one that
answers 200 with HTML to everything, one whose ETags are not the content's. Each must end with a
typed reason within the deadline snapguard sets (short ones here, through the store's parameters),
and nothing may be marked whole. The servers speak HTTP/1.1 over real sockets; boto3 is the real
client."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from snapguard import image
from snapguard.procfs import host_facts
from snapguard.reasons import Reason, SnapguardError
from snapguard.store import Progress, _json

pytest.importorskip("boto3")
from snapguard.store._s3 import S3Store  # noqa: E402

Handler = Callable[[socket.socket, str, str, dict[str, str], bytes], None]


class Peer:
    """A loopback HTTP server: `handler(conn, method, target, headers, body)` answers each request
    (or does not). `closed` counts connections whose client went away (EOF or reset)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[tuple[str, str]] = []
        self.closed = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        self.closed += 1
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                length = int(headers.get("content-length", "0"))
                if headers.get("expect", "").lower() == "100-continue":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                while len(buf) < length:
                    data = conn.recv(65536)
                    if not data:
                        self.closed += 1
                        return
                    buf += data
                body, buf = buf[:length], buf[length:]
                self.requests.append((method, target))
                self.handler(conn, method, target, headers, body)
        except OSError:
            self.closed += 1
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()


def answer(conn: socket.socket, status: str, body: bytes = b"", headers: dict[str, str] | None = None,
           head_only: bool = False) -> None:
    hdrs = {"Content-Length": str(len(body)), **(headers or {})}
    out = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    conn.sendall(out.encode() + (b"" if head_only else body))


EMPTY_LIST = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
              b'2006-03-01/"><Name>b</Name><KeyCount>0</KeyCount><IsTruncated>false</IsTruncated></ListBucketResult>')


def listing(*keys: tuple[str, int]) -> bytes:
    items = "".join(f"<Contents><Key>{k}</Key><Size>{n}</Size><ETag>&quot;0&quot;</ETag></Contents>" for k, n in keys)
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f'<Name>b</Name><KeyCount>{len(keys)}</KeyCount><IsTruncated>false</IsTruncated>{items}'
            '</ListBucketResult>').encode()


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"AWS_ACCESS_KEY_ID": "TESTKEY", "AWS_SECRET_ACCESS_KEY": "testsecret",
                 "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/dev/null",
                 "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("S3_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)


@pytest.fixture
def peer() -> Iterator[Callable[[Handler], Peer]]:
    started: list[Peer] = []

    def start(handler: Handler) -> Peer:
        started.append(Peer(handler))
        return started[-1]

    yield start
    for p in started:
        p.stop()


def store_at(p: Peer, **kw: float) -> S3Store:
    return S3Store("s3://b/snaps", "b", "snaps", endpoint_url=p.url, parallel=2, **kw)


@pytest.fixture
def sealed(tmp_path: Path) -> Path:
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    (d / "pages-1.img").write_bytes(os.urandom(200_000))
    (d / "core-1.img").write_bytes(b"core")
    image.seal(str(d), {"container_id": "c", "criu_version": "4.2.1", "host": host_facts(), "processes": []})
    return d


def typed(fn: Callable[[], object], within: float) -> SnapguardError:
    t0 = time.monotonic()
    with pytest.raises(SnapguardError) as e:
        fn()
    took = time.monotonic() - t0
    assert took < within, f"{e.value} came after {took:.1f} s, not within {within} s"
    assert "\n" not in str(e.value)
    return e.value


def wait_for(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.mark.timeout(30)
def test_an_endpoint_that_accepts_and_never_answers_is_too_slow_within_the_exchange_deadline(peer) -> None:
    p = peer(lambda conn, *_: conn.recv(1))  # reads the request, answers nothing, waits for the client to go
    e = typed(lambda: store_at(p, exchange_s=1.0).newest("job1"), within=4)
    assert e.reason is Reason.STORE_TOO_SLOW
    # the exchange's socket was shut down at its deadline: the server sees its client go
    assert wait_for(lambda: p.closed >= 1, 3), "the abandoned exchange still holds its connection"


def trickle(conn: socket.socket, data: bytes, every: float) -> None:
    for i in range(len(data)):
        conn.sendall(data[i:i + 1])
        time.sleep(every)


@pytest.mark.timeout(30)
def test_headers_that_never_end_are_too_slow(peer) -> None:
    def headers_forever(conn: socket.socket, *_: object) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        for i in range(10_000):
            conn.sendall(f"x-amz-meta-{i}: a\r\n".encode())
            time.sleep(0.1)  # well inside any per-read timeout

    p = peer(headers_forever)
    e = typed(lambda: store_at(p, exchange_s=1.5).newest("job1"), within=5)
    assert e.reason is Reason.STORE_TOO_SLOW


@pytest.mark.timeout(30)
def test_a_body_trickled_a_byte_at_a_time_is_too_slow(peer, tmp_path: Path) -> None:
    size = 4096

    def handler(conn: socket.socket, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        if method == "HEAD":
            answer(conn, "200 OK", b"", {"Content-Length": str(size), "ETag": '"0"'}, head_only=True)
            return
        conn.sendall(f"HTTP/1.1 206 Partial Content\r\nContent-Length: {size}\r\n"
                     f"Content-Range: bytes 0-{size - 1}/{size}\r\n\r\n".encode())
        trickle(conn, b"x" * size, 0.05)

    p = peer(handler)
    store = store_at(p, exchange_s=1.0, min_rate_bps=1 << 30)
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        e = typed(lambda: store._download("job1/images/x/pages-1.img", size, out, Progress()), within=4)
    finally:
        os.close(out)
    assert e.reason is Reason.STORE_TOO_SLOW
    assert wait_for(lambda: p.closed >= 1, 3), "the trickling body's connection was not shut down"


@pytest.mark.timeout(30)
def test_a_whole_push_ends_within_its_deadline_though_each_answer_is_in_time(peer, sealed: Path) -> None:
    def slow_but_answering(conn: socket.socket, method: str, target: str, headers: dict[str, str],
                           body: bytes) -> None:
        time.sleep(0.3)
        if method == "GET":
            answer(conn, "200 OK", EMPTY_LIST, {"Content-Type": "application/xml"})
        else:
            answer(conn, "200 OK", b"", {"ETag": '"' + hashlib.md5(body).hexdigest() + '"'})

    p = peer(slow_but_answering)
    e = typed(lambda: store_at(p, exchange_s=5.0).push(str(sealed), "job1", deadline_s=1.0), within=6)
    assert e.reason is Reason.STORE_TOO_SLOW and "1 s deadline" in str(e)


HTML = b"<html><head><title>Welcome</title></head><body><p>It works!</p></body></html>"


@pytest.mark.timeout(30)
def test_an_endpoint_answering_200_html_to_everything_gets_no_push(peer, sealed: Path) -> None:
    p = peer(lambda conn, method, *_: answer(conn, "200 OK", HTML, {"Content-Type": "text/html"},
                                             head_only=method == "HEAD"))
    e = typed(lambda: store_at(p, exchange_s=5.0).push(str(sealed), "job1"), within=10)
    assert e.reason in (Reason.STORE_WRITE_UNCONFIRMED, Reason.STORE_UNREACHABLE), e
    assert not any("snapguard-complete.json" in t for m, t in p.requests if m == "PUT"), "a marker was put"


@pytest.mark.timeout(30)
def test_a_put_answered_with_another_etag_is_unconfirmed_and_nothing_is_marked(peer, sealed: Path) -> None:
    def wrong_etag(conn: socket.socket, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        if method == "GET":
            answer(conn, "200 OK", EMPTY_LIST, {"Content-Type": "application/xml"})
        elif method == "PUT":
            answer(conn, "200 OK", b"", {"ETag": '"' + hashlib.md5(body + b"!").hexdigest() + '"'})
        else:
            answer(conn, "204 No Content")

    p = peer(wrong_etag)
    e = typed(lambda: store_at(p, exchange_s=5.0).push(str(sealed), "job1"), within=10)
    assert e.reason is Reason.STORE_WRITE_UNCONFIRMED and "MD5" in str(e)
    assert not any("snapguard-complete.json" in t for m, t in p.requests if m == "PUT"), "a marker was put"


@pytest.mark.timeout(30)
def test_a_store_that_confirms_puts_but_keeps_nothing_gets_no_marker(peer, sealed: Path) -> None:
    """Every put answered with the right ETag, but the listing never shows the objects: the
    member check before the marker refuses."""
    def forgetful(conn: socket.socket, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        if method == "GET":
            answer(conn, "200 OK", EMPTY_LIST, {"Content-Type": "application/xml"})
        elif method == "PUT":
            answer(conn, "200 OK", b"", {"ETag": '"' + hashlib.md5(body).hexdigest() + '"'})
        else:
            answer(conn, "204 No Content")

    p = peer(forgetful)
    e = typed(lambda: store_at(p, exchange_s=5.0).push(str(sealed), "job1"), within=10)
    assert e.reason is Reason.STORE_WRITE_UNCONFIRMED and "not in the store" in str(e)
    assert not any("snapguard-complete.json" in t for m, t in p.requests if m == "PUT"), "a marker was put"


@pytest.mark.timeout(30)
def test_a_huge_or_deep_record_from_the_endpoint_is_typed(peer) -> None:
    records = {"deep": b'{"location": ' + b"[" * 5000 + b"]" * 5000 + b"}", "list": b"[1, 2]",
               "huge": b'{"location": "' + b"a" * (2 << 20) + b'"}'}

    def handler(conn: socket.socket, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        if "list-type" in target:
            answer(conn, "200 OK", listing(*((f"snaps/job1/file-checkpoints/{k}.json", len(v))
                                             for k, v in records.items())), {"Content-Type": "application/xml"})
            return
        name = target.rsplit("/", 1)[-1].split(".")[0]
        answer(conn, "200 OK", records[name], {"Content-Type": "application/json"})

    p = peer(handler)
    store = store_at(p, exchange_s=5.0)
    assert store.newest_file_checkpoint("job1") is None  # each bad record skipped, no traceback
    for name in records:
        e = typed(lambda: _json.read_record(store, f"job1/file-checkpoints/{name}.json", _json.FILE_CHECKPOINT),
                  within=5)
        assert e.reason is Reason.STORE_RECORD_INVALID, e


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lie", ["part", "complete"])
def test_a_multipart_upload_with_a_wrong_part_or_final_etag_is_unconfirmed(peer, lie: str) -> None:
    def handler(conn: socket.socket, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        if method == "POST" and "uploads" in target:
            answer(conn, "200 OK", b'<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult><Bucket>b'
                   b'</Bucket><Key>k</Key><UploadId>up1</UploadId></InitiateMultipartUploadResult>')
        elif method == "PUT":
            md5 = hashlib.md5(body + (b"!" if lie == "part" else b"")).hexdigest()
            answer(conn, "200 OK", b"", {"ETag": f'"{md5}"'})
        elif method == "POST":
            answer(conn, "200 OK", b'<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult><Bucket>b'
                   b'</Bucket><Key>k</Key><ETag>&quot;' + b"0" * 32 +
                   b'-1&quot;</ETag></CompleteMultipartUploadResult>')
        else:
            answer(conn, "204 No Content")

    store = store_at(peer(handler), exchange_s=5.0)
    handle = store._begin("job1/images/x/pages-1.img")

    def send() -> None:
        store._part(handle, 0, b"span")
        store._commit(handle)

    e = typed(send, within=10)
    assert e.reason is Reason.STORE_WRITE_UNCONFIRMED, e
