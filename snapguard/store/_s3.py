"""s3://bucket/prefix through boto3 (the `s3` extra).

Small objects are one put with Content-MD5 and x-amz-checksum-sha256; files over 64 MiB are
multipart uploads of 64 MiB parts (one part per span of the manifest's digest scheme), several in
flight, each with its MD5 and SHA-256. What the store answers is checked, never taken on trust:
a put or a part is confirmed only by an ETag that is the content's MD5 or by the SHA-256 it echoes
(a server that answers 200 to anything confirms nothing: STORE_WRITE_UNCONFIRMED); a completed
upload's ETag must be the MD5 of its parts' MD5s with "-<parts>" (or at least of that form where
the parts were confirmed by checksum). Before an image's marker, `_stored` lists the image and
checks every object's size and the ETag its put established. The marker and the epochs are single
create-only puts (`If-None-Match: *`; a multipart completion ignores it). Downloads are ranged GETs
of 64 MiB spans in parallel, each hashed as its bytes arrive and written in place.

Every request is an exchange under a deadline of its own (snapguard.store._exchange: connect,
body, answer and retries together, `exchange_s` plus the body at `min_rate_bps`), inside the
deadline of the push or pull it belongs to. The endpoint: `endpoint_url`, else boto3's own
(AWS_ENDPOINT_URL_S3 and the usual configuration chain).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..reasons import Reason, SnapguardError
from . import _exchange
from ._base import Store
from ._digest import SPAN, spans
from ._members import read_span
from ._records import Progress

__all__ = ["S3Store"]

T = TypeVar("T")
_CHUNK = 1 << 20
_MAX_PAGES = 1000  # a listing of more than 1000 pages (a million keys) is not a job's
_MULTI_ETAG = re.compile(r"[0-9a-f]{32}-([0-9]+)\Z")
_LOADER: list[Any] = []  # botocore's service-model loader, shared by every store's session
_LOADER_LOCK = threading.Lock()


def _session() -> Any:
    """A boto3 session of its own, so the credentials are resolved now (boto3's default session
    keeps the first it resolved), sharing one loader of botocore's service models (a session that
    loads them afresh costs about 90 ms against 20 ms)."""
    import boto3
    import botocore.session

    core = botocore.session.Session()
    with _LOADER_LOCK:
        if not _LOADER:
            _LOADER.append(core.get_component("data_loader"))
        core.register_component("data_loader", _LOADER[0])
    return boto3.session.Session(botocore_session=core)


def _md5(data: bytes) -> tuple[str, str]:
    d = hashlib.md5(data, usedforsecurity=False)
    return base64.b64encode(d.digest()).decode(), d.hexdigest()


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _shown(value: Any) -> str:
    text = str(value or "")
    return repr(text[:70] + ("..." if len(text) > 70 else "")) if text else "none"


class S3Store(Store):
    scheme = "s3"

    def __init__(self, url: str, bucket: str, prefix: str, *, endpoint_url: str | None = None,
                 parallel: int = 4, exchange_s: float = _exchange.EXCHANGE_S,
                 min_rate_bps: float = _exchange.MIN_RATE_BPS) -> None:
        super().__init__(url)
        try:
            import boto3  # noqa: F401 - only that it is there
            import botocore.config
        except ImportError:
            raise SnapguardError(Reason.STORE_UNREACHABLE, "s3:// stores need boto3 (pip install 'snapguard[s3]')"
                                 ) from None
        self.bucket, self.prefix, self.parallel = bucket, prefix.strip("/"), max(1, parallel)
        self.exchange_s, self.min_rate_bps = exchange_s, min_rate_bps
        cfg = botocore.config.Config(s3={"addressing_style": "path"},
                                     connect_timeout=min(_exchange.CONNECT_S, exchange_s), read_timeout=exchange_s,
                                     retries={"max_attempts": 3, "mode": "standard"},
                                     max_pool_connections=max(10, 2 * self.parallel),
                                     request_checksum_calculation="when_required",
                                     response_checksum_validation="when_required")
        self.client = _session().client(
            "s3", endpoint_url=endpoint_url or os.environ.get("S3_ENDPOINT_URL") or None, config=cfg)
        _exchange.track_connections(self.client)
        self._etags: dict[str, str] = {}  # key -> the ETag its confirmed put established
        self._etag_lock = threading.Lock()

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T], size: int = 0) -> T:
        """One S3 exchange under its deadline, its failures typed: can't connect, credentials or
        bucket refused, an answer that is not S3's: STORE_UNREACHABLE; no whole answer in time:
        STORE_TOO_SLOW."""
        from botocore import exceptions as bx

        budget = _exchange.budget_s(size, self.exchange_s, self.min_rate_bps)
        try:
            return _exchange.Exchange(what, self.url, budget).run(fn)
        except bx.ReadTimeoutError as e:
            raise SnapguardError(Reason.STORE_TOO_SLOW, f"{self.url}: {what}: {e}", evidence={"store": self.url}
                                 ) from None
        except bx.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", "?"))[:80]
            message = str(e.response.get("Error", {}).get("Message", ""))[:200]
            raise SnapguardError(Reason.STORE_UNREACHABLE, f"{self.url}: {what}: {code}: {message}",
                                 evidence={"store": self.url, "code": code}) from None
        except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.NoCredentialsError,
                bx.ConnectionClosedError) as e:
            raise SnapguardError(Reason.STORE_UNREACHABLE, f"{self.url}: {what}: {e}", evidence={"store": self.url}
                                 ) from None
        except bx.BotoCoreError as e:  # an answer boto3 cannot parse: not an S3 service
            detail = " ".join(str(e).split())[:200]
            raise SnapguardError(Reason.STORE_UNREACHABLE, f"{self.url}: {what}: the answer is not S3's: {detail}",
                                 evidence={"store": self.url}) from None

    @staticmethod
    def _code(e: Exception) -> str:
        return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))

    def _confirmed(self, what: str, key: str, r: Any, md5_hex: str, sha_b64: str) -> str:
        """The ETag of a put or part the store confirmed: its MD5, or the SHA-256 it echoed."""
        etag = str(r.get("ETag") or "").strip('"') if isinstance(r, dict) else ""
        echoed = r.get("ChecksumSHA256") if isinstance(r, dict) else None
        if etag != md5_hex and echoed != sha_b64:
            raise SnapguardError(Reason.STORE_WRITE_UNCONFIRMED, f"{self.url}: {what}: the store answered ETag "
                                 f"{_shown(etag)} and checksum {_shown(echoed)}; the content's MD5 is {md5_hex}",
                                 evidence={"store": self.url, "key": key})
        return etag

    def _remember(self, key: str, etag: str | None) -> None:
        with self._etag_lock:
            if etag is None:
                self._etags.pop(key, None)
            else:
                self._etags[key] = etag

    def _put_args(self, key: str, data: bytes, sha: bytes | None = None) -> tuple[dict[str, Any], str, str]:
        b64, hexd = _md5(data)
        sha_b64 = _b64(sha or hashlib.sha256(data).digest())
        return ({"Bucket": self.bucket, "Key": self._key(key), "Body": data, "ContentMD5": b64,
                 "ChecksumSHA256": sha_b64}, hexd, sha_b64)

    def _put(self, key: str, data: bytes, sha: bytes | None = None) -> None:
        args, hexd, sha_b64 = self._put_args(key, data, sha)
        r = self._call(f"put {key}", lambda: self.client.put_object(**args), len(data))
        self._remember(key, self._confirmed(f"put {key}", key, r, hexd, sha_b64))

    def _put_new(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        args, hexd, sha_b64 = self._put_args(key, data)

        def put() -> Any:
            try:
                return self.client.put_object(**args, IfNoneMatch="*")
            except ClientError as e:
                if self._code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                    return None
                raise

        r = self._call(f"create {key}", put, len(data))
        if r is None:
            return False
        self._remember(key, self._confirmed(f"create {key}", key, r, hexd, sha_b64))
        return True

    def _get(self, key: str, cap: int = 64 << 20) -> bytes | None:
        from botocore.exceptions import ClientError

        def get() -> bytes | None:
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                if self._code(e) in ("NoSuchKey", "404"):
                    return None
                raise
            body = r["Body"]
            try:
                if int(r.get("ContentLength") or 0) > cap:
                    raise SnapguardError(Reason.IMAGE_CORRUPT, f"store object {key} is over {cap} bytes")
                data = bytes(body.read(cap + 1))
            finally:
                body.close()
            if len(data) > cap:
                raise SnapguardError(Reason.IMAGE_CORRUPT, f"store object {key} is over {cap} bytes")
            return data

        return self._call(f"get {key}", get, cap)

    def _objects(self, prefix: str) -> list[dict[str, Any]]:
        """Every object under `prefix` as the listing says it: Key (relative), Size, ETag."""
        full = self._key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        pages = iter(self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full))
        out: list[dict[str, Any]] = []
        for n in range(_MAX_PAGES + 1):
            page = self._call(f"list {prefix or '/'}", lambda: next(pages, None))
            if page is None:
                break
            if n == _MAX_PAGES:
                raise SnapguardError(Reason.STORE_UNREACHABLE, f"{self.url}: list {prefix or '/'}: more than "
                                     f"{_MAX_PAGES} pages", evidence={"store": self.url})
            for o in page.get("Contents", []) if isinstance(page, dict) else []:
                key = o.get("Key") if isinstance(o, dict) else None
                if isinstance(key, str) and key.startswith(full):
                    out.append({"Key": key[strip:], "Size": o.get("Size"), "ETag": str(o.get("ETag") or "").strip('"')})
        return sorted(out, key=lambda o: o["Key"])

    def _list(self, prefix: str) -> list[str]:
        return [o["Key"] for o in self._objects(prefix)]

    def _stored(self, prefix: str) -> dict[str, int | None]:
        """The objects under `prefix` with their listed sizes; STORE_WRITE_UNCONFIRMED where one's
        listed ETag is not the one its confirmed put established."""
        out: dict[str, int | None] = {}
        for o in self._objects(prefix):
            want = self._etags.get(o["Key"])
            if want is not None and not self._etag_matches(want, o["ETag"]):
                raise SnapguardError(Reason.STORE_WRITE_UNCONFIRMED, f"{self.url}: {o['Key']} is listed with ETag "
                                     f"{_shown(o['ETag'])}, its upload was confirmed as {want}",
                                     evidence={"store": self.url, "key": o["Key"]})
            size = o["Size"]
            out[o["Key"]] = size if isinstance(size, int) and not isinstance(size, bool) else -1
        return out

    @staticmethod
    def _etag_matches(want: str, got: str) -> bool:
        if want.startswith("*-"):  # a multipart upload whose parts were confirmed by checksum: its form only
            m = _MULTI_ETAG.match(got)
            return m is not None and m.group(1) == want[2:]
        return got == want

    def _delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)))
        self._remember(key, None)

    # ---- multipart --------------------------------------------------------------------------
    def _begin(self, key: str) -> dict[str, Any]:
        k = self._key(key)
        r = self._call(f"start upload {key}", lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=k, ChecksumAlgorithm="SHA256"))
        upload_id = r.get("UploadId") if isinstance(r, dict) else None
        if not isinstance(upload_id, str) or not upload_id:
            raise SnapguardError(Reason.STORE_WRITE_UNCONFIRMED, f"{self.url}: start upload {key}: the store "
                                 "answered no upload id", evidence={"store": self.url, "key": key})
        return {"key": key, "k": k, "id": upload_id, "parts": {}, "lock": threading.Lock()}

    def _part(self, handle: dict[str, Any], index: int, data: bytes, sha: bytes | None = None) -> None:
        b64, hexd = _md5(data)
        sha_b64 = _b64(sha or hashlib.sha256(data).digest())
        key, k, n = handle["key"], handle["k"], index + 1
        what = f"upload part {n} of {key}"
        r = self._call(what, lambda: self.client.upload_part(
            Bucket=self.bucket, Key=k, UploadId=handle["id"], PartNumber=n, Body=data, ContentMD5=b64,
            ChecksumSHA256=sha_b64), len(data))
        etag = self._confirmed(what, key, r, hexd, sha_b64)
        with handle["lock"]:
            handle["parts"][n] = (str(r["ETag"]), sha_b64, etag == hexd, hexd)

    def _commit(self, handle: dict[str, Any]) -> None:
        parts = sorted(handle["parts"].items())
        if [n for n, _ in parts] != list(range(1, len(parts) + 1)):
            raise SnapguardError(Reason.UPLOAD_INCOMPLETE, f"{handle['key']}: parts {[n for n, _ in parts][:10]} "
                                 "are not 1..n", evidence={"store": self.url})
        listed = [{"PartNumber": n, "ETag": etag, "ChecksumSHA256": sha} for n, (etag, sha, _, _) in parts]
        what = f"complete upload {handle['key']}"
        r = self._call(what, lambda: self.client.complete_multipart_upload(
            Bucket=self.bucket, Key=handle["k"], UploadId=handle["id"], MultipartUpload={"Parts": listed}))
        if all(by_md5 for _, (_, _, by_md5, _) in parts):
            want = hashlib.md5(b"".join(bytes.fromhex(h) for _, (_, _, _, h) in parts),
                               usedforsecurity=False).hexdigest() + f"-{len(parts)}"
        else:
            want = f"*-{len(parts)}"
        got = str(r.get("ETag") or "").strip('"') if isinstance(r, dict) else ""
        # an empty ETag is what radosgw 16 answers here: the listing before the marker checks it
        if got and not self._etag_matches(want, got):
            raise SnapguardError(Reason.STORE_WRITE_UNCONFIRMED, f"{self.url}: {what}: the store answered ETag "
                                 f"{_shown(got)}, the parts make {want}", evidence={"store": self.url})
        self._remember(handle["key"], want)

    def _abort(self, handle: dict[str, Any]) -> None:
        try:
            with _exchange.cleanup(f"abort upload {handle['key']}"):  # also after the push's deadline
                self._call(f"abort upload {handle['key']}", lambda: self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=handle["k"], UploadId=handle["id"]))
        except Exception:  # best effort: an unfinished multipart upload is never an object
            pass

    def _upload(self, key: str, fd: int, size: int, progress: Progress) -> list[bytes]:
        if size <= SPAN:
            data = read_span(fd, 0, size)
            sha = hashlib.sha256(data).digest()
            self._put(key, data, sha)
            progress.add(len(data))
            return [sha]
        handle = self._begin(key)
        try:
            def part(args: tuple[int, tuple[int, int]]) -> bytes:
                i, (off, length) = args
                _exchange.check(self.url)
                data = read_span(fd, off, length)
                sha = hashlib.sha256(data).digest()
                self._part(handle, i, data, sha)
                progress.add(len(data))
                return sha

            with ThreadPoolExecutor(max_workers=self.parallel) as pool:
                digests = list(pool.map(_exchange.carry(part), enumerate(spans(size))))
            self._commit(handle)
        except BaseException:
            self._abort(handle)
            raise
        return digests

    def _sweep(self, prefix: str) -> int:
        full = self._key(prefix)
        ups = iter(self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=full))
        gone = 0
        for _ in range(_MAX_PAGES):
            page = self._call(f"list unfinished uploads under {prefix}", lambda: next(ups, None))
            if page is None:
                break
            for up in page.get("Uploads", []) if isinstance(page, dict) else []:
                self._call(f"abort unfinished upload {up.get('Key')}", lambda up=up: self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]))
                gone += 1
        return gone

    # ---- download ---------------------------------------------------------------------------
    def _download(self, key: str, size: int, out_fd: int, progress: Progress) -> list[bytes]:
        from botocore.exceptions import ClientError

        k = self._key(key)

        def span(args: tuple[int, int]) -> bytes:
            off, length = args
            h = hashlib.sha256()
            if length == 0:
                return h.digest()

            def get_span() -> None:
                """The ranged GET and its whole body: one exchange, one deadline."""
                try:
                    r = self.client.get_object(Bucket=self.bucket, Key=k, Range=f"bytes={off}-{off + length - 1}")
                except ClientError as e:
                    if self._code(e) in ("NoSuchKey", "404", "InvalidRange"):
                        raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {key} is missing or short in the "
                                             "store", evidence={"store": self.url, "key": key}) from None
                    raise
                ex = _exchange.Exchange.current()
                got, body = 0, r["Body"]
                try:
                    while True:
                        block = body.read(_CHUNK)
                        if not block or (ex is not None and ex.expired):
                            break
                        if got + len(block) > length:
                            raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {key}: the store sent more "
                                                 "than asked", evidence={"store": self.url, "key": key})
                        h.update(block)
                        os.pwrite(out_fd, block, off + got)
                        got += len(block)
                        progress.add(len(block))
                finally:
                    body.close()
                if got != length:
                    raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {key}: {got} of {length} bytes at "
                                         f"{off}", evidence={"store": self.url, "key": key})

            self._call(f"get {key} at {off}", get_span, length)
            return h.digest()

        if size > 0:
            head = self._call(f"head {key}", lambda: self._head(k))
            if head is None or head != size:
                raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {key} in the store has "
                                     f"{'no object' if head is None else f'{head} bytes'}, manifest says {size}",
                                     evidence={"store": self.url, "key": key})
        todo = spans(size)
        if len(todo) == 1:
            return [span(todo[0])]
        with ThreadPoolExecutor(max_workers=self.parallel) as pool:
            return list(pool.map(_exchange.carry(span), todo))

    def _head(self, k: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            r = self.client.head_object(Bucket=self.bucket, Key=k)
        except ClientError as e:
            if self._code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        size = r.get("ContentLength")
        return size if isinstance(size, int) else -1
