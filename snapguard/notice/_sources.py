"""Notice sources: each reads one capacity owner's reclaim notice in the format its owner documents.

Every source has `poll(deadline) -> Notice | None`, where `deadline` is a `time.monotonic()` bound
the poll never outlives (each HTTP request's timeout is what is left of it). A source that cannot be
read raises SnapguardError NOTICE_SOURCE_UNAVAILABLE with the underlying message; one that answers
outside its documented format raises NOTICE_MALFORMED. The base URLs default to the real link-local
endpoints and are configurable (tests point them at loopback servers).

- AWS spot: IMDSv2, a session token first (`PUT /latest/api/token` with
  `X-aws-ec2-metadata-token-ttl-seconds`), then `GET /latest/meta-data/spot/instance-action` with
  `X-aws-ec2-metadata-token`: 404 until a notice, then `{"action": "terminate|stop|hibernate",
  "time": "2026-...Z"}` (two minutes' lead).
- GCE: `Metadata-Flavor: Google`; `/computeMetadata/v1/instance/preempted` (`TRUE`/`FALSE`), watched
  with the hanging `?wait_for_change=true&last_etag=E&timeout_sec=N`, and
  `/computeMetadata/v1/instance/maintenance-event` (`NONE`, `MIGRATE_ON_HOST_MAINTENANCE`,
  `TERMINATE_ON_HOST_MAINTENANCE`). Spot's lead is up to 30 s, maintenance 60 s.
- Azure Scheduled Events: `GET /metadata/scheduledevents?api-version=2020-07-01` with `Metadata: true`;
  `{"DocumentIncarnation": n, "Events": [{"EventId", "EventType": "Preempt", "NotBefore": RFC 1123
  date or "", ...}]}` (Preempt: 30 s minimum).
- Kubernetes: `/api/v1/namespaces/NS/pods/NAME` (condition `DisruptionTarget` True) and
  `/api/v1/nodes/NAME` (cordoned for a drain: `spec.unschedulable`, the unschedulable taint or the
  cluster autoscaler's `ToBeDeletedByClusterAutoscaler`, or a condition type named in
  `node_conditions` True), with a bearer token.
- local: JSON files that `snapguard notice` writes atomically into the agent's inbox.
"""

from __future__ import annotations

import email.utils
import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Protocol

from ..reasons import Reason, SnapguardError

__all__ = ["AwsSpot", "Azure", "Gce", "Kubernetes", "Local", "Notice", "Source", "SOURCE_NAMES",
           "AWS_URL", "GCE_URL", "AZURE_URL"]

AWS_URL = "http://169.254.169.254"
GCE_URL = "http://metadata.google.internal"
AZURE_URL = "http://169.254.169.254"
K8S_URL = "https://kubernetes.default.svc"
K8S_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
K8S_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
SOURCE_NAMES = ("aws", "gce", "azure", "k8s", "local")
# the documented leads, used when a notice carries no time of its own
LEADS = {"aws": 120.0, "gce-preempted": 30.0, "gce-maintenance": 60.0, "azure": 30.0}
_MAX_BODY = 1 << 20


@dataclass(frozen=True)
class Notice:
    """One reclaim notice. `id` is stable for one event (two reads of it give the same id), so the
    agent snapshots once however often it is seen. `deadline` is wall-clock (epoch seconds) when the
    source gives or documents one; `lead_s` what was left of it when the notice was read."""

    id: str
    source: str
    kind: str
    detail: str
    deadline: float | None = None
    lead_s: float | None = None
    raw: Any = None
    seen_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Notice:
        return cls(str(d["id"]), str(d["source"]), str(d["kind"]), str(d["detail"]), d.get("deadline"),
                   d.get("lead_s"), d.get("raw"), float(d.get("seen_at") or time.time()))


def _with_deadline(nid: str, source: str, kind: str, detail: str, deadline: float | None, raw: Any) -> Notice:
    now = time.time()
    return Notice(nid, source, kind, detail, deadline, None if deadline is None else round(deadline - now, 3), raw,
                  now)


class Source(Protocol):
    name: str

    def poll(self, deadline: float) -> Notice | None: ...


def _unavailable(name: str, url: str, why: str) -> SnapguardError:
    return SnapguardError(Reason.NOTICE_SOURCE_UNAVAILABLE, f"{name} notice source {url}: {why}",
                          evidence={"source": name, "url": url})


