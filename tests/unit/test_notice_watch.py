"""The Kubernetes source's list+watch against a server shaped like the API (snapguard_lab.kube_watch:
chunked watch events, bookmarks, 410 Gone), the bounds on every exchange with a peer (a trickling
server, headers that never end, a body nested hundreds deep), the inbox read without blocking (a
real FIFO in a real inbox), and the agent running several sources at once. Only 127.0.0.1 is
contacted; no root needed. Kubernetes itself cannot run here: the server speaks its documented
list/watch protocol, as kube-apiserver would to the agent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from snapguard.config import Config, load
from snapguard.notice import AwsSpot, Azure, Gce, KubeNode, KubePods, Local, kubernetes_sources
from snapguard.notice import k8s_default_url as default_url
from snapguard.notice._agent import Agent
from snapguard.reasons import Reason, SnapguardError
from snapguard_lab.bad_http import BadHttp
from snapguard_lab.kube_watch import KubeWatchApi


def soon(s: float = 5.0) -> float:
    return time.monotonic() + s


@pytest.fixture
def token(tmp_path: Path) -> str:
    f = tmp_path / "token"
    f.write_text("test-token\n")
    return str(f)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    f = tmp_path / "config.toml"
    f.write_text("")
    return load({"SNAPGUARD_CONFIG": str(f), "SNAPGUARD_STATE_DIR": str(tmp_path / "state")})


def later(s: float, fn, *a) -> None:  # type: ignore[no-untyped-def]
    threading.Timer(s, fn, a).start()


def test_node_watch_notices_a_reclaim_taint_and_never_a_plain_cordon(token: str) -> None:
    with KubeWatchApi() as api:
        src = KubeNode(api.url, "node-1", token_file=token, ca_file=None)
        assert src.poll(soon(0.6)) is None  # listed, then watched
        assert src.relists == 1 and src.rv is not None
        listed = [p for p in api.requests if "watch" not in p]
        assert listed == ["/api/v1/nodes?fieldSelector=metadata.name%3Dnode-1"]
        watch = [p for p in api.requests if "watch=1" in p][0]
        assert "allowWatchBookmarks=true" in watch and "resourceVersion=101" in watch  # the list's version
        # a cordon (and the node's status heartbeats) arrive as watch events: not a notice
        later(0.2, api.cordon, "node-1")
        later(0.3, api.heartbeat, "node-1")
        assert src.poll(soon(1.0)) is None
        assert src.relists == 1  # watched from the resourceVersion, not listed again
        # the cluster autoscaler's deletion taint, added while the watch is open, arrives at once
        later(0.2, api.taint, "node-1", "ToBeDeletedByClusterAutoscaler", "NoSchedule", "1733220000")
        start = time.monotonic()
        n = src.poll(soon(10))
        assert n is not None and time.monotonic() - start < 2
        assert n.source == "k8s-node" and n.kind == "reclaim" and "ToBeDeletedByClusterAutoscaler" in n.detail
        assert n.id.startswith("k8s:node:node-1:uid-node-1:taint:ToBeDeletedByClusterAutoscaler:")
        # the same taint seen again in a later event is not a second notice
        later(0.1, api.heartbeat, "node-1")
        assert src.poll(soon(0.6)) is None


def test_cordon_is_a_notice_only_when_configured(token: str) -> None:
    with KubeWatchApi() as api:
        api.cordon("node-1")
        assert KubeNode(api.url, "node-1", token_file=token, ca_file=None).poll(soon(0.5)) is None
        n = KubeNode(api.url, "node-1", token_file=token, ca_file=None, notice_on_cordon=True).poll(soon(2))
        assert n is not None and n.kind == "drain" and "--notice-on-cordon" in n.detail


@pytest.mark.parametrize("key,value", [("cloud.google.com/impending-node-termination", None),
                                       ("karpenter.sh/disrupted", None), ("karpenter.sh/disruption", "disrupting"),
                                       ("node.kubernetes.io/out-of-service", "nodeshutdown"),
                                       ("aws-node-termination-handler/spot-itn", "1733220000")])
def test_each_reclaim_taint_is_a_notice(token: str, key: str, value: str | None) -> None:
    with KubeWatchApi() as api:
        api.taint("node-1", key, "NoExecute" if "out-of-service" in key else "NoSchedule", value)
        n = KubeNode(api.url, "node-1", token_file=token, ca_file=None).poll(soon(2))
        assert n is not None and key in n.detail


def test_spot_node_taint_and_not_ready_are_not_notices_but_a_shutdown_is(token: str) -> None:
    with KubeWatchApi() as api:
        api.taint("node-1", "kubernetes.azure.com/scalesetpriority", "NoSchedule", "spot")  # every AKS spot node
        api.edit_node("node-1", lambda n: n["status"]["conditions"][0].update(
            status="False", reason="KubeletNotReady", message="container runtime network not ready"))
        src = KubeNode(api.url, "node-1", token_file=token, ca_file=None)
        assert src.poll(soon(0.5)) is None
        later(0.1, api.edit_node, "node-1", lambda n: n["status"]["conditions"][0].update(
            status="False", reason="KubeletNotReady", message="node is shutting down",
            lastTransitionTime="2026-12-01T11:00:00Z"))
        n = src.poll(soon(3))
        assert n is not None and n.kind == "shutdown"


def test_gone_relists_and_bad_events_are_refused_and_passed(token: str) -> None:
    with KubeWatchApi() as api:
        src = KubeNode(api.url, "node-1", token_file=token, ca_file=None)
        assert src.poll(soon(0.4)) is None and src.relists == 1
        api.heartbeat("node-1")
        api.compact()  # the watch's resourceVersion is now too old: an ERROR event with a 410 Status
        assert src.poll(soon(0.6)) is None
        assert src.relists == 2
        api.heartbeat("node-1")
        api.compact()
        api.gone_as_status = True  # or the answer's own status 410
        assert src.poll(soon(0.6)) is None and src.relists == 3
        api.bad_event = b"[" * 600 + b"]" * 600 + b"\n"  # nested deep: refused, never a RecursionError
        later(0.3, api.taint, "node-1", "karpenter.sh/disrupted")
        n = src.poll(soon(5))
        assert n is not None and "karpenter.sh/disrupted" in n.detail  # the watch went on past the bad event
        refused = src.take()
        assert [r["reason"] for r in refused] == ["NOTICE_MALFORMED"] and "nested" in refused[0]["detail"]


def test_pods_of_the_node_that_are_opted_in(token: str) -> None:
    with KubeWatchApi() as api:
        api.put_pod("ml", "trainer", "node-1", {"snapguard.io/job": "llm"})
        api.put_pod("ml", "other", "node-1")  # not opted in
        api.put_pod("ml", "elsewhere", "node-2", {"snapguard.io/job": "x"})
        src = KubePods(api.url, node="node-1", token_file=token, ca_file=None)
        assert src.poll(soon(0.4)) is None
        assert "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-1" in api.requests
        api.disrupt("ml", "other")
        api.disrupt("ml", "elsewhere")
        assert src.poll(soon(0.5)) is None
        later(0.2, api.disrupt, "ml", "trainer", "PreemptionByScheduler")
        n = src.poll(soon(5))
        assert n is not None and n.kind == "disruption" and "PreemptionByScheduler" in n.detail
        assert n.id.startswith("k8s:pod:ml/trainer:uid-ml-trainer:DisruptionTarget:")


def test_kubernetes_sources_and_a_wrong_token(token: str, tmp_path: Path) -> None:
    srcs = kubernetes_sources("http://127.0.0.1:1", node="node-1", token_file=token, ca_file=None)
    assert [s.name for s in srcs] == ["k8s-node", "k8s-pods"] and all(s.window_s == 60 for s in srcs)
    for bad in ({"node": None}, {"node": "a,b"}, {"node": None, "pod": "nope"}):
        with pytest.raises(SnapguardError) as e:
            kubernetes_sources("http://127.0.0.1:1", token_file=token, ca_file=None, **bad)  # type: ignore[arg-type]
        assert e.value.reason is Reason.USAGE_ERROR
    with KubeWatchApi(token="other") as api:
        with pytest.raises(SnapguardError) as e:
            KubeNode(api.url, "node-1", token_file=token, ca_file=None).poll(soon(2))
        assert e.value.reason is Reason.NOTICE_SOURCE_UNAVAILABLE and "HTTP 401" in e.value.failure.detail
    missing = KubeNode("https://127.0.0.1:1", "node-1", token_file=token, ca_file=str(tmp_path / "no-ca.crt"))
    with pytest.raises(SnapguardError) as e:
        missing.poll(soon(1))
    assert "CA" in e.value.failure.detail


def cert(d: Path, name: str) -> tuple[str, str]:
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(crt), "-days", "1", "-subj", "/CN=kubernetes",
                    "-addext", "subjectAltName=DNS:kubernetes.default.svc,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)
    return str(crt), str(key)


def test_the_api_server_is_verified_against_the_service_account_ca(token: str, tmp_path: Path) -> None:
    crt, key = cert(tmp_path, "apiserver")
    other, _ = cert(tmp_path, "other")
    with KubeWatchApi(tls=(crt, key)) as api:
        assert api.url.startswith("https://")
        api.taint("node-1", "ToBeDeletedByClusterAutoscaler")
        n = KubeNode(api.url, "node-1", token_file=token, ca_file=crt).poll(soon(3))
        assert n is not None and "ToBeDeletedByClusterAutoscaler" in n.detail
        with pytest.raises(SnapguardError) as e:
            KubeNode(api.url, "node-1", token_file=token, ca_file=other).poll(soon(3))
        assert e.value.reason is Reason.NOTICE_SOURCE_UNAVAILABLE and "CERTIFICATE_VERIFY_FAILED" in str(e.value)


def test_in_cluster_url_from_the_service_environment() -> None:
    assert default_url({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}) == \
        "https://10.96.0.1:443"
    assert default_url({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}) == \
        "https://[fd00::1]:6443"
    assert default_url({}) == "https://kubernetes.default.svc"


@pytest.mark.parametrize("mode", ["trickle", "endless_headers"])
@pytest.mark.parametrize("make", [lambda u: AwsSpot(u), lambda u: Gce(u), lambda u: Azure(u),
                                  lambda u: KubeNode(u, "node-1", token_file=None)], ids=["aws", "gce", "azure", "k8s"])
def test_a_slow_peer_is_bounded_by_one_deadline_for_the_whole_exchange(mode: str, make) -> None:  # type: ignore
    body = json.dumps({"DocumentIncarnation": 1, "Events": []}).encode()
    with BadHttp(mode, body=body, gap_s=0.02) as srv:  # each byte in time, the whole far too late
        start = time.monotonic()
        with pytest.raises(SnapguardError) as e:
            make(srv.url).poll(soon(0.5))
        took = time.monotonic() - start
    assert e.value.reason is Reason.NOTICE_SOURCE_UNAVAILABLE and "timed out" in e.value.failure.detail
    assert took < 1.2


def test_headers_that_never_end_fast_are_refused_by_size() -> None:
    with BadHttp("endless_headers", gap_s=0.0) as srv:
        with pytest.raises(SnapguardError) as e:
            Azure(srv.url).poll(soon(5))
    assert e.value.reason is Reason.NOTICE_MALFORMED and "headers over" in e.value.failure.detail


@pytest.mark.parametrize("body,says", [(b"[" * 500 + b"]" * 500, "nested"),
                                       (json.dumps({"DocumentIncarnation": "3", "Events": []}).encode(), "integer"),
                                       (json.dumps([{"EventId": "x"}]).encode(), "object"),
                                       (b" " * (2 << 20), "bytes")])
def test_bodies_of_the_wrong_shape_are_typed(body: bytes, says: str) -> None:
    with BadHttp("answer", body=body) as srv:
        with pytest.raises(SnapguardError) as e:
            Azure(srv.url).poll(soon(5))
    assert e.value.reason is Reason.NOTICE_MALFORMED and says in e.value.failure.detail, e.value.failure.detail


def test_aws_deep_body_is_typed_not_a_recursion_error() -> None:
    with BadHttp("answer", body=b"{\"a\":" * 400 + b"1" + b"}" * 400) as srv:
        src = AwsSpot(srv.url)
        with pytest.raises(SnapguardError) as e:
            src.poll(soon(5))
    assert e.value.reason is Reason.NOTICE_MALFORMED


def test_inbox_never_blocks_and_one_bad_entry_never_blocks_the_next(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    os.mkfifo(inbox / "a-fifo.json")  # a writer never comes: an open without O_NONBLOCK hangs for ever
    (inbox / "b-deep.json").write_text("[" * 1000 + "]" * 1000)
    (inbox / "c-shape.json").write_text(json.dumps({"id": ["not", "a", "string"]}))
    os.symlink(tmp_path / "elsewhere.json", inbox / "d-link.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"id": "linked"}))
    (inbox / "e-good.json").write_text(json.dumps({"id": "drain-2", "reason": "drain", "deadline": None}))
    src = Local(str(inbox))
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(src.poll(soon())), daemon=True)
    t.start()
    t.join(3)
    assert done, "the inbox read blocked"
    n = done[0]
    assert n is not None and n.id == "local:drain-2"  # type: ignore[attr-defined]
    refused = {os.path.basename(r["where"]): r["reason"] for r in src.take()}
    assert refused == {"a-fifo.json": "NOTICE_MALFORMED", "b-deep.json": "NOTICE_MALFORMED",
                       "c-shape.json": "NOTICE_MALFORMED", "d-link.json": "UNTRUSTED_PATH"}
    assert sorted(os.listdir(inbox)) == ["e-good.json", "refused"]  # set aside: read once
    assert (tmp_path / "elsewhere.json").exists()


def test_agent_journals_refusals_and_runs_several_sources_first_notice_wins(config: Config, token: str) -> None:
    with KubeWatchApi() as api, BadHttp("trickle", gap_s=0.05) as slow:
        agent = Agent(config, [], interval_s=0.5, host_checks_every_s=None, log=lambda line: None)
        os.mkfifo(os.path.join(agent.inbox, "stuck.json"))
        k8s = KubeNode(api.url, "node-1", token_file=token, ca_file=None)
        k8s.window_s = 1.0
        agent.sources = [Local(agent.inbox), AwsSpot(slow.url), k8s]
        seen: list[str] = []
        agent.handle = lambda n: (seen.append(n.id), agent._stop.set())  # type: ignore[method-assign]
        later(1.6, api.taint, "node-1", "cloud.google.com/impending-node-termination")
        later(10, agent._stop.set)  # a bound on the test alone
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        start = time.monotonic()
        try:
            agent.run()  # in this (the main) thread: it installs its signal handlers
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        assert time.monotonic() - start < 6  # not held up by the trickling IMDS or the FIFO
        assert seen and seen[0].startswith("k8s:node:node-1:")
        journal = agent.read_journal()
        refused = [j for j in journal if j["event"] == "notice_refused"]
        assert refused and refused[0]["source"] == "local" and refused[0]["reason"] == "NOTICE_MALFORMED"
        assert any(j["event"] == "source" and j["source"] == "aws" and "timed out" in (j["error"] or "")
                   for j in journal)


def test_agent_flags_map_onto_the_sources(config: Config, token: str) -> None:
    from snapguard.cli import agent as agent_cli
    from snapguard.cli import build_parser

    args = build_parser().parse_args(["agent", "--source", "k8s", "--source", "gcp", "--source", "kubernetes",
                                      "--k8s-node", "node-1", "--notice-on-cordon", "--k8s-url", "http://127.0.0.1:1",
                                      "--k8s-token-file", token, "--k8s-ca-file", ""])
    srcs = agent_cli._sources(args, config)
    assert [s.name for s in srcs] == ["local", "k8s-node", "k8s-pods", "gce"]  # aliases, each source once
    assert srcs[1].notice_on_cordon and srcs[1].ca_file is None and srcs[1].base == "http://127.0.0.1:1"
    args = build_parser().parse_args(["agent", "--source", "kubernetes", "--k8s-node", "node-1"])
    assert not agent_cli._sources(args, config)[1].notice_on_cordon  # a cordon is not a notice by default


def test_inbox_wait_ends_when_a_notice_lands_and_on_stop(tmp_path: Path, config: Config) -> None:
    from snapguard.notice import post_notice

    agent = Agent(config, [], interval_s=60, host_checks_every_s=None, log=lambda line: None)
    src = Local(agent.inbox)
    stop = threading.Event()
    assert src.poll(soon()) is None and src.watch.armed
    later(0.3, post_notice, config, "drain")
    assert src.wait(60, stop)  # woken by the rename into the inbox, not by the 60 s
    n = src.poll(soon())
    assert n is not None and n.detail == "drain"
    later(0.3, stop.set)
    assert not src.wait(60, stop)  # the agent's stop ends it too
    src.watch.close()
    assert not src.watch.armed and not src.wait(0.05, threading.Event())  # unarmed: sleeps its timeout out


def test_inbox_watch_survives_the_inbox_being_replaced(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    src = Local(str(inbox))
    assert src.poll(soon()) is None and src.watch.armed
    inbox.rename(tmp_path / "old-inbox")
    inbox.mkdir()
    assert not src.wait(5, threading.Event())  # the old directory went: no notice, the watch let go
    assert not src.watch.armed
    assert src.poll(soon()) is None and src.watch.armed  # made again on the new directory
    later(0.2, (inbox / "x.json").write_text, json.dumps({"id": "x", "reason": "r", "deadline": None}))
    assert src.wait(60, threading.Event())


def test_agent_acts_on_a_posted_notice_long_before_its_poll_interval(config: Config) -> None:
    from snapguard.notice import post_notice

    agent = Agent(config, [], interval_s=120, host_checks_every_s=None, log=lambda line: None)
    agent.sources = [Local(agent.inbox)]
    seen: list[str] = []
    agent.handle = lambda n: (seen.append(n.detail), agent._stop.set())  # type: ignore[method-assign]
    later(1.0, post_notice, config, "drain now")
    timer = threading.Timer(60, agent._stop.set)  # a bound on the test alone
    timer.start()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        agent.run()
    finally:
        timer.cancel()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert seen == ["drain now"]  # with a 120 s interval only the inbox's watch could have read it
