"""`snapguard webhook`: AdmissionReview v1 objects shaped as the API server sends them (the
Kubernetes API reference's admission.k8s.io/v1 AdmissionReview; pods as a Deployment's
ReplicaSet controller creates them) POSTed over real HTTPS (a self-signed certificate made by
openssl) to the real server, the answer's JSONPatch applied with a real RFC 6902 implementation
(jsonpatch), and the take point's directory run alone in the system's interpreter.

No API server runs here: these requests are what it would send, and the answers are read as it
reads them (uid, allowed, patchType, base64 patch, warnings; a Status on a non-200)."""

from __future__ import annotations

import base64
import copy
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from snapguard.reasons import Reason, SnapguardError
from snapguard.store import PublishedImage, open_store, record_published
from snapguard.takepoint import SPILL_TMPFS, TAKE_DIR_ENV, protocol
from snapguard.takepoint.hookdir import HOOK_DIR, HOOK_FILES, lay_out
from snapguard.webhook import CheckpointImage, Restorable, ServerConfig, StoreSnapshots, Webhook, WebhookConfig
from snapguard.webhook import review as review_mod

REPO = Path(__file__).resolve().parents[2]
DIGEST = "sha256:" + "ab" * 32
CKPT_REF = f"registry.example.com:5000/snapguard/train-llm@{DIGEST}"
TAKE_DIR = "/run/snapguard/take"
K8S_VERSION = "1.37"  # the newest schema set kubernetes-validate carries


# ---- the requests, as the API server sends them ---------------------------------------------

def deployment_pod(**over: Any) -> dict[str, Any]:
    """A pod as the ReplicaSet controller of Deployment `trainer` creates it, defaults applied."""
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "generateName": "trainer-7d4b9c8f6-", "namespace": "ml",
            "labels": {"app": "trainer", "pod-template-hash": "7d4b9c8f6"},
            "annotations": {"snapguard.io/job": "train-llm", "snapguard.io/file-checkpoint": "s3://ckpt/train-llm"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "trainer-7d4b9c8f6",
                                 "uid": "0a6c1f43-9a3e-4a1b-8c51-3c2f5a0e9d11", "controller": True,
                                 "blockOwnerDeletion": True}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                               "time": "2026-12-03T12:00:00Z", "fieldsType": "FieldsV1",
                               "fieldsV1": {"f:metadata": {"f:generateName": {}, "f:labels": {".": {},
                                            "f:app": {}}}, "f:spec": {"f:containers": {"k:{\"name\":\"train\"}": {
                                                ".": {}, "f:env": {"k:{\"name\":\"PYTHONPATH\"}": {".": {},
                                                                                                 "f:value": {}}}}}}}}],
        },
        "spec": {
            "runtimeClassName": "snapguard",
            "containers": [{
                "name": "train", "image": "registry.example.com:5000/ml/train:1.4",
                "command": ["python", "-m", "train"], "args": ["--steps", "100000"],
                "env": [{"name": "PYTHONPATH", "value": "/app/lib:/app/vendor"},
                        {"name": "RANK", "valueFrom": {"fieldRef": {"apiVersion": "v1",
                                                                    "fieldPath": "metadata.annotations['rank']"}}}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"},
                                 {"name": "kube-api-access-x7k2p", "readOnly": True,
                                  "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent"}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "train-data"}},
                        {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}],
            "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default", "schedulerName": "default-scheduler", "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority", "priority": 0,
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": 300}],
        },
        "status": {},
    }
    for path, value in over.items():
        *head, last = path.split("__")
        node = pod
        for key in head:
            node = node[key]
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return pod


def admission_review(pod: dict[str, Any] | None, uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002",
                     operation: str = "CREATE", kind: str = "Pod") -> dict[str, Any]:
    gvk = {"group": "", "version": "v1", "kind": kind}
    gvr = {"group": "", "version": "v1", "resource": "pods"}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
        "name": "", "namespace": "ml", "operation": operation,
        "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                     "uid": "6c3a1b9e-2f43-4c1d-9f0b-7d8e2a1c5b30",
                     "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system",
                                "system:authenticated"]},
        "object": pod, "oldObject": None, "dryRun": False,
        "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}}}


