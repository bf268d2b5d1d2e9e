"""The agent's CRI path: a pod's stopping snapshot through the node's containerd, published as an
OCI checkpoint image in a registry and recorded in the job's store entry.

    published = snapshot_pod(cri_socket="/run/containerd/containerd.sock", container_id=cid,
                             job="train-1", store=open_store(url), epoch=store.current_epoch("train-1"),
                             registry_url="https://registry.example:5000", repository="ckpt/train-1",
                             workdir="/var/lib/snapguard/cri", deadline_s=25)
    published.reference   # registry.example:5000/ckpt/train-1@sha256:...

1. CRI CheckpointContainer (the call the kubelet's checkpoint API makes), bounded by the deadline
   left; containerd pauses the container, runs its runtime's checkpoint (snapguard-runc for the
   RuntimeClass `snapguard`: preflight, CRIU, the seal) and writes the archive to `workdir`
   (created 0700, root's). A refusal or failure snapguard-runc gave is raised as its reason
   (snapguard.notice._crireason: in containerd's message, else in the runtime's log.json of the
   bundle containerd names); any other answer of containerd's is CRI_CHECKPOINT_FAILED with its
   message; no answer in time, or no containerd, is CRI_UNAVAILABLE.
0. The job's fencing epoch is checked first: FENCED (the job was restored elsewhere since this
   node's epoch) before anything is frozen.
2. StopContainer (timeout 0) unless `stop=False`: a stopping snapshot, so that what the
   container does after the dump (writes to shared storage, say) is not done twice. A container
   that cannot be stopped is not published: a restore elsewhere would start a second copy.
3. snapguard.ocicheckpoint.publish_archive: the archive checked and made an image, its bytes read
   once (streamed up and hashed as they go), within the deadline left, digest-checked; the archive
   removed. It runs while StopContainer does (a GPU container's teardown takes seconds); nothing
   is recorded unless the stop succeeded too.
4. snapguard.store.record_published: the reference by digest and the epoch, create-only, after
   the epoch is checked (FENCED when the job was restored elsewhere since).

The CRI client is grpcio (the `k8s` extra: pip install 'snapguard[k8s]'; without it
CRI_CLIENT_MISSING). The two requests it sends are encoded here from Kubernetes' CRI api.proto
(cri-api v0.32.3, runtime.v1: CheckpointContainerRequest {container_id = 1, location = 2,
timeout = 3}, StopContainerRequest {container_id = 1, timeout = 2}); the responses are empty
messages. No generated stubs: tests/system/test_k8s_loop.py checks the bytes against the stubs
protoc generates from that proto.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import ocicheckpoint
from ..files import ensure_private_dir
from ..reasons import Reason, SnapguardError
from ..store import PublishedImage, record_published
from ._crireason import executor_failure

__all__ = ["CriClient", "PublishedImage", "SnapshotTrace", "checkpoint_request", "repository_for", "snapshot_pod",
           "stop_request"]

_SERVICE = "/runtime.v1.RuntimeService/"
_MIN_PUSH_S = 1.0


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it (two's complement)
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string(field: int, text: str) -> bytes:
    data = text.encode()
    return bytes([field << 3 | 2]) + _varint(len(data)) + data if data else b""


def _int64(field: int, n: int) -> bytes:
    return bytes([field << 3]) + _varint(n) if n else b""


def checkpoint_request(container_id: str, location: str, timeout_s: int) -> bytes:
    """runtime.v1.CheckpointContainerRequest, serialized."""
    return _string(1, container_id) + _string(2, location) + _int64(3, timeout_s)


def stop_request(container_id: str, timeout_s: int) -> bytes:
    """runtime.v1.StopContainerRequest, serialized."""
    return _string(1, container_id) + _int64(2, timeout_s)


class CriClient:
    """The two CRI calls the agent makes, on containerd's CRI socket, each with a deadline."""

    def __init__(self, socket_path: str) -> None:
        try:
            import grpc
        except ImportError:
            raise SnapguardError(Reason.CRI_CLIENT_MISSING, "the CRI path needs grpcio (pip install "
                                 "'snapguard[k8s]')") from None
        self._grpc = grpc
        self.socket_path = socket_path
        self.channel = grpc.insecure_channel("unix://" + socket_path)

    def close(self) -> None:
        self.channel.close()

    def call(self, method: str, request: bytes, deadline_s: float, what: str, container_id: str = "") -> bytes:
        """One unary call of runtime.v1.RuntimeService with a serialized request; its serialized
        answer, or SnapguardError (snapguard-runc's own reason for `container_id` when it left
        one, see the module's docstring)."""
        grpc = self._grpc
        started = time.time()
        call = self.channel.unary_unary(_SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            answer = call(request, timeout=max(deadline_s, 0.001))
            return bytes(answer or b"")
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = " ".join(str(e.details() if hasattr(e, "details") else e).split())
            said = executor_failure(details, container_id, started)
            if said is not None:
                raise SnapguardError(said.reason, f"{what}: {said.message}",
                                     evidence={"cri_socket": self.socket_path, "cri": details[:600],
                                               "executor_said_in": said.source}) from None
            if method == "CheckpointContainer" and code not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                                 grpc.StatusCode.UNAVAILABLE):
                raise SnapguardError(Reason.CRI_CHECKPOINT_FAILED, f"{what}: containerd: {details[:400]}",
                                     evidence={"cri_socket": self.socket_path, "cri": details[:600],
                                               "code": getattr(code, "name", str(code))}) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                details = f"did not finish within {deadline_s:.0f} s"
            raise SnapguardError(Reason.CRI_UNAVAILABLE, f"{what} on {self.socket_path}: {details[:400]}",
                                 evidence={"cri_socket": self.socket_path,
                                           "code": getattr(code, "name", str(code))}) from None

    def checkpoint(self, container_id: str, location: str, deadline_s: float) -> None:
        """CheckpointContainer as the kubelet sends it (the timeout field too; the call is bounded
        by the same deadline here, as the kubelet's CRI client bounds it)."""
        self.call("CheckpointContainer", checkpoint_request(container_id, location, max(int(deadline_s), 1)),
                   deadline_s, f"CheckpointContainer {container_id[:13]}", container_id)

    def stop(self, container_id: str, deadline_s: float) -> None:
        self.call("StopContainer", stop_request(container_id, 0), deadline_s, f"StopContainer {container_id[:13]}")


