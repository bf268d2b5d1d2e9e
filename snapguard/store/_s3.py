"""s3://bucket/prefix through boto3 (the `s3` extra).

Small objects are one put with Content-MD5 (the server refuses a body that does not match it);
files over 64 MiB are multipart uploads of 64 MiB parts (one part per span of the manifest's
digest scheme), several parts in flight, each sent with Content-MD5 and its returned ETag checked
against the MD5 computed here. The marker and the epochs are single create-only puts
(`If-None-Match: *`; a multipart completion ignores it). Downloads are ranged GETs of 64 MiB spans
in parallel, each hashed as its bytes arrive and written in place. The endpoint: `endpoint_url`,
else boto3's own (AWS_ENDPOINT_URL_S3 and the usual configuration chain).
"""

from __future__ import annotations

import base64
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..reasons import Reason, SnapguardError
from ._base import Store
from ._digest import SPAN, spans
from ._members import read_span
from ._records import Progress

__all__ = ["S3Store"]

T = TypeVar("T")
_CHUNK = 1 << 20


def _md5(data: bytes) -> tuple[str, str]:
    d = hashlib.md5(data, usedforsecurity=False)
    return base64.b64encode(d.digest()).decode(), d.hexdigest()


class S3Store(Store):
    scheme = "s3"

    def __init__(self, url: str, bucket: str, prefix: str, *, endpoint_url: str | None = None,
                 parallel: int = 4, connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0) -> None:
        super().__init__(url)
        try:
            import boto3
            import botocore.config
        except ImportError:
            raise SnapguardError(Reason.STORE_UNREACHABLE, "s3:// stores need boto3 (pip install 'snapguard[s3]')"
                                 ) from None
        self.bucket, self.prefix, self.parallel = bucket, prefix.strip("/"), max(1, parallel)
        cfg = botocore.config.Config(s3={"addressing_style": "path"}, connect_timeout=connect_timeout_s,
                                     read_timeout=read_timeout_s, retries={"max_attempts": 3, "mode": "standard"},
                                     max_pool_connections=max(10, 2 * self.parallel),
                                     request_checksum_calculation="when_required",
                                     response_checksum_validation="when_required")
        self.client = boto3.client("s3", endpoint_url=endpoint_url or os.environ.get("S3_ENDPOINT_URL") or None,
                                   config=cfg)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """One S3 request with its failures typed: can't connect, credentials or bucket refused:
        STORE_UNREACHABLE; a read that timed out: STORE_TOO_SLOW."""
        from botocore import exceptions as bx

        try:
            return fn()
        except (bx.ReadTimeoutError,) as e:
            raise SnapguardError(Reason.STORE_TOO_SLOW, f"{self.url}: {what}: {e}", evidence={"store": self.url}
                                 ) from None
        except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.NoCredentialsError,
                bx.ConnectionClosedError) as e:
            raise SnapguardError(Reason.STORE_UNREACHABLE, f"{self.url}: {what}: {e}", evidence={"store": self.url}
                                 ) from None
        except bx.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "?")
            raise SnapguardError(Reason.STORE_UNREACHABLE, f"{self.url}: {what}: {code}: "
                                 f"{e.response.get('Error', {}).get('Message', '')}",
                                 evidence={"store": self.url, "code": code}) from None

    @staticmethod
    def _code(e: Exception) -> str:
        return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))

    def _put(self, key: str, data: bytes) -> None:
        b64, _ = _md5(data)
        self._call(f"put {key}", lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                                                 ContentMD5=b64))

    def _put_new(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        b64, _ = _md5(data)

        def put() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, ContentMD5=b64,
                                       IfNoneMatch="*")
            except ClientError as e:
                if self._code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                    return False
                raise
            return True

        return self._call(f"create {key}", put)

    def _get(self, key: str, cap: int = 64 << 20) -> bytes | None:
        from botocore.exceptions import ClientError

        def get() -> bytes | None:
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                if self._code(e) in ("NoSuchKey", "404"):
                    return None
                raise
            if r["ContentLength"] > cap:
                r["Body"].close()
                raise SnapguardError(Reason.IMAGE_CORRUPT, f"store object {key} is over {cap} bytes")
            return r["Body"].read()

        return self._call(f"get {key}", get)

    def _list(self, prefix: str) -> list[str]:
        full = self._key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0

        def list_all() -> list[str]:
            out = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                out += [o["Key"][strip:] for o in page.get("Contents", [])]
            return sorted(out)

        return self._call(f"list {prefix or '/'}", list_all)

    def _delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)))

    def _upload(self, key: str, fd: int, size: int, progress: Progress) -> list[bytes]:
        if size <= SPAN:
            data = read_span(fd, 0, size)
            self._put(key, data)
            progress.add(len(data))
            return [hashlib.sha256(data).digest()]
        k = self._key(key)
        upload_id = self._call(f"start upload {key}", lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=k)["UploadId"])
        try:
            def part(args: tuple[int, tuple[int, int]]) -> tuple[bytes, dict[str, Any]]:
                i, (off, length) = args
                data = read_span(fd, off, length)
                b64, hexd = _md5(data)
                r = self._call(f"upload part {i + 1} of {key}", lambda: self.client.upload_part(
                    Bucket=self.bucket, Key=k, UploadId=upload_id, PartNumber=i + 1, Body=data, ContentMD5=b64))
                if r["ETag"].strip('"') != hexd:
                    raise SnapguardError(Reason.UPLOAD_INCOMPLETE, f"part {i + 1} of {key}: the store answered "
                                         f"ETag {r['ETag']}, the part's MD5 is {hexd}", evidence={"store": self.url})
                progress.add(len(data))
                return hashlib.sha256(data).digest(), {"PartNumber": i + 1, "ETag": r["ETag"]}

            with ThreadPoolExecutor(max_workers=self.parallel) as pool:
                results = list(pool.map(part, enumerate(spans(size))))
            self._call(f"complete upload {key}", lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=k, UploadId=upload_id,
                MultipartUpload={"Parts": [p for _, p in results]}))
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id)
            except Exception:
                pass
            raise
        return [d for d, _ in results]

    def _begin(self, key: str) -> dict[str, Any]:
        k = self._key(key)
        upload_id = self._call(f"start upload {key}", lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=k)["UploadId"])
        return {"key": key, "k": k, "id": upload_id, "parts": {}}

    def _part(self, handle: dict[str, Any], index: int, data: bytes) -> None:
        b64, hexd = _md5(data)
        key, k, n = handle["key"], handle["k"], index + 1
        r = self._call(f"upload part {n} of {key}", lambda: self.client.upload_part(
            Bucket=self.bucket, Key=k, UploadId=handle["id"], PartNumber=n, Body=data, ContentMD5=b64))
        if r["ETag"].strip('"') != hexd:
            raise SnapguardError(Reason.UPLOAD_INCOMPLETE, f"part {n} of {key}: the store answered ETag "
                                 f"{r['ETag']}, the part's MD5 is {hexd}", evidence={"store": self.url})
        handle["parts"][n] = r["ETag"]

    def _commit(self, handle: dict[str, Any]) -> None:
        parts = [{"PartNumber": n, "ETag": etag} for n, etag in sorted(handle["parts"].items())]
        self._call(f"complete upload {handle['key']}", lambda: self.client.complete_multipart_upload(
            Bucket=self.bucket, Key=handle["k"], UploadId=handle["id"], MultipartUpload={"Parts": parts}))

    def _abort(self, handle: dict[str, Any]) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=handle["k"], UploadId=handle["id"])
        except Exception:  # best effort: an unfinished multipart upload is never an object
            pass

    def _sweep(self, prefix: str) -> int:
        full = self._key(prefix)

        def sweep() -> int:
            gone = 0
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=full):
                for up in page.get("Uploads", []):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    gone += 1
            return gone

        return self._call(f"abort unfinished uploads under {prefix}", sweep)

    def _download(self, key: str, size: int, out_fd: int, progress: Progress) -> list[bytes]:
        from botocore.exceptions import ClientError

        k = self._key(key)

        def span(args: tuple[int, int]) -> bytes:
            off, length = args
            h = hashlib.sha256()
            if length == 0:
                return h.digest()

            def get() -> Any:
                try:
                    return self.client.get_object(Bucket=self.bucket, Key=k, Range=f"bytes={off}-{off + length - 1}")
                except ClientError as e:
                    if self._code(e) in ("NoSuchKey", "404", "InvalidRange"):
                        raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {key} is missing or short in the "
                                             "store", evidence={"store": self.url, "key": key}) from None
                    raise

            r = self._call(f"get {key} at {off}", get)
            got = 0
            body = r["Body"]
            try:
                while True:
                    block = self._call(f"read {key} at {off + got}", lambda: body.read(_CHUNK))
                    if not block:
                        break
                    if got + len(block) > length:
                        raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {key}: the store sent more than "
                                             "asked", evidence={"store": self.url, "key": key})
                    h.update(block)
                    os.pwrite(out_fd, block, off + got)
                    got += len(block)
                    progress.add(len(block))
            finally:
                body.close()
            if got != length:
                raise SnapguardError(Reason.IMAGE_CORRUPT, f"image file {key}: {got} of {length} bytes at {off}",
                                     evidence={"store": self.url, "key": key})
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
            return list(pool.map(span, todo))

    def _head(self, k: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=k)["ContentLength"])
        except ClientError as e:
            if self._code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