# ---- the server ------------------------------------------------------------------------------

def make_cert(cert: Path, key: Path) -> None:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
                    "-subj", "/CN=snapguard-webhook.snapguard.svc",
                    "-addext", "subjectAltName=DNS:snapguard-webhook.snapguard.svc,DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "tls.crt", d / "tls.key"
    make_cert(cert, key)
    return cert, key


class Source:
    """A SnapshotSource the test sets: a real StoreSnapshots, or a stand-in that hangs or fails."""

    def __init__(self) -> None:
        self.inner: Any = None

    def restorable(self, job: str) -> Restorable:
        if self.inner is None:
            return Restorable(None, why_not="no store in this test")
        return self.inner.restorable(job)


@pytest.fixture(scope="module")
def server(tls):  # type: ignore[no-untyped-def]
    source = Source()
    web = Webhook(ServerConfig(str(tls[0]), str(tls[1]), address="127.0.0.1", port=0, max_body_bytes=1 << 20,
                               io_timeout_s=2.0, lookup_timeout_s=1.0), WebhookConfig(), source)
    thread = threading.Thread(target=web.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    web.source = source  # type: ignore[attr-defined]
    yield web
    web.shutdown()
    web.server_close()


def post(web: Webhook, tls: tuple[Path, Path], body: bytes, *, path: str = "/mutate",
         ctype: str = "application/json") -> tuple[int, dict[str, Any]]:
    ctx = ssl.create_default_context(cafile=str(tls[0]))
    conn = http.client.HTTPSConnection("localhost", web.server_address[1], context=ctx, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def ask(web: Webhook, tls: tuple[Path, Path], doc: dict[str, Any]) -> dict[str, Any]:
    code, answer = post(web, tls, json.dumps(doc).encode())
    assert code == 200, answer
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == doc["request"]["uid"] and response["allowed"] is True
    return response


def patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    if "patch" not in response:
        return pod
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(pod))


def assert_valid_pod(pod: dict[str, Any]) -> None:
    """The Kubernetes JSON schema of a v1 Pod (kubernetes-validate's, strict: no unknown field), and
    what the API server's validation adds for the fields the webhook touches."""
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert review_mod.pod_problem(pod) is None
    volumes = [v["name"] for v in pod["spec"]["volumes"]]
    assert len(volumes) == len(set(volumes))
    for c in pod["spec"]["containers"]:
        paths = [m["mountPath"] for m in c.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), paths
        assert all(m["name"] in volumes for m in c.get("volumeMounts", []))
        names = [e["name"] for e in c.get("env", [])]
        assert len(names) == len(set(names)), names
        assert all(("value" in e) != ("valueFrom" in e) for e in c.get("env", []) if len(e) > 1)
    for v in pod["spec"]["volumes"]:
        if "hostPath" in v:
            assert v["hostPath"]["path"].startswith("/") and v["hostPath"]["type"] == "DirectoryOrCreate"


def env_of(pod: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][i].get("env", [])}


# ---- the take point ---------------------------------------------------------------------------