def _malformed(name: str, url: str, why: str, body: bytes | str = b"") -> SnapguardError:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return SnapguardError(Reason.NOTICE_MALFORMED, f"{name} notice source {url}: {why}",
                          evidence={"source": name, "url": url, "body": text[:200]})


def _left(deadline: float, floor: float = 0.05) -> float:
    return max(floor, deadline - time.monotonic())


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a: Any, **k: Any) -> None:  # a metadata service never redirects
        return None


def _request(name: str, url: str, deadline: float, *, method: str = "GET", headers: dict[str, str] | None = None,
             ok_missing: bool = False, context: ssl.SSLContext | None = None) -> tuple[int, bytes, dict[str, str]]:
    """One HTTP request bounded by `deadline`: (status, body, headers). 404 is returned when
    `ok_missing`; any other non-2xx, a refused connection or a timeout is NOTICE_SOURCE_UNAVAILABLE.
    No proxy (metadata endpoints are link-local) and no redirect is followed."""
    req = urllib.request.Request(url, method=method, headers=headers or {})
    handlers: list[Any] = [urllib.request.ProxyHandler({}), _NoRedirect()]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(req, timeout=_left(deadline)) as resp:
            return resp.status, resp.read(_MAX_BODY), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as e:
        if ok_missing and e.code == 404:
            return 404, b"", {}
        raise _unavailable(name, url, f"HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise _unavailable(name, url, str(getattr(e.reason, "strerror", None) or e.reason)) from None
    except (TimeoutError, OSError, ValueError) as e:  # socket timeout, reset, bad URL
        raise _unavailable(name, url, f"{type(e).__name__}: {e}" if not isinstance(e, TimeoutError)
                           else "timed out") from None


def _json(name: str, url: str, body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as e:
        raise _malformed(name, url, f"not JSON ({e})", body) from None


def _iso_time(name: str, url: str, text: Any) -> float:
    if not isinstance(text, str):
        raise _malformed(name, url, f"time {text!r} is not a string")
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise _malformed(name, url, f"time {text!r} is not ISO 8601") from None


class AwsSpot:
    """EC2 spot `instance-action` through IMDSv2."""

    name = "aws"
    TOKEN_TTL_S = 21600

    def __init__(self, base_url: str = AWS_URL) -> None:
        self.base = base_url.rstrip("/")
        self._token: str | None = None
        self._token_until = 0.0

    def _get_token(self, deadline: float) -> str:
        if self._token and time.monotonic() < self._token_until:
            return self._token
        url = f"{self.base}/latest/api/token"
        _, body, _ = _request(self.name, url, deadline, method="PUT",
                              headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)})
        token = body.decode("ascii", "replace").strip()
        if not token:
            raise _malformed(self.name, url, "empty IMDSv2 token")
        self._token, self._token_until = token, time.monotonic() + self.TOKEN_TTL_S - 60
        return token

    def poll(self, deadline: float) -> Notice | None:
        url = f"{self.base}/latest/meta-data/spot/instance-action"
        token = self._get_token(deadline)
        try:
            status, body, _ = _request(self.name, url, deadline, headers={"X-aws-ec2-metadata-token": token},
                                       ok_missing=True)
        except SnapguardError as e:
            if "HTTP 401" in e.failure.detail:  # the token expired early: one new one, once
                self._token = None
                token = self._get_token(deadline)
                status, body, _ = _request(self.name, url, deadline, headers={"X-aws-ec2-metadata-token": token},
                                           ok_missing=True)
            else:
                raise
        if status == 404:
            return None
        doc = _json(self.name, url, body)
        if not isinstance(doc, dict) or doc.get("action") not in ("terminate", "stop", "hibernate"):
            raise _malformed(self.name, url, "expected {\"action\": terminate|stop|hibernate, \"time\": ...}", body)
        when = _iso_time(self.name, url, doc.get("time"))
        return _with_deadline(f"aws:instance-action:{doc['action']}:{doc['time']}", self.name, doc["action"],
                              f"EC2 spot instance-action {doc['action']} at {doc['time']}", when, doc)