@dataclass
class SnapshotTrace:
    """Where one snapshot_pod's seconds went (filled as it goes, for a caller that reports them):
    CheckpointContainer, StopContainer (beside the publish), and the publish's own record (the
    image with its parts by bytes, the push's timings)."""

    checkpoint_s: float = 0.0
    stop_s: float = 0.0
    publish_s: float = 0.0
    published: ocicheckpoint.Published | None = None


def repository_for(prefix: str, job: str) -> str:
    """PREFIX/JOB as an OCI repository name (lower case; runs of other characters one `-`)."""
    name = re.sub(r"[^a-z0-9]+", "-", job.lower()).strip("-") or "job"
    return f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name


def snapshot_pod(*, cri_socket: str, container_id: str, job: str, store: Any, epoch: int, registry_url: str,
                 repository: str, workdir: str, deadline_s: float, stop: bool = True,
                 tag: str | None = None, trace: SnapshotTrace | None = None) -> PublishedImage:
    """The container's stopping snapshot through CRI, published and recorded (the module's steps),
    all within `deadline_s`. Raises SnapguardError (typed); on a failure nothing is recorded.
    `trace`, where given, gets the steps' seconds."""
    trace = trace if trace is not None else SnapshotTrace()
    deadline = time.monotonic() + deadline_s
    store.check_epoch(job, epoch)
    work = ensure_private_dir(workdir)
    archive = os.path.join(work, f"checkpoint-{job}-e{epoch}-{container_id[:12]}-{time.time_ns()}.tar")
    client = CriClient(cri_socket)
    stopped: dict[str, Any] = {}
    stopper = None
    try:
        t0 = time.monotonic()
        client.checkpoint(container_id, archive, deadline - t0)
        t1 = time.monotonic()
        trace.checkpoint_s = t1 - t0
        if stop:
            stopper = threading.Thread(target=_stop, args=(client, container_id, max(deadline - t1, 1.0), stopped),
                                       name="snapguard-cri-stop", daemon=True)
            stopper.start()
        left = deadline - time.monotonic()
        if left < _MIN_PUSH_S:
            raise SnapguardError(Reason.REGISTRY_TOO_SLOW, f"{left:.1f} s of the {deadline_s:.0f} s deadline left "
                                 "for the push after the checkpoint", evidence={"registry": registry_url})
        out = ocicheckpoint.publish_archive(archive, registry_url, repository, tag or f"e{epoch}-{time.time_ns()}",
                                            job=job, epoch=epoch, deadline_s=left)
        trace.publish_s, trace.published = time.monotonic() - t1, out
        image, pushed = out.image, out.pushed
    finally:
        if stopper is not None:  # bounded by its own deadline: the channel closes after it
            stopper.join()
            trace.stop_s = stopped.get("seconds", 0.0)
        client.close()
        try:
            os.unlink(archive)
        except FileNotFoundError:
            pass
    if "error" in stopped:
        raise stopped["error"]
    ann = image.annotations
    published = PublishedImage(
        job=job, epoch=epoch, reference=pushed.reference, digest=pushed.digest,
        container=ann.get(ocicheckpoint.ANNOTATION_CONTAINER, ""),
        pod=ann.get("org.criu.checkpoint.pod.name", ""), namespace=ann.get("org.criu.checkpoint.pod.namespace", ""),
        size=pushed.size, host=socket.gethostname(), time=time.time())
    record_published(store, published)
    return published


def _stop(client: CriClient, container_id: str, deadline_s: float, out: dict[str, Any]) -> None:
    """StopContainer on its own thread; its error (or its seconds) into `out`."""
    t = time.monotonic()
    try:
        client.stop(container_id, deadline_s)
    except Exception as e:  # typed by CriClient.call; anything else is still a stop that failed
        out["error"] = e
    out["seconds"] = time.monotonic() - t
