"""Pushing a checkpoint image to a registry over the OCI distribution API, under one deadline.

`push_image` pushes a built CheckpointImage (its layer digested already):

    POST /v2/<repo>/blobs/uploads/            -> 202, Location
    PUT  <Location>?digest=<d>  (the bytes)   -> 201, Docker-Content-Digest must be d
    ... the layer (skipped when HEAD finds it), then the config
    PUT  /v2/<repo>/manifests/<tag>           -> 201, Docker-Content-Digest must be the manifest's
    HEAD /v2/<repo>/manifests/<digest>        -> 200: the registry serves it by digest

`publish_archive` makes and pushes the image of a CRI checkpoint archive with one read of its
bytes: the layer goes up as a streamed upload, hashed as it is sent, and the image (config and
manifest name the layer's digest) is assembled once the digest is known:

    POST /v2/<repo>/blobs/uploads/            -> 202, Location
    PATCH <Location>  (the bytes, hashed)     -> 202, Location
    PUT  <Location>?digest=<d>  (no body)     -> 201, Docker-Content-Digest must be d
    ... then the config and the manifest as above

A registry that refuses the streamed upload (PATCH answered 405 or 501: some registries and the
proxies in front of them allow only monolithic uploads) has already been sent every byte, so the
digest is known: the abandoned session is cancelled (DELETE, its answer ignored) and the layer goes
up as one monolithic PUT ?digest= with the bytes, a second read of the archive.

The whole exchange ends within `deadline_s`: a watchdog shuts the connection's socket down at the
deadline, so a registry that stops answering mid-body cannot hold the push (REGISTRY_TOO_SLOW). A
registry answering another digest than the bytes pushed is REGISTRY_DIGEST_MISMATCH; any other
refusal or a connection error is REGISTRY_UNREACHABLE. Plain http:// is used only when the URL says
so (a registry on the node's loopback or a trusted network); https:// verifies the server's
certificate with the system's CAs. No credentials are sent (a registry that needs them answers
401: REGISTRY_UNREACHABLE naming it).
"""

from __future__ import annotations

import hashlib
import http.client
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from ..reasons import Reason, SnapguardError
from ._image import MT_MANIFEST, CheckpointImage, assemble, scan_archive

__all__ = ["Published", "Pushed", "publish_archive", "push_image"]

_CHUNK = 4 << 20
_REPO = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_MAX_ANSWER = 64 << 10


@dataclass(frozen=True)
class Pushed:
    """An image in the registry: `reference` is HOST/REPO@DIGEST, what a pod spec names."""

    registry: str  # HOST[:PORT]
    repository: str
    tag: str
    digest: str
    size: int  # layer + config + manifest bytes

    @property
    def reference(self) -> str:
        return f"{self.registry}/{self.repository}@{self.digest}"


@dataclass(frozen=True)
class Published:
    """`publish_archive`'s result: the image made, where it is, and where the seconds went
    (scan_s the archive's check, layer_s the layer's streamed upload, rest_s config + manifest)."""

    image: CheckpointImage
    pushed: Pushed
    timings: dict[str, float] = field(default_factory=dict)
    upload: str = "streamed"  # the layer's upload: "streamed" (PATCH), or "monolithic" (PATCH refused)


