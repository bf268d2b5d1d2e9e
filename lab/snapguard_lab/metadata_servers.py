"""Loopback HTTP servers that speak each capacity owner's notice format, for tests of the agent.

Each listens on 127.0.0.1 (port 0: the kernel picks), runs in a thread, and has `arm(...)` to
post a notice and `break_json()` to answer with something that is not JSON. They never listen on
another address and the sources under test reach them only through their configurable base URL.

- AwsImds: IMDSv2 enforced: `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`
  (1-21600) gives a token; `GET /latest/meta-data/spot/instance-action` without a valid
  `X-aws-ec2-metadata-token` is 401, 404 until armed, then {"action", "time"}.
- GceMetadata: `Metadata-Flavor: Google` required (403 otherwise), answered with that header and an
  ETag; `instance/preempted` (TRUE/FALSE) and `instance/maintenance-event`; `?wait_for_change=true`
  with `last_etag` hangs until the value changes or `timeout_sec` (bounded by `max_wait_s`) passes.
- AzureEvents: `GET /metadata/scheduledevents?api-version=...` with `Metadata: true` (400 otherwise);
  DocumentIncarnation goes up on every change.
- KubeApi: `/api/v1/nodes/NAME` and `/api/v1/namespaces/NS/pods/NAME` as JSON, bearer token enforced.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
import urllib.parse
from email.utils import format_datetime
from datetime import datetime, timedelta, timezone
from typing import Any

from .loopback_http import LoopbackHttp

__all__ = ["AwsImds", "AzureEvents", "GceMetadata", "KubeApi"]


class _Server(LoopbackHttp):
    """A loopback server (snapguard_lab.loopback_http) that records each request and can be
    told to answer with something that is not JSON."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.malformed = False
        super().__init__()

    def _request(self, h: Any, method: str) -> None:
        self.requests.append((method, h.path))
        self._answer(h, method)

    def _answer(self, h: Any, method: str) -> None:
        raise NotImplementedError

    def break_json(self) -> None:
        self.malformed = True