def test_a_deployments_pod_gets_the_take_point_with_its_own_pythonpath_after_it(server, tls) -> None:
    pod = deployment_pod()
    out = patched(pod, ask(server, tls, admission_review(pod)))
    assert_valid_pod(out)
    env = env_of(out)
    assert env["PYTHONPATH"] == f"{HOOK_DIR}:/app/lib:/app/vendor"
    assert env[TAKE_DIR_ENV] == TAKE_DIR and "valueFrom" not in json.dumps(env["PYTHONPATH"])
    assert env["RANK"] == pod["spec"]["containers"][0]["env"][1]["valueFrom"]  # untouched
    mounts = {m["mountPath"]: m for m in out["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[HOOK_DIR]["readOnly"] is True and mounts[SPILL_TMPFS]["readOnly"] is False
    hostpaths = {v["hostPath"]["path"] for v in out["spec"]["volumes"] if "hostPath" in v}
    assert hostpaths == {HOOK_DIR, SPILL_TMPFS}
    assert out["spec"]["containers"][0]["image"] == pod["spec"]["containers"][0]["image"]  # no snapshot: as written
    # the API server may call again (reinvocationPolicy IfNeeded): nothing is added twice
    again = ask(server, tls, admission_review(out, uid="b1c2"))
    assert patched(out, again) == out


def test_a_pod_without_env_or_mounts_gets_them_added(server, tls) -> None:
    pod = deployment_pod()
    c = pod["spec"]["containers"][0]
    del c["env"], c["volumeMounts"]
    del pod["spec"]["volumes"]
    pod["spec"]["containers"].append({"name": "sidecar", "image": "busybox:1.36", "env": []})
    out = patched(pod, ask(server, tls, admission_review(pod)))
    assert_valid_pod(out)
    for i in (0, 1):
        assert env_of(out, i) == {"PYTHONPATH": HOOK_DIR, TAKE_DIR_ENV: TAKE_DIR}
        assert {m["mountPath"] for m in out["spec"]["containers"][i]["volumeMounts"]} == {HOOK_DIR, SPILL_TMPFS}


def test_a_spill_tmpfs_elsewhere_is_mounted_and_named_to_the_take_point(tls) -> None:
    """A node whose spill tmpfs is not the default: mounted at its path, and SPILL_DIR_ENV says where
    (the take point alone would look for SPILL_TMPFS); a spec that sets it keeps its own."""
    from snapguard.webhook.mutate import take_point_patch
    from snapguard.webhook.review import Answer

    config = WebhookConfig(spill_dir="/mnt/spill")
    pod = deployment_pod()
    answer = Answer("u1")
    take_point_patch(pod, config, answer)
    out = patched(pod, answer.review()["response"])
    assert_valid_pod(out)
    assert env_of(out)[protocol.SPILL_DIR_ENV] == "/mnt/spill"
    assert {m["mountPath"] for m in out["spec"]["containers"][0]["volumeMounts"]} >= {HOOK_DIR, "/mnt/spill"}
    assert SPILL_TMPFS not in json.dumps(out["spec"]["volumes"])
    pod["spec"]["containers"][0]["env"].append({"name": protocol.SPILL_DIR_ENV, "value": "/mnt/spill/mine"})
    answer = Answer("u2")
    take_point_patch(pod, config, answer)
    assert env_of(patched(pod, answer.review()["response"]))[protocol.SPILL_DIR_ENV] == "/mnt/spill/mine"
    # the default: nothing to name, the take point finds it
    answer = Answer("u3")
    take_point_patch(deployment_pod(), WebhookConfig(), answer)
    assert protocol.SPILL_DIR_ENV not in env_of(patched(deployment_pod(), answer.review()["response"]))


def test_a_pythonpath_from_valuefrom_is_left_alone_with_a_warning(server, tls) -> None:
    pod = deployment_pod()
    pod["spec"]["containers"][0]["env"][0] = {"name": "PYTHONPATH", "valueFrom": {
        "configMapKeyRef": {"name": "paths", "key": "pythonpath"}}}
    response = ask(server, tls, admission_review(pod))
    assert "patch" not in response
    assert any("valueFrom" in w for w in response["warnings"])


@pytest.mark.parametrize(("change", "warned"), [
    ({"metadata__annotations": {"team": "ml"}}, False),  # not opted in: nothing to say
    ({"spec__runtimeClassName": "nvidia"}, True),  # the annotation without the RuntimeClass
    ({"spec__runtimeClassName": None}, True),
    ({"metadata__annotations": {"snapguard.io/job": "../etc"}}, True),  # not a job name
])
def test_a_pod_not_opted_in_is_admitted_unchanged(server, tls, change, warned) -> None:
    pod = deployment_pod(**change)
    response = ask(server, tls, admission_review(pod))
    assert "patch" not in response and "patchType" not in response
    assert bool(response.get("warnings")) is warned
    if warned:
        assert all(len(w) <= 256 for w in response["warnings"])


def test_not_a_pod_create_is_admitted_unchanged(server, tls) -> None:
    pod = deployment_pod()
    for doc in (admission_review(pod, operation="UPDATE"), admission_review(None, operation="DELETE"),
                admission_review({"apiVersion": "v1", "kind": "Service", "spec": {}}, kind="Service")):
        response = ask(server, tls, doc)
        assert "patch" not in response


def test_a_pod_the_webhook_cannot_read_is_admitted_with_a_warning(server, tls) -> None:
    pod = deployment_pod()
    pod["spec"]["containers"] = {"name": "train"}
    response = ask(server, tls, admission_review(pod))
    assert "patch" not in response and "cannot be read" in response["warnings"][0]
    # a shape the schema lets through and the patch trips over: a fault of the webhook's, the pod admitted
    pod = deployment_pod()
    pod["spec"]["volumes"].append({"name": "snapguard-takepoint", "hostPath": "/var/lib/snapguard/takepoint"})
    response = ask(server, tls, admission_review(pod))
    assert "patch" not in response
    assert response["warnings"][0].startswith(f"snapguard: pod not changed: snapguard {Reason.INTERNAL_ERROR.name}")


# ---- what is not an AdmissionReview -----------------------------------------------------------

@pytest.mark.parametrize("body", [
    b"{not json", b"[]", b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}',
    json.dumps({**admission_review(deployment_pod()), "kind": "Pod"}).encode(),
    json.dumps(admission_review(deployment_pod(), uid="")).encode(),
    json.dumps(admission_review(deployment_pod())).replace('"priority": 0', '"priority": NaN').encode(),
    b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"a": ' + b'{"a": ' * 70 + b"1" + b"}" * 71,
])
def test_a_malformed_review_is_400_with_a_typed_status(server, tls, body) -> None:
    code, status = post(server, tls, body)
    assert code == 400
    assert status["kind"] == "Status" and status["status"] == "Failure" and status["code"] == 400
    assert status["message"].startswith(f"snapguard {Reason.ADMISSION_REVIEW_INVALID.name}: ")
    assert "\n" not in status["message"] and "Traceback" not in status["message"]


def test_a_huge_body_is_refused_unread_and_the_server_goes_on(server, tls) -> None:
    big = json.dumps(admission_review(deployment_pod(**{"metadata__annotations": {
        "snapguard.io/job": "train-llm", "blob": "x" * (2 << 20)}}))).encode()
    t0 = time.monotonic()
    ctx = ssl.create_default_context(cafile=str(tls[0]))
    conn = http.client.HTTPSConnection("localhost", server.server_address[1], context=ctx, timeout=10)
    conn.putrequest("POST", "/mutate")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(big)))
    conn.endheaders(big[:65536])  # the server answers on the headers, reading none of the rest
    resp = conn.getresponse()
    code, status = resp.status, json.loads(resp.read())
    conn.close()
    assert code == 413 and status["code"] == 413 and Reason.ADMISSION_REVIEW_INVALID.name in status["message"]
    assert time.monotonic() - t0 < 5
    code, _ = post(server, tls, b"{}", path="/other")
    assert code == 404
    code, _ = post(server, tls, b"{}", ctype="text/plain")
    assert code == 415
    assert ask(server, tls, admission_review(deployment_pod()))["allowed"] is True


