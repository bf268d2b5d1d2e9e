"""Each notice source against a loopback server speaking its owner's documented format
(snapguard_lab.metadata_servers): no notice, a notice with its deadline, the server down, a
malformed answer. Only 127.0.0.1 is ever contacted."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from snapguard.notice import AwsSpot, Azure, Gce, KubeNode, Local
from snapguard.reasons import Reason, SnapguardError
from snapguard_lab.metadata_servers import AwsImds, AzureEvents, GceMetadata


def soon(s: float = 5.0) -> float:
    return time.monotonic() + s


def dead_url() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def typed(reason: Reason, fn) -> SnapguardError:
    with pytest.raises(SnapguardError) as e:
        fn()
    assert e.value.reason is reason, e.value
    assert e.value.failure.message.startswith(f"snapguard {reason.name}: ")
    return e.value


def test_aws_imdsv2_token_first_then_instance_action() -> None:
    with AwsImds() as srv:
        src = AwsSpot(srv.url)
        assert src.poll(soon()) is None
        assert srv.requests[0][0] == "PUT" and srv.requests[0][1] == "/latest/api/token"
        armed = srv.arm("stop", lead_s=120)
        n = src.poll(soon())
        assert n is not None and n.source == "aws" and n.kind == "stop"
        assert n.id == f"aws:instance-action:stop:{armed['time']}"
        assert 110 < n.lead_s <= 121 and abs(n.deadline - (time.time() + 120)) < 5
        assert src.poll(soon()).id == n.id  # the same event reads as the same id
        # the token is reused, not asked for on each poll
        assert sum(1 for m, _ in srv.requests if m == "PUT") == 1
        # a token the server forgot (expired): one new token, the poll still answers
        srv.tokens.clear()
        assert src.poll(soon()).id == n.id
        srv.break_json()
        typed(Reason.NOTICE_MALFORMED, lambda: src.poll(soon()))


def test_aws_without_token_is_refused_by_the_server() -> None:
    import urllib.error
    import urllib.request

    with AwsImds() as srv:
        srv.arm()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{srv.url}/latest/meta-data/spot/instance-action", timeout=5)
        assert e.value.code == 401


def test_gce_preempted_with_wait_for_change_and_maintenance() -> None:
    with GceMetadata(max_wait_s=3) as srv:
        src = Gce(srv.url)
        assert src.poll(soon()) is None  # first read: FALSE and its ETag
        assert src._etag
        # the hanging GET returns as soon as the value changes
        import threading

        threading.Timer(0.3, srv.arm).start()
        start = time.monotonic()
        n = src.poll(soon(10))
        assert time.monotonic() - start < 2.5
        assert n is not None and n.id == "gce:preempted" and n.kind == "preempt" and 25 < n.lead_s <= 30
        assert any("wait_for_change=true" in p and "last_etag=" in p for _, p in srv.requests)
        assert all("Metadata-Flavor" not in p for _, p in srv.requests)
    with GceMetadata() as srv:
        srv.arm("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        n = Gce(srv.url).poll(soon())
        assert n.id == "gce:maintenance-event:TERMINATE_ON_HOST_MAINTENANCE" and n.kind == "terminate"
        srv.arm("maintenance-event", "NONE")
        srv.break_json()
        typed(Reason.NOTICE_MALFORMED, lambda: Gce(srv.url).poll(soon()))


def test_gce_hanging_poll_is_bounded_by_its_deadline() -> None:
    with GceMetadata(max_wait_s=30) as srv:
        src = Gce(srv.url)
        assert src.poll(soon()) is None
        start = time.monotonic()
        assert src.poll(soon(2.5)) is None
        assert time.monotonic() - start < 4


def test_azure_preempt_with_not_before() -> None:
    with AzureEvents() as srv:
        src = Azure(srv.url)
        assert src.poll(soon()) is None
        srv.arm("Freeze")  # not a reclaim
        assert src.poll(soon()) is None
        ev = srv.arm("Preempt", lead_s=30)
        n = src.poll(soon())
        assert n.id == f"azure:{ev['EventId']}" and n.kind == "preempt"
        assert 20 < n.lead_s <= 31 and src.incarnation == 3
        srv.break_json()
        typed(Reason.NOTICE_MALFORMED, lambda: src.poll(soon()))


@pytest.mark.parametrize("make", [lambda u: AwsSpot(u), lambda u: Gce(u), lambda u: Azure(u),
                                  lambda u: KubeNode(u, "n", token_file=None)],
                         ids=["aws", "gce", "azure", "k8s"])
def test_server_down_is_notice_source_unavailable(make) -> None:
    url = dead_url()
    start = time.monotonic()
    e = typed(Reason.NOTICE_SOURCE_UNAVAILABLE, lambda: make(url).poll(soon(2)))
    assert url in e.failure.detail and time.monotonic() - start < 3


def test_a_silent_server_is_bounded_by_the_deadline() -> None:
    with socket.socket() as s:  # accepts (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        start = time.monotonic()
        e = typed(Reason.NOTICE_SOURCE_UNAVAILABLE, lambda: Azure(url).poll(soon(1)))
        assert time.monotonic() - start < 2.5 and "timed out" in e.failure.detail


def test_local_inbox(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    src = Local(str(inbox))
    assert src.poll(soon()) is None
    inbox.mkdir()
    (inbox / "a.json").write_text(json.dumps({"id": "drain-1", "reason": "node drain"}))
    n = src.poll(soon())
    assert n.id == "local:drain-1" and n.detail == "node drain" and n.raw["path"] == str(inbox / "a.json")
    (inbox / "a.json").write_text("{nope")  # refused, set aside, recorded: not raised (the next entry counts)
    assert src.poll(soon()) is None and not (inbox / "a.json").exists()
    assert [r["reason"] for r in src.take()] == ["NOTICE_MALFORMED"]
