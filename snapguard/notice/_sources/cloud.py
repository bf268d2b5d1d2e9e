"""The cloud metadata sources, each in the format its owner documents (bases configurable: tests
point them at loopback servers). Every poll is one bounded exchange (snapguard.notice._sources._http),
at most half the source's documented lead; every JSON answer is parsed with bounds and checked
against its schema.

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
"""

from __future__ import annotations

import email.utils
import time
import urllib.parse
from datetime import datetime
from typing import Any

from ...reasons import SnapguardError
from ._base import Notice, bounded, with_deadline
from ._http import malformed, request
from ._parse import parse
from ._schemas import AWS_INSTANCE_ACTION, AZURE_EVENTS

__all__ = ["AWS_URL", "AZURE_URL", "GCE_URL", "LEADS", "AwsSpot", "Azure", "Gce"]

AWS_URL = "http://169.254.169.254"
GCE_URL = "http://metadata.google.internal"
AZURE_URL = "http://169.254.169.254"
# the documented leads, used when a notice carries no time of its own, and to bound a poll
LEADS = {"aws": 120.0, "gce-preempted": 30.0, "gce-maintenance": 60.0, "azure": 30.0}
_MAX_TEXT = 4096  # a metadata value (TRUE/FALSE, a token, an event name)


def _iso_time(name: str, url: str, text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise malformed(name, url, f"time {text[:64]!r} is not ISO 8601") from None


class AwsSpot:
    """EC2 spot `instance-action` through IMDSv2."""

    name = "aws"
    lead_s = LEADS["aws"]
    TOKEN_TTL_S = 21600

    def __init__(self, base_url: str = AWS_URL) -> None:
        self.base = base_url.rstrip("/")
        self._token: str | None = None
        self._token_until = 0.0

    def _get_token(self, deadline: float) -> str:
        if self._token and time.monotonic() < self._token_until:
            return self._token
        url = f"{self.base}/latest/api/token"
        body = request(self.name, url, deadline, method="PUT", max_body=_MAX_TEXT,
                       headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)}).body
        token = body.decode("ascii", "replace").strip()
        if not token or not token.isprintable():
            raise malformed(self.name, url, "an empty or unprintable IMDSv2 token")
        self._token, self._token_until = token, time.monotonic() + self.TOKEN_TTL_S - 60
        return token

    def poll(self, deadline: float) -> Notice | None:
        deadline = bounded(deadline, self.lead_s)
        url = f"{self.base}/latest/meta-data/spot/instance-action"
        token = self._get_token(deadline)
        try:
            resp = request(self.name, url, deadline, headers={"X-aws-ec2-metadata-token": token}, ok=(404,))
        except SnapguardError as e:
            if "HTTP 401" not in e.failure.detail:
                raise
            self._token = None  # the token expired early: one new one, once
            resp = request(self.name, url, deadline, headers={"X-aws-ec2-metadata-token": self._get_token(deadline)},
                           ok=(404,))
        if resp.status == 404:
            return None
        doc = parse(self.name, url, resp.body, schema=AWS_INSTANCE_ACTION)
        when = _iso_time(self.name, url, doc["time"])
        return with_deadline(f"aws:instance-action:{doc['action']}:{doc['time']}", self.name, doc["action"],
                             f"EC2 spot instance-action {doc['action']} at {doc['time']}", when, doc)


class Gce:
    """GCE `instance/preempted` (watched with wait_for_change) and `instance/maintenance-event`."""

    name = "gce"
    lead_s = LEADS["gce-preempted"]
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
            wait_s = max(1, int(deadline - time.monotonic() - 1))
            url += "?" + urllib.parse.urlencode({"wait_for_change": "true", "last_etag": self._etag,
                                                 "timeout_sec": wait_s})
        resp = request(self.name, url, deadline, headers={"Metadata-Flavor": "Google"}, max_body=_MAX_TEXT)
        if resp.headers.get("metadata-flavor", "Google") != "Google":
            raise malformed(self.name, url, "answer without Metadata-Flavor: Google")
        return resp.body.decode("utf-8", "replace").strip(), resp.headers

    def poll(self, deadline: float) -> Notice | None:
        deadline = bounded(deadline, self.lead_s)
        if self.maintenance:
            event, _ = self._get("maintenance-event", deadline, hang=False)
            if event in self.MAINTENANCE:
                kind = "terminate" if event.startswith("TERMINATE") else "migrate"
                return with_deadline(f"gce:maintenance-event:{event}", self.name, kind,
                                     f"GCE maintenance-event {event}", time.time() + LEADS["gce-maintenance"], event)
            if event != "NONE" and not event.startswith("NONE"):
                raise malformed(self.name, f"{self.base}/computeMetadata/v1/instance/maintenance-event",
                                f"unknown maintenance-event {event[:80]!r}")
        value, headers = self._get("preempted", deadline, hang=self.wait)
        self._etag = headers.get("etag") or self._etag
        if value == "TRUE":
            return with_deadline("gce:preempted", self.name, "preempt", "GCE instance/preempted TRUE",
                                 time.time() + LEADS["gce-preempted"], value)
        if value != "FALSE":
            raise malformed(self.name, f"{self.base}/computeMetadata/v1/instance/preempted",
                            f"expected TRUE or FALSE, got {value[:80]!r}")
        return None


class Azure:
    """Azure Scheduled Events: a `Preempt` event (and, with `kinds`, others such as Terminate)."""

    name = "azure"
    lead_s = LEADS["azure"]
    API_VERSION = "2020-07-01"

    def __init__(self, base_url: str = AZURE_URL, *, kinds: tuple[str, ...] = ("Preempt", "Terminate")) -> None:
        self.base = base_url.rstrip("/")
        self.kinds = kinds
        self.incarnation: int | None = None

    def poll(self, deadline: float) -> Notice | None:
        deadline = bounded(deadline, self.lead_s)
        url = f"{self.base}/metadata/scheduledevents?api-version={self.API_VERSION}"
        body = request(self.name, url, deadline, headers={"Metadata": "true"}).body
        doc: dict[str, Any] = parse(self.name, url, body, schema=AZURE_EVENTS)
        self.incarnation = doc["DocumentIncarnation"]
        for ev in doc["Events"]:
            if ev["EventType"] not in self.kinds:
                continue
            nb = ev.get("NotBefore") or ""
            if nb:
                try:
                    when = email.utils.parsedate_to_datetime(nb).timestamp()
                except (TypeError, ValueError, IndexError):
                    raise malformed(self.name, url, f"NotBefore {nb!r} is not an RFC 1123 date", body) from None
            else:  # an event already started has no NotBefore: as good as now
                when = time.time()
            return with_deadline(f"azure:{ev['EventId']}", self.name, ev["EventType"].lower(),
                                 f"Azure Scheduled Event {ev['EventType']} {ev['EventId']} "
                                 f"(NotBefore {nb or 'now'}, incarnation {self.incarnation})", when, ev)
        return None