def test_a_client_that_never_finishes_its_handshake_holds_nothing(server, tls) -> None:
    idle = socket.create_connection(("127.0.0.1", server.server_address[1]))
    try:
        assert ask(server, tls, admission_review(deployment_pod()))["allowed"] is True  # served meanwhile
        idle.settimeout(6)
        assert idle.recv(1) == b""  # closed by the server after its io timeout (2 s here)
    finally:
        idle.close()


# ---- the restore: a real file:// store, the kubelet path's records written by the store's API --

def publish(store: Any, epoch: int, container: str = "train", digest: str = DIGEST) -> None:
    ref = f"registry.example.com:5000/snapguard/train-llm@{digest}"
    record_published(store, PublishedImage(job="train-llm", epoch=epoch, reference=ref, digest=digest,
                                           container=container, pod="trainer-7d4b9c8f6-x2k9q", namespace="ml",
                                           host="node-a", time=time.time()))


@pytest.fixture()
def store(server, tmp_path):  # type: ignore[no-untyped-def]
    st = open_store(f"file://{tmp_path}/store")
    server.source.inner = StoreSnapshots(st)
    yield st
    server.source.inner = None


def test_a_replacement_pod_is_pointed_at_its_checkpoint_image_by_digest(server, tls, store) -> None:
    store.register_file_checkpoint("train-llm", "s3://ckpt/train-llm/step-1000")
    time.sleep(0.01)
    publish(store, 0)
    pod = deployment_pod()
    pod["spec"]["containers"].insert(0, {"name": "log-shipper", "image": "fluent/fluent-bit:3.0"})
    out = patched(pod, ask(server, tls, admission_review(pod)))
    assert_valid_pod(out)
    assert out["spec"]["containers"][1]["image"] == CKPT_REF  # the container the snapshot was taken from
    assert out["spec"]["containers"][0]["image"] == "fluent/fluent-bit:3.0"
    notes = out["metadata"]["annotations"]
    assert notes["snapguard.io/epoch"] == "1"  # the attempt takes the job's next epoch
    assert notes["snapguard.io/original-image"] == "registry.example.com:5000/ml/train:1.4"
    assert env_of(out, 1)["PYTHONPATH"].startswith(HOOK_DIR + ":")  # and the take point, as for any opted-in pod

    # restored since (the job took the next epoch): a second replacement starts as written
    assert store.take_epoch("train-llm", expect=0) == 1
    out = patched(pod, ask(server, tls, admission_review(pod, uid="c3")))
    assert out["spec"]["containers"][1]["image"] == "registry.example.com:5000/ml/train:1.4"
    assert "snapguard.io/epoch" not in out["metadata"]["annotations"]
    # the restored job's own snapshot, published under its epoch, is the next replacement's
    publish(store, 1, digest="sha256:" + "cd" * 32)
    out = patched(pod, ask(server, tls, admission_review(pod, uid="c4")))
    assert out["spec"]["containers"][1]["image"].endswith("@sha256:" + "cd" * 32)
    assert out["metadata"]["annotations"]["snapguard.io/epoch"] == "2"