class _Exchange:
    """One connection to the registry, shut down by a watchdog at the deadline."""

    def __init__(self, url: str, deadline_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise SnapguardError(Reason.USAGE_ERROR, f"registry URL {url}: give http(s)://HOST[:PORT] only")
        self.url, self.host = url, parts.netloc
        self.deadline = time.monotonic() + deadline_s
        self.deadline_s = deadline_s
        self.expired = False
        if parts.scheme == "https":
            self.conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=deadline_s, context=ssl.create_default_context())
        else:
            self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=deadline_s)
        self.timer = threading.Timer(deadline_s, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def _expire(self) -> None:
        self.expired = True
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.timer.cancel()
        self.conn.close()

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0 or self.expired:
            raise self._too_slow()
        return left

    def _too_slow(self) -> SnapguardError:
        return SnapguardError(Reason.REGISTRY_TOO_SLOW, f"push to {self.url} did not finish within "
                              f"{self.deadline_s:.0f} s", evidence={"registry": self.url})

    def request(self, method: str, path: str, body: bytes | str | None = None, headers: dict[str, str] | None = None,
                size: int = 0, hasher: Any = None) -> tuple[int, http.client.HTTPMessage, bytes]:
        """(status, headers, at most 64 KiB of body); `body` a path str streams that file (`size`
        bytes, each chunk also fed to `hasher` where one is given)."""
        try:
            self.conn.timeout = self._left()
            if self.conn.sock is not None:
                self.conn.sock.settimeout(self.conn.timeout)
            hdrs = dict(headers or {})
            if isinstance(body, str):
                hdrs["Content-Length"] = str(size)
                self.conn.putrequest(method, path)
                for k, v in hdrs.items():
                    self.conn.putheader(k, v)
                self.conn.endheaders()
                sent = 0
                with open(body, "rb") as f:
                    while sent < size and (chunk := f.read(min(_CHUNK, size - sent))):
                        self._left()
                        if hasher is not None:
                            hasher.update(chunk)
                        self.conn.send(chunk)
                        sent += len(chunk)
                if sent != size:
                    raise SnapguardError(Reason.CHECKPOINT_ARCHIVE_INVALID, f"{body}: {sent} bytes, not the {size} "
                                         "it had when the push began (changed meanwhile)", evidence={"archive": body})
            else:
                self.conn.request(method, path, body=body, headers=hdrs)
            answer = self.conn.getresponse()
            data = answer.read(_MAX_ANSWER) if method != "HEAD" else b""
            if not answer.isclosed():
                answer.read()  # drain what is left of the body, so the connection can be reused
            return answer.status, answer.headers, data
        except SnapguardError:
            raise
        except (OSError, http.client.HTTPException) as e:
            self.conn.close()
            if self.expired or time.monotonic() >= self.deadline:
                raise self._too_slow() from None
            raise SnapguardError(Reason.REGISTRY_UNREACHABLE, f"{method} {self.url}{path[:200]}: {e}",
                                 evidence={"registry": self.url}) from None

    def refuse(self, what: str, status: int, data: bytes) -> SnapguardError:
        text = " ".join(data[:300].decode("utf-8", "replace").split())
        return SnapguardError(Reason.REGISTRY_UNREACHABLE, f"{what} at {self.url}: HTTP {status} {text}".rstrip(),
                              evidence={"registry": self.url, "status": status})


def _check_digest(ex: _Exchange, what: str, answered: str | None, want: str) -> None:
    if answered is not None and answered != want:
        raise SnapguardError(Reason.REGISTRY_DIGEST_MISMATCH, f"{what}: {ex.url} answered digest {answered[:80]}, "
                             f"the bytes pushed are {want}", evidence={"registry": ex.url, "want": want})


def _push_blob(ex: _Exchange, repo: str, digest: str, body: bytes | str, size: int) -> None:
    status, _, _ = ex.request("HEAD", f"/v2/{repo}/blobs/{digest}")
    if status == 200:
        return
    status, headers, data = ex.request("POST", f"/v2/{repo}/blobs/uploads/", b"", {"Content-Length": "0"})
    location = headers.get("Location")
    if status != 202 or not location:
        raise ex.refuse(f"starting the upload of {digest}", status, data)
    loc = urlsplit(location)
    if loc.netloc and loc.netloc != ex.host:
        raise ex.refuse(f"upload of {digest} sent to another host {loc.netloc[:80]}", status, b"")
    path = (loc.path or "/") + "?" + (loc.query + "&" if loc.query else "") + "digest=" + quote(digest)
    status, headers, data = ex.request("PUT", path, body, {"Content-Type": "application/octet-stream"}, size=size)
    if status not in (201, 204):
        raise ex.refuse(f"upload of {digest}", status, data)
    _check_digest(ex, f"blob {digest}", headers.get("Docker-Content-Digest"), digest)


def push_image(image: CheckpointImage, registry_url: str, repository: str, tag: str, *,
               deadline_s: float) -> Pushed:
    """Push `image` as REPOSITORY:TAG to the registry at `registry_url`, within `deadline_s`."""
    _check_names(repository, tag)
    ex = _Exchange(registry_url, deadline_s)
    try:
        _push_blob(ex, repository, image.layer_digest, image.layer_path, image.layer_size)
        _push_manifest(ex, image, repository, tag)
    finally:
        ex.close()
    return Pushed(ex.host, repository, tag, image.digest, image.layer_size + len(image.config) + len(image.manifest))


def _upload_path(ex: _Exchange, location: str | None, status: int, data: bytes, what: str) -> str:
    """The path (and query) of an upload's Location, on the registry's own host only."""
    if not location:
        raise ex.refuse(what, status, data)
    loc = urlsplit(location)
    if loc.netloc and loc.netloc != ex.host:
        raise ex.refuse(f"{what}: sent to another host {loc.netloc[:80]}", status, b"")
    return (loc.path or "/") + ("?" + loc.query if loc.query else "")


def _with_digest(path: str, digest: str) -> str:
    return path + ("&" if "?" in path else "?") + "digest=" + quote(digest)


_PATCH_REFUSED = (405, 501)  # the method is not allowed, or not implemented: monolithic uploads only


def _stream_layer(ex: _Exchange, repo: str, archive: str, size: int) -> tuple[str, str]:
    """The archive streamed up as a new blob (POST, PATCH, PUT ?digest=), hashed as it is sent;
    its digest, as the registry confirmed it, and how it went up ("streamed", or "monolithic"
    where the registry refused PATCH)."""
    status, headers, data = ex.request("POST", f"/v2/{repo}/blobs/uploads/", b"", {"Content-Length": "0"})
    if status != 202:
        raise ex.refuse("starting the layer's upload", status, data)
    path = _upload_path(ex, headers.get("Location"), status, data, "starting the layer's upload")
    hasher = hashlib.sha256()
    status, headers, data = ex.request("PATCH", path, archive, {"Content-Type": "application/octet-stream"},
                                       size=size, hasher=hasher)
    digest = "sha256:" + hasher.hexdigest()  # every byte was sent, whatever the answer
    if status in _PATCH_REFUSED:
        ex.request("DELETE", path)  # the session abandoned; a registry that keeps it expires it
        try:
            _push_blob(ex, repo, digest, archive, size)
        except SnapguardError as e:
            if e.reason is not Reason.REGISTRY_UNREACHABLE:
                raise
            raise SnapguardError(e.reason, f"the layer's streamed upload (PATCH) was refused (HTTP {status}), "
                                 f"and its monolithic upload: {e.failure.detail}", evidence=e.failure.evidence) from None
        return digest, "monolithic"
    if status != 202:
        raise ex.refuse("the layer's streamed upload (PATCH)", status, data)
    path = _upload_path(ex, headers.get("Location"), status, data, "the layer's streamed upload (PATCH)")
    status, headers, data = ex.request("PUT", _with_digest(path, digest), b"", {"Content-Length": "0"})
    if status not in (201, 204):
        raise ex.refuse(f"completing the upload of {digest}", status, data)
    _check_digest(ex, f"blob {digest}", headers.get("Docker-Content-Digest"), digest)
    return digest, "streamed"


def _push_manifest(ex: _Exchange, image: CheckpointImage, repository: str, tag: str) -> None:
    _push_blob(ex, repository, image.config_digest, image.config, len(image.config))
    status, headers, data = ex.request("PUT", f"/v2/{repository}/manifests/{tag}", image.manifest,
                                       {"Content-Type": MT_MANIFEST})
    if status not in (201, 204):
        raise ex.refuse(f"manifest {repository}:{tag}", status, data)
    _check_digest(ex, f"manifest {repository}:{tag}", headers.get("Docker-Content-Digest"), image.digest)
    status, headers, data = ex.request("HEAD", f"/v2/{repository}/manifests/{image.digest}",
                                       headers={"Accept": MT_MANIFEST})
    if status != 200:
        raise ex.refuse(f"manifest {repository}@{image.digest} after the push", status, data)
    _check_digest(ex, f"manifest {repository}@{image.digest}", headers.get("Docker-Content-Digest"), image.digest)


def _check_names(repository: str, tag: str) -> None:
    if not _REPO.match(repository) or len(repository) > 255:
        raise SnapguardError(Reason.USAGE_ERROR, f"repository {repository[:80]!r} is not an OCI repository name")
    if not _TAG.match(tag):
        raise SnapguardError(Reason.USAGE_ERROR, f"tag {tag[:80]!r} is not an OCI tag")


def publish_archive(archive: str, registry_url: str, repository: str, tag: str, *, job: str, epoch: int,
                    deadline_s: float) -> Published:
    """The CRI checkpoint archive at `archive` checked, made an image for `job` under `epoch` and
    pushed as REPOSITORY:TAG, within `deadline_s`, reading its bytes once."""
    _check_names(repository, tag)
    t0 = time.monotonic()
    scanned = scan_archive(archive, job=job, epoch=epoch)
    t1 = time.monotonic()
    ex = _Exchange(registry_url, max(deadline_s - (t1 - t0), 0.001))
    try:
        size = scanned.parts.archive
        digest, upload = _stream_layer(ex, repository, scanned.archive, size)
        t2 = time.monotonic()
        image = assemble(scanned, digest, size)
        _push_manifest(ex, image, repository, tag)
    finally:
        ex.close()
    pushed = Pushed(ex.host, repository, tag, image.digest, image.layer_size + len(image.config) + len(image.manifest))
    return Published(image, pushed, {"scan_s": t1 - t0, "layer_s": t2 - t1, "rest_s": time.monotonic() - t2},
                     upload)

