"""The node's opted-in pods, found through CRI as the kubelet lists them: ListPodSandbox (ready
sandboxes) and ListContainers (running containers), on containerd's CRI socket.

A pod is opted in when its sandbox's runtime handler is `snapguard` (the RuntimeClass) and its
annotations carry `snapguard.io/job`; each of its running containers becomes a registry entry of
kind `pod`, which the agent's schedule runs through snapguard.notice._cri.snapshot_pod
(CheckpointContainer, stop, publish to `registry_url` under `<repository prefix>/<job>`, record).
`snapguard.io/file-checkpoint` names the fallback and `snapguard.io/epoch` the attempt's epoch.

The two requests and their responses are encoded and decoded here from Kubernetes' CRI
api.proto (cri-api v0.32.3, runtime.v1; no generated stubs): ListPodSandboxRequest {filter = 1
{state = 2 {state = 1}}}, PodSandbox {id = 1, metadata = 2 {name = 1, uid = 2, namespace = 3},
state = 3, annotations = 6, runtime_handler = 7}, ListContainersRequest {filter = 1 {state = 2
{state = 1}}}, Container {id = 1, pod_sandbox_id = 2, metadata = 3 {name = 1}, state = 6}.
Everything containerd answers is the pod owner's input: a response that is not protobuf is
CRI_UNAVAILABLE, and a value that does not check (a job name, an epoch) skips that pod with a line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..reasons import Reason, SnapguardError
from ._containerd import ANNOTATION_EPOCH, ANNOTATION_FILE_CHECKPOINT, ANNOTATION_JOB, _entry

__all__ = ["CriPods", "decode", "list_containers_request", "list_sandboxes_request"]

HANDLER = "snapguard"
_SANDBOX_READY = 0
_CONTAINER_RUNNING = 1
_MAX_RESPONSE = 64 << 20


def list_sandboxes_request() -> bytes:
    """ListPodSandboxRequest{filter: {state: {state: SANDBOX_READY}}}, serialized."""
    return b"\x0a\x02\x12\x00"


def list_containers_request() -> bytes:
    """ListContainersRequest{filter: {state: {state: CONTAINER_RUNNING}}}, serialized."""
    return b"\x0a\x04\x12\x02\x08\x01"


def _varint(data: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def decode(data: bytes) -> dict[int, list[Any]]:
    """One protobuf message's fields: number -> values (int for varints, bytes for
    length-delimited); fixed32/64 kept as bytes. ValueError on anything malformed."""
    out: dict[int, list[Any]] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            if i + size > len(data):
                raise ValueError("truncated field")
            value, i = data[i:i + size], i + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if i + width > len(data):
                raise ValueError("truncated field")
            value, i = data[i:i + width], i + width
        else:
            raise ValueError(f"wire type {wire}")
        out.setdefault(field, []).append(value)
    return out


def _text(fields: dict[int, list[Any]], n: int) -> str:
    values = [v for v in fields.get(n, []) if isinstance(v, bytes)]
    return values[-1].decode("utf-8", "replace") if values else ""


def _number(fields: dict[int, list[Any]], n: int) -> int:
    values = [v for v in fields.get(n, []) if isinstance(v, int)]
    return values[-1] if values else 0


def _map(fields: dict[int, list[Any]], n: int) -> dict[str, str]:
    out = {}
    for raw in fields.get(n, []):
        if isinstance(raw, bytes):
            kv = decode(raw)
            out[_text(kv, 1)] = _text(kv, 2)
    return out


@dataclass(frozen=True)
class CriPods:
    """The agent's CRI path: where to list pods, where to publish their images."""

    socket: str
    registry_url: str
    repository_prefix: str = "snapguard/ckpt"
    handler: str = HANDLER
    timeout_s: float = 15.0

    def opted_in(self) -> tuple[list[dict[str, Any]], list[str]]:
        """(registry entries of kind `pod`, lines on what was skipped and why)."""
        from ._cri import CriClient, repository_for

        client = CriClient(self.socket)
        try:
            sandboxes = client.call("ListPodSandbox", list_sandboxes_request(), self.timeout_s, "ListPodSandbox")
            containers = client.call("ListContainers", list_containers_request(), self.timeout_s, "ListContainers")
        finally:
            client.close()
        try:
            pods = {}
            for raw in decode(sandboxes).get(1, []):
                sb = decode(raw)
                ann = _map(sb, 6)
                if _text(sb, 7) == self.handler and ANNOTATION_JOB in ann and _number(sb, 3) == _SANDBOX_READY:
                    meta = decode(sb.get(2, [b""])[-1])
                    pods[_text(sb, 1)] = (ann, _text(meta, 3), _text(meta, 1))
            listed = [decode(raw) for raw in decode(containers).get(1, [])]
        except (ValueError, TypeError) as e:
            raise SnapguardError(Reason.CRI_UNAVAILABLE, f"{self.socket}: a CRI list answer is not protobuf ({e})",
                                 evidence={"cri_socket": self.socket}) from None
        entries: list[dict[str, Any]] = []
        skipped: list[str] = []
        for c in listed:
            pod = pods.get(_text(c, 2))
            if pod is None or _number(c, 6) != _CONTAINER_RUNNING:
                continue
            ann, namespace, name = pod
            cid = _text(c, 1)
            found = {k: v for k, v in ann.items() if k in (ANNOTATION_JOB, ANNOTATION_FILE_CHECKPOINT, ANNOTATION_EPOCH)}
            entry, why = _entry("k8s.io", cid, found, "")
            if entry is None:
                skipped.append(f"pod {namespace}/{name} container {cid[:13]}: {why}")
                continue
            entries.append({"container": cid, "job": entry["job"], "file_checkpoint": entry["file_checkpoint"],
                            "epoch": entry["epoch"], "pod": f"{namespace}/{name}", "cri_socket": self.socket,
                            "registry_url": self.registry_url,
                            "repository": repository_for(self.repository_prefix, entry["job"])})
        return entries, skipped