def test_no_restore_when_the_file_checkpoint_is_newer(server, tls, store) -> None:
    publish(store, 0)
    time.sleep(0.01)
    store.register_file_checkpoint("train-llm", "s3://ckpt/train-llm/step-2000")  # written after the snapshot
    pod = deployment_pod()
    out = patched(pod, ask(server, tls, admission_review(pod)))
    assert out["spec"]["containers"][0]["image"] == pod["spec"]["containers"][0]["image"]
    assert "snapguard.io/epoch" not in out["metadata"]["annotations"]
    assert env_of(out)[TAKE_DIR_ENV] == TAKE_DIR


def test_a_snapshot_of_a_container_the_pod_lacks_is_not_restored(server, tls, store) -> None:
    publish(store, 0, container="trainer-old-name")
    response = ask(server, tls, admission_review(deployment_pod()))
    assert any("no container 'trainer-old-name'" in w for w in response["warnings"])
    assert patched(deployment_pod(), response)["spec"]["containers"][0]["image"].endswith(":1.4")


def test_a_hostile_record_or_a_hung_store_never_blocks_the_pod(server, tls, store, tmp_path) -> None:
    # a record nobody's snapguard wrote, put straight into the store's directory: skipped there
    published = tmp_path / "store" / "train-llm" / "published"
    published.mkdir(parents=True)
    (published / "000000000000-ffffffffffffffff.json").write_text(json.dumps(
        {"job": "train-llm", "epoch": 0, "reference": "evil.example.com/x:latest", "digest": DIGEST}))
    pod = deployment_pod()
    out = patched(pod, ask(server, tls, admission_review(pod)))
    assert out["spec"]["containers"][0]["image"] == pod["spec"]["containers"][0]["image"]
    # a lookup of another kind that answers a bad reference: refused by the webhook's own check
    server.source.inner = StoreSnapshots(store, lambda st, job: CheckpointImage("evil.example.com/x:latest", DIGEST, 0))
    response = ask(server, tls, admission_review(pod))
    assert any(Reason.STORE_RECORD_INVALID.name in w for w in response["warnings"])
    out = patched(pod, response)
    assert out["spec"]["containers"][0]["image"] == pod["spec"]["containers"][0]["image"]
    assert env_of(out)[TAKE_DIR_ENV] == TAKE_DIR  # the take point still goes in

    class Hung:
        def restorable(self, job: str) -> Restorable:
            time.sleep(3)
            raise AssertionError("not reached in time")

    server.source.inner = Hung()
    t0 = time.monotonic()
    response = ask(server, tls, admission_review(pod))
    assert time.monotonic() - t0 < 2.5  # the lookup's deadline is 1 s here
    assert any(Reason.STORE_TOO_SLOW.name in w for w in response["warnings"])