class AwsImds(_Server):
    def __init__(self) -> None:
        self.tokens: dict[str, float] = {}
        self.action: dict[str, str] | None = None
        super().__init__()

    def arm(self, action: str = "terminate", lead_s: float = 120.0) -> dict[str, str]:
        when = datetime.now(timezone.utc) + timedelta(seconds=lead_s)
        self.action = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
        return self.action

    def _answer(self, h: Any, method: str) -> None:
        path = urllib.parse.urlsplit(h.path).path
        if path == "/latest/api/token":
            if method != "PUT":
                return h.reply(405, "")
            try:
                ttl = int(h.headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
            except ValueError:
                return h.reply(400, "")
            if not 1 <= ttl <= 21600:
                return h.reply(400, "")
            token = secrets.token_urlsafe(32)
            self.tokens[token] = time.monotonic() + ttl
            return h.reply(200, token, {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})
        token = h.headers.get("X-aws-ec2-metadata-token")
        if method != "GET" or token not in self.tokens or self.tokens[token] < time.monotonic():
            return h.reply(401, "")
        if path == "/latest/meta-data/spot/instance-action":
            if self.malformed:
                return h.reply(200, "{not json", {"Content-Type": "text/plain"})
            if self.action is None:
                return h.reply(404, "Not Found", {"Content-Type": "text/html"})
            return h.reply(200, json.dumps(self.action), {"Content-Type": "text/plain"})
        return h.reply(404, "Not Found")


class GceMetadata(_Server):
    def __init__(self, max_wait_s: float = 5.0) -> None:
        self.values = {"preempted": "FALSE", "maintenance-event": "NONE"}
        self.max_wait_s = max_wait_s
        super().__init__()

    def _etag(self, key: str) -> str:
        return hashlib.sha256(f"{key}={self.values[key]}".encode()).hexdigest()[:16]

    def arm(self, key: str = "preempted", value: str = "TRUE") -> None:
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def _answer(self, h: Any, method: str) -> None:
        parts = urllib.parse.urlsplit(h.path)
        if h.headers.get("Metadata-Flavor") != "Google" or h.headers.get("X-Forwarded-For"):
            return h.reply(403, "Missing Metadata-Flavor:Google header.", {"Metadata-Flavor": "Google"})
        key = parts.path.removeprefix("/computeMetadata/v1/instance/")
        if method != "GET" or key not in self.values:
            return h.reply(404, "Not Found", {"Metadata-Flavor": "Google"})
        q = urllib.parse.parse_qs(parts.query)
        if q.get("wait_for_change") == ["true"]:
            last = (q.get("last_etag") or [""])[0]
            wait = min(float((q.get("timeout_sec") or [self.max_wait_s])[0]), self.max_wait_s)
            end = time.monotonic() + wait
            with self.cond:
                while self._etag(key) == last and time.monotonic() < end:
                    self.cond.wait(max(0.0, end - time.monotonic()))
        body = "{not json" if self.malformed else self.values[key]
        return h.reply(200, body, {"Metadata-Flavor": "Google", "ETag": self._etag(key),
                                   "Content-Type": "application/text"})


class AzureEvents(_Server):
    def __init__(self) -> None:
        self.incarnation = 1
        self.events: list[dict[str, Any]] = []
        super().__init__()

    def arm(self, event_type: str = "Preempt", lead_s: float = 30.0, event_id: str | None = None) -> dict[str, Any]:
        when = datetime.now(timezone.utc) + timedelta(seconds=lead_s)
        ev = {"EventId": event_id or secrets.token_hex(8).upper(), "EventStatus": "Scheduled",
              "EventType": event_type, "ResourceType": "VirtualMachine", "Resources": ["snapguard-test-vm"],
              "NotBefore": format_datetime(when, usegmt=True), "Description": "", "EventSource": "Platform",
              "DurationInSeconds": -1}
        self.events.append(ev)
        self.incarnation += 1
        return ev

    def _answer(self, h: Any, method: str) -> None:
        parts = urllib.parse.urlsplit(h.path)
        if parts.path != "/metadata/scheduledevents" or method != "GET":
            return h.reply(404, "")
        if h.headers.get("Metadata") != "true":
            return h.reply(400, json.dumps({"error": "Bad request. Required metadata header not specified"}))
        if not urllib.parse.parse_qs(parts.query).get("api-version"):
            return h.reply(400, json.dumps({"error": "Bad request. api-version was not specified"}))
        if self.malformed:
            return h.reply(200, "{not json", {"Content-Type": "application/json"})
        return h.reply(200, json.dumps({"DocumentIncarnation": self.incarnation, "Events": self.events}),
                       {"Content-Type": "application/json"})


class KubeApi(_Server):
    def __init__(self, token: str = "test-token", node: str = "node-1", pod: str = "default/trainer") -> None:
        self.token = token
        ns, name = pod.split("/")
        self.node: dict[str, Any] = {"kind": "Node", "apiVersion": "v1", "metadata": {"name": node, "uid": "node-uid-1"},
                     "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        self.pod: dict[str, Any] = {"kind": "Pod", "apiVersion": "v1",
                    "metadata": {"name": name, "namespace": ns, "uid": "pod-uid-1"},
                    "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        self.paths = {f"/api/v1/nodes/{node}": lambda: self.node,
                      f"/api/v1/namespaces/{ns}/pods/{name}": lambda: self.pod}
        super().__init__()

    def arm_pod(self, reason: str = "EvictionByEvictionAPI") -> None:
        self.pod["status"]["conditions"].append({
            "type": "DisruptionTarget", "status": "True", "reason": reason,
            "message": "Eviction API: evicting", "lastTransitionTime": "2026-12-01T10:00:00Z"})

    def arm_node(self) -> None:
        self.node["spec"] = {"unschedulable": True, "taints": [
            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": "2026-12-01T10:00:00Z"}]}

    def _answer(self, h: Any, method: str) -> None:
        if h.headers.get("Authorization") != f"Bearer {self.token}":
            return h.reply(401, json.dumps({"kind": "Status", "status": "Failure", "reason": "Unauthorized",
                                            "code": 401}), {"Content-Type": "application/json"})
        get = self.paths.get(urllib.parse.urlsplit(h.path).path)
        if get is None or method != "GET":
            return h.reply(404, json.dumps({"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}),
                           {"Content-Type": "application/json"})
        body = "{not json" if self.malformed else json.dumps(get())
        return h.reply(200, body, {"Content-Type": "application/json"})