class Gce:
    """GCE `instance/preempted` (watched with wait_for_change) and `instance/maintenance-event`."""

    name = "gce"
    MAINTENANCE = ("MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")

    def __init__(self, base_url: str = GCE_URL, *, wait: bool = True, maintenance: bool = True) -> None:
        self.base = base_url.rstrip("/")
        self.wait = wait
        self.maintenance = maintenance
        self._etag: str | None = None

    def _get(self, key: str, deadline: float, hang: bool) -> tuple[str, dict[str, str]]:
        url = f"{self.base}/computeMetadata/v1/instance/{key}"
        if hang and self._etag:
            # the server answers when the value changes or after timeout_sec; keep it inside the poll
            wait_s = max(1, int(_left(deadline) - 1))
            url += "?" + urllib.parse.urlencode({"wait_for_change": "true", "last_etag": self._etag,
                                                 "timeout_sec": wait_s})
        _, body, headers = _request(self.name, url, deadline, headers={"Metadata-Flavor": "Google"})
        if headers.get("metadata-flavor", "Google") != "Google":
            raise _malformed(self.name, url, "answer without Metadata-Flavor: Google")
        return body.decode("utf-8", "replace").strip(), headers

    def poll(self, deadline: float) -> Notice | None:
        if self.maintenance:
            event, _ = self._get("maintenance-event", deadline, hang=False)
            if event in self.MAINTENANCE:
                kind = "terminate" if event.startswith("TERMINATE") else "migrate"
                return _with_deadline(f"gce:maintenance-event:{event}", self.name, kind,
                                      f"GCE maintenance-event {event}", time.time() + LEADS["gce-maintenance"], event)
            if event != "NONE" and not event.startswith("NONE"):
                raise _malformed(self.name, f"{self.base}/computeMetadata/v1/instance/maintenance-event",
                                 f"unknown maintenance-event {event[:80]!r}")
        value, headers = self._get("preempted", deadline, hang=self.wait)
        self._etag = headers.get("etag") or self._etag
        if value == "TRUE":
            return _with_deadline("gce:preempted", self.name, "preempt", "GCE instance/preempted TRUE",
                                  time.time() + LEADS["gce-preempted"], value)
        if value != "FALSE":
            raise _malformed(self.name, f"{self.base}/computeMetadata/v1/instance/preempted",
                             f"expected TRUE or FALSE, got {value[:80]!r}")
        return None


class Azure:
    """Azure Scheduled Events: a `Preempt` event (and, with `kinds`, others such as Terminate)."""

    name = "azure"
    API_VERSION = "2020-07-01"

    def __init__(self, base_url: str = AZURE_URL, *, kinds: tuple[str, ...] = ("Preempt", "Terminate")) -> None:
        self.base = base_url.rstrip("/")
        self.kinds = kinds
        self.incarnation: int | None = None

    def poll(self, deadline: float) -> Notice | None:
        url = f"{self.base}/metadata/scheduledevents?api-version={self.API_VERSION}"
        _, body, _ = _request(self.name, url, deadline, headers={"Metadata": "true"})
        doc = _json(self.name, url, body)
        if not isinstance(doc, dict) or not isinstance(doc.get("Events"), list) \
                or not isinstance(doc.get("DocumentIncarnation"), int):
            raise _malformed(self.name, url, "expected {\"DocumentIncarnation\": n, \"Events\": [...]}", body)
        self.incarnation = doc["DocumentIncarnation"]
        for ev in doc["Events"]:
            if not isinstance(ev, dict) or not isinstance(ev.get("EventId"), str) or "EventType" not in ev:
                raise _malformed(self.name, url, "an event without EventId or EventType", body)
            if ev["EventType"] not in self.kinds:
                continue
            when: float | None
            nb = ev.get("NotBefore") or ""
            if nb:
                try:
                    when = email.utils.parsedate_to_datetime(nb).timestamp()
                except (TypeError, ValueError):
                    raise _malformed(self.name, url, f"NotBefore {nb!r} is not an RFC 1123 date", body) from None
            else:  # an event already started has no NotBefore: as good as now
                when = time.time()
            return _with_deadline(f"azure:{ev['EventId']}", self.name, ev["EventType"].lower(),
                                  f"Azure Scheduled Event {ev['EventType']} {ev['EventId']} "
                                  f"(NotBefore {nb or 'now'}, incarnation {self.incarnation})", when, ev)
        return None