# ---- the command ------------------------------------------------------------------------------

def snapguard(*argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "snapguard.cli", *argv], capture_output=True, text=True,
                          timeout=30, check=False, **kw)


def test_the_command_refuses_to_start_without_its_certificate(tls, tmp_path) -> None:
    done = snapguard("webhook", "--port", "0")
    assert done.returncode == 2 and done.stderr.startswith(f"snapguard {Reason.WEBHOOK_TLS_UNUSABLE.name}: ")
    (tmp_path / "bad.key").write_text("not a key\n")
    done = snapguard("webhook", "--port", "0", "--tls-cert", str(tls[0]), "--tls-key", str(tmp_path / "bad.key"))
    assert done.returncode == 2 and Reason.WEBHOOK_TLS_UNUSABLE.name in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_the_command_serves_from_its_store_and_stops_on_sigterm(tls, tmp_path) -> None:
    publish(open_store(f"file://{tmp_path}/store"), 0)
    proc = subprocess.Popen([sys.executable, "-m", "snapguard.cli", "webhook", "--tls-cert", str(tls[0]),
                             "--tls-key", str(tls[1]), "--address", "127.0.0.1", "--port", "0",
                             "--store", f"file://{tmp_path}/store"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("snapguard webhook: listening on https://127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        ctx = ssl.create_default_context(cafile=str(tls[0]))
        conn = http.client.HTTPSConnection("localhost", port, context=ctx, timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().read() == b"ok\n"
        pod = deployment_pod()
        doc = admission_review(pod)
        conn.request("POST", "/mutate", body=json.dumps(doc), headers={"Content-Type": "application/json"})
        out = patched(pod, json.loads(conn.getresponse().read())["response"])
        assert env_of(out)["PYTHONPATH"] == f"{HOOK_DIR}:/app/lib:/app/vendor"
        assert out["spec"]["containers"][0]["image"] == CKPT_REF
        conn.close()
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        log = proc.stderr.read()  # type: ignore[union-attr]
        assert (f"review 705ab4f5-6393-11e8-b7cc-42010a800002 ml/trainer-7d4b9c8f6-*: take point into train; "
                f"restore train from {CKPT_REF} (epoch 1)") in log
    finally:
        proc.kill()
        proc.wait()


def test_a_rotated_certificate_is_served_and_a_broken_one_is_not(tmp_path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    make_cert(cert, key)
    web = Webhook(ServerConfig(str(cert), str(key), address="127.0.0.1", port=0), WebhookConfig(), None)
    threading.Thread(target=web.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def served() -> bytes:
        ctx = ssl.create_default_context(cafile=str(cert))
        with socket.create_connection(("127.0.0.1", web.server_address[1]), timeout=5) as raw:
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                return s.getpeercert(binary_form=True) or b""

    try:
        first = served()
        make_cert(tmp_path / "new.crt", tmp_path / "new.key")  # the Secret's update, as the kubelet swaps it
        os.replace(tmp_path / "new.key", key)
        os.replace(tmp_path / "new.crt", cert)
        second = served()
        assert second != first and second == ssl.PEM_cert_to_DER_cert(cert.read_text())
        key.write_text("not a key\n")  # a broken update: the pair in use stays
        cert.write_text(cert.read_text() + "\n")
        assert served() == second
    finally:
        web.shutdown()
        web.server_close()


# ---- the take point's directory, alone --------------------------------------------------------

def _bare_python() -> str:
    """The system's interpreter, not the venv's: no snapguard in its site-packages."""
    for candidate in (os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}"),
                      "/usr/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("no system interpreter beside the venv")


def test_the_take_point_directory_alone_starts_the_take_point(tmp_path) -> None:
    laid = tmp_path / "node" / "takepoint"
    assert sorted(lay_out(str(laid))) == sorted(HOOK_FILES)
    alone = tmp_path / "container" / "takepoint"
    shutil.copytree(laid, alone)  # the directory alone, as a hostPath mounts it
    probe = ("import json, os, socket, sys, time\n"
             "sock = os.path.join(os.environ['SNAPGUARD_TAKE_DIR'], f'{os.getpid()}.sock')\n"
             "for _ in range(500):  # the take point's thread binds, then listens\n"
             "    s = socket.socket(socket.AF_UNIX); s.settimeout(5)\n"
             "    try:\n"
             "        s.connect(sock); break\n"
             "    except OSError:\n"
             "        s.close(); time.sleep(0.01)\n"
             "s.sendall(b'status\\n')\n"
             "reply = b''\n"
             "while not reply.endswith(b'\\n'): reply += s.recv(4096)\n"
             "import snapguard\n"
             "print(json.dumps({'status': json.loads(reply), 'snapguard': snapguard.__file__,\n"
             "                  'modules': sorted(m for m in sys.modules if m.startswith('snapguard')),\n"
             "                  'path': sys.path}))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(alone), TAKE_DIR_ENV: str(tmp_path / "take")}
    done = subprocess.run([_bare_python(), "-c", probe], env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    out = json.loads(done.stdout)
    assert out["status"]["ok"] is True and out["status"][protocol.PID] > 0
    assert out["snapguard"] == str(alone / "snapguard" / "__init__.py")
    assert all(m == "snapguard" or m.startswith("snapguard.takepoint") for m in out["modules"])
    assert not any(m.startswith(("snapguard.takepoint.client", "snapguard.takepoint.spill")) for m in out["modules"])
    assert not any(str(REPO) in p or ".venv" in p for p in out["path"])
    assert out["path"].index(str(alone)) < min(i for i, p in enumerate(out["path"]) if "site-packages" in p
                                               or "dist-packages" in p)


def test_the_layout_refuses_a_link_and_drops_stale_files(tmp_path) -> None:
    laid = tmp_path / "takepoint"
    lay_out(str(laid))
    (laid / "snapguard" / "takepoint" / "workload" / "gone.py").write_text("")
    lay_out(str(laid))
    assert not (laid / "snapguard" / "takepoint" / "workload" / "gone.py").exists()
    assert oct((laid / "sitecustomize.py").stat().st_mode & 0o777) == oct(0o644)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        lay_out(str(tmp_path / "linked"))
    assert list((tmp_path / "elsewhere").iterdir()) == []
    done = snapguard("webhook", "--lay-out-hook", str(tmp_path / "by-cli"))
    assert done.returncode == 0, done.stderr
    assert sorted(str(p.relative_to(tmp_path / "by-cli")) for p in (tmp_path / "by-cli").rglob("*.py")) == \
        sorted(HOOK_FILES)


def test_a_review_parses_only_what_the_api_server_sends() -> None:
    with pytest.raises(SnapguardError) as e:
        review_mod.parse(json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode())
    assert e.value.reason is Reason.ADMISSION_REVIEW_INVALID and "request" in str(e.value)
    rv = review_mod.parse(json.dumps(admission_review(deployment_pod())).encode())
    assert rv.is_pod_create and rv.namespace == "ml" and rv.uid == "705ab4f5-6393-11e8-b7cc-42010a800002"