class Kubernetes:
    """A pod's `DisruptionTarget` condition and/or a node being drained, read from the API server."""

    name = "k8s"
    DRAIN_TAINTS = ("node.kubernetes.io/unschedulable", "ToBeDeletedByClusterAutoscaler")

    def __init__(self, base_url: str = K8S_URL, *, node: str | None = None, pod: str | None = None,
                 token_file: str | None = K8S_TOKEN, ca_file: str | None = K8S_CA,
                 node_conditions: tuple[str, ...] = ()) -> None:
        if not node and not pod:
            raise SnapguardError(Reason.USAGE_ERROR, "the k8s source needs a node name, a pod (NS/NAME) or both")
        if pod and pod.count("/") != 1:
            raise SnapguardError(Reason.USAGE_ERROR, f"k8s pod {pod!r}: give NAMESPACE/NAME")
        self.base = base_url.rstrip("/")
        self.node, self.pod = node, pod
        self.token_file, self.ca_file = token_file, ca_file
        self.node_conditions = node_conditions

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_file:
            try:
                with open(self.token_file, encoding="utf-8") as f:  # re-read: projected tokens rotate
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            except OSError as e:
                raise _unavailable(self.name, self.base, f"token {self.token_file}: {e.strerror or e}") from None
        return headers

    def _context(self) -> ssl.SSLContext | None:
        if not self.base.startswith("https:"):
            return None
        return ssl.create_default_context(cafile=self.ca_file if self.ca_file and os.path.exists(self.ca_file)
                                          else None)

    def _get(self, path: str, deadline: float) -> dict[str, Any]:
        url = f"{self.base}{path}"
        _, body, _ = _request(self.name, url, deadline, headers=self._headers(), context=self._context())
        doc = _json(self.name, url, body)
        if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), dict):
            raise _malformed(self.name, url, "not a Kubernetes object (no metadata)", body)
        return doc

    def poll(self, deadline: float) -> Notice | None:
        if self.pod:
            ns, name = self.pod.split("/")
            pod = self._get(f"/api/v1/namespaces/{urllib.parse.quote(ns)}/pods/{urllib.parse.quote(name)}", deadline)
            for cond in (pod.get("status") or {}).get("conditions") or []:
                if isinstance(cond, dict) and cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
                    uid = pod["metadata"].get("uid", "")
                    return _with_deadline(f"k8s:pod:{ns}/{name}:{uid}:DisruptionTarget:{cond.get('lastTransitionTime')}",
                                          self.name, "disruption",
                                          f"pod {ns}/{name} DisruptionTarget {cond.get('reason', '')}: "
                                          f"{cond.get('message', '')}".strip(), None, cond)
        if self.node:
            node = self._get(f"/api/v1/nodes/{urllib.parse.quote(self.node)}", deadline)
            spec = node.get("spec") or {}
            uid = node["metadata"].get("uid", "")
            why = None
            if spec.get("unschedulable") is True:
                why = "cordoned (spec.unschedulable)"
            for taint in spec.get("taints") or []:
                if isinstance(taint, dict) and taint.get("key") in self.DRAIN_TAINTS and why is None:
                    why = f"taint {taint['key']}:{taint.get('effect', '')}"
            for cond in (node.get("status") or {}).get("conditions") or []:
                if isinstance(cond, dict) and cond.get("type") in self.node_conditions and cond.get("status") == "True" \
                        and why is None:
                    why = f"condition {cond['type']} True: {cond.get('reason', '')}"
            if why:
                return _with_deadline(f"k8s:node:{self.node}:{uid}:drain", self.name, "drain",
                                      f"node {self.node} {why}", None, {"spec": spec})
        return None


class Local:
    """The local inbox `snapguard notice` writes to: one JSON file per notice, named by its id."""

    name = "local"

    def __init__(self, inbox: str) -> None:
        self.inbox = inbox

    def poll(self, deadline: float) -> Notice | None:
        try:
            names = sorted(n for n in os.listdir(self.inbox) if n.endswith(".json"))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _unavailable(self.name, self.inbox, e.strerror or str(e)) from None
        for n in names:
            path = os.path.join(self.inbox, n)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    if os.fstat(f.fileno()).st_uid != 0 and os.geteuid() == 0:
                        continue  # only root's notices count
                    body = f.read(_MAX_BODY)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise _unavailable(self.name, path, e.strerror or str(e)) from None
            doc = _json(self.name, path, body)
            if not isinstance(doc, dict) or not isinstance(doc.get("id"), str):
                raise _malformed(self.name, path, "expected {\"id\": ..., \"reason\": ...}", body)
            deadline_at = doc.get("deadline")
            return _with_deadline(f"local:{doc['id']}", self.name, "operator", doc.get("reason") or "operator notice",
                                  float(deadline_at) if isinstance(deadline_at, (int, float)) else None,
                                  {**doc, "path": path})
        return None
