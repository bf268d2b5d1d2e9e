"""The Helm chart (deploy/helm/snapguard): `helm lint` and `helm template` with the default values
and with others, every rendered manifest validated against the Kubernetes JSON schemas
(kubernetes-validate's offline copy, strict: no unknown field), and what the manifests must mean:
the agent's DaemonSet runs with hostPID and NODE_NAME from spec.nodeName and watches a cluster
source; its command lines parse with snapguard's own parser; the webhook's failurePolicy is
Ignore and its caBundle is the CA that signed the certificate the real `snapguard webhook` serves;
RBAC has no wildcard and nothing but reads; the values schema refuses bad values before anything
is rendered. helm is .venv/bin/helm (packaging/install-helm.sh); no API server is contacted."""

from __future__ import annotations

import base64
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from snapguard.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "snapguard"
HELM = os.path.join(os.path.dirname(sys.executable), "helm")
SNAPGUARD = os.path.join(os.path.dirname(sys.executable), "snapguard")
NS = "snapguard"
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the chart's kubeVersion floor, the newest schemas carried
CERT_MANAGER = {"Issuer", "Certificate"}  # CRDs: kubernetes-validate has no schema for them

# Value sets beside the defaults: the agent from the image with its host paths mounted, a store
# with credentials and an existing TLS Secret; cert-manager, a created namespace, cloud sources.
IMAGE_MODE = ["agent.runInHost=false", "store.url=s3://snaps/cluster-a", "store.credentialsSecret=store-creds",
              "webhook.tls.mode=secret", "webhook.tls.secretName=wh-tls", "webhook.tls.caBundle=Q0E=",
              "agent.keep=3", "agent.noticeOnCordon=true", "agent.nodeConditions={Preempting}",
              "metrics.enabled=false", "webhook.injectTakePoint=false"]
CERT_MANAGER_MODE = ["webhook.tls.mode=certManager", "namespace.create=true", "agent.sources={kubernetes,aws}",
                     "runtimeClass.name=snapguard-gpu", "agent.layOutHook=false"]


def _helm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    if not os.access(HELM, os.X_OK):
        pytest.fail(f"{HELM} is missing: packaging/setup.sh installs it (packaging/install-helm.sh)")
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HELM_CACHE_HOME": "/nonexistent", "KUBECONFIG": "/nonexistent"})


def _render(sets: list[str] | tuple[str, ...] = ()) -> list[dict[str, Any]]:
    out = _helm("template", "sg", str(CHART), "--namespace", NS, *[a for s in sets for a in ("--set", s)])
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s rendered"
    return found[0]


def _pod(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return _one(docs, kind)["spec"]["template"]["spec"]


def _snapguard_argv(container: dict[str, Any]) -> list[str]:
    """The snapguard command line a container runs (after nsenter's `--` in host mode), with the
    $(VAR) references Kubernetes expands given sample values."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[0] == "nsenter":
        argv = argv[argv.index("--") + 1:]
    assert argv[0] in ("snapguard", "/usr/bin/snapguard"), argv
    return [a.replace("$(NODE_NAME)", "node-1").replace("$(POD_UID)", "uid") for a in argv[1:]]


def test_helm_lint_with_default_and_other_values() -> None:
    for sets in ((), IMAGE_MODE, CERT_MANAGER_MODE):
        out = _helm("lint", "--strict", str(CHART), "--namespace", NS, *[a for s in sets for a in ("--set", s)])
        assert out.returncode == 0 and "0 chart(s) failed" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("sets", [(), IMAGE_MODE, CERT_MANAGER_MODE], ids=["default", "image-mode", "cert-manager"])
def test_every_rendered_manifest_is_valid_kubernetes(sets: list[str]) -> None:
    docs = _render(sets)
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "Deployment", "Service", "MutatingWebhookConfiguration", "RuntimeClass",
            "ClusterRole", "ClusterRoleBinding", "ServiceAccount"} <= kinds
    for doc in docs:
        if doc["kind"] in CERT_MANAGER:
            assert doc["apiVersion"] == "cert-manager.io/v1" and doc["metadata"]["namespace"] == NS
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    assert (kinds & CERT_MANAGER) == (CERT_MANAGER if sets is CERT_MANAGER_MODE else set())


def test_the_schema_check_can_fail() -> None:
    """The validation above refuses a field Kubernetes does not have and a wrong type."""
    ds = _one(_render(), "DaemonSet")
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBE_VERSIONS[0], strict=True)
    mwc = _one(_render(), "MutatingWebhookConfiguration")
    mwc["webhooks"][0]["timeoutSeconds"] = "10"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(mwc, KUBE_VERSIONS[0], strict=True)


def test_the_agent_daemonset() -> None:
    docs = _render()
    pod = _pod(docs, "DaemonSet")
    assert pod["hostPID"] is True
    assert pod["nodeSelector"] == {"snapguard/installed": "true"}
    assert pod["serviceAccountName"] == "sg-snapguard-agent" and pod["automountServiceAccountToken"] is False
    (agent,) = [c for c in pod["containers"] if c["name"] == "agent"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert agent["securityContext"]["privileged"] is True
    argv = _snapguard_argv(agent)
    args = build_parser().parse_args(argv)  # every flag the chart passes is one the agent has
    assert args.command == "agent" and args.source == ["kubernetes"] and args.containerd
    assert args.k8s_node == "node-1" and not args.notice_on_cordon
    assert args.cri_socket is None and args.registry is None  # the CRI path: off until a registry is set
    # host mode: the token and CA as the kubelet keeps the pod's projected volume on the host
    assert args.k8s_token_file == "/var/lib/kubelet/pods/uid/volumes/kubernetes.io~projected/snapguard-api/token"
    assert {v["name"] for v in pod["volumes"]} == {"snapguard-api"}
    (init,) = pod["initContainers"]
    hook = build_parser().parse_args(_snapguard_argv(init))
    assert hook.command == "webhook" and hook.lay_out_hook == "/var/lib/snapguard/takepoint"
    (metrics,) = [c for c in pod["containers"] if c["name"] == "metrics"]
    m = build_parser().parse_args(_snapguard_argv(metrics))
    assert m.command == "metrics" and m.textfile == "/var/lib/prometheus/node-exporter"


def test_the_agent_takes_the_cri_path_with_a_registry_and_a_store() -> None:
    sets = ["agent.cri.registry=https://registry.example:5000", "store.url=s3://snaps/ckpt"]
    (agent,) = [c for c in _pod(_render(sets), "DaemonSet")["containers"] if c["name"] == "agent"]
    args = build_parser().parse_args(_snapguard_argv(agent))
    assert (args.cri_socket, args.registry, args.registry_repository, args.store) == (
        "/run/containerd/containerd.sock", "https://registry.example:5000", "snapguard/ckpt", "s3://snaps/ckpt")
    out = _helm("template", "sg", str(CHART), "--namespace", NS, "--set", sets[0])
    assert out.returncode != 0 and "set store.url" in out.stderr, out.stderr


def test_the_agent_from_the_image_mounts_its_host_paths() -> None:
    pod = _pod(_render(IMAGE_MODE), "DaemonSet")
    (agent,) = pod["containers"]
    args = build_parser().parse_args(_snapguard_argv(agent))
    assert args.store == "s3://snaps/cluster-a" and args.keep == 3 and args.notice_on_cordon
    assert args.k8s_node_condition == ["Preempting"]
    assert args.k8s_token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"  # the default
    assert agent["envFrom"] == [{"secretRef": {"name": "store-creds"}}]
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    for path in ("/run/containerd", "/var/lib/snapguard", "/etc/snapguard", "/run/snapguard",
                 "/run/snapguard-spill", "/dev", "/sys/fs/cgroup"):
        assert path in mounts
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert {m["mountPath"] for m in agent["volumeMounts"] if m["name"] in host} == \
        mounts - {"/var/run/secrets/kubernetes.io/serviceaccount"}
    assert all(host[m["name"]] == m["mountPath"] for m in agent["volumeMounts"] if m["name"] in host)
    (init,) = pod["initContainers"]  # the take point's directory, laid out from the image onto the host
    assert host[init["volumeMounts"][0]["name"]] == init["volumeMounts"][0]["mountPath"] == "/var/lib/snapguard/takepoint"


def test_the_webhook() -> None:
    docs = _render()
    (hook,) = _one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"] and 1 <= hook["timeoutSeconds"] <= 30
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    (expr,) = hook["namespaceSelector"]["matchExpressions"]
    assert expr["operator"] == "NotIn" and set(expr["values"]) == {"kube-system", NS}  # never its own pods
    svc = hook["clientConfig"]["service"]
    assert (svc["name"], svc["namespace"], svc["path"]) == ("sg-snapguard-webhook", NS, "/mutate")
    pod = _pod(docs, "Deployment")
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    args = build_parser().parse_args(_snapguard_argv(c))
    assert args.command == "webhook" and args.port == 8443 and args.runtime_class == "snapguard"
    assert args.tls_cert == "/etc/snapguard/tls/tls.crt" and args.store is None
    # the Service's port reaches the container's
    service = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == svc["name"]][0]
    assert service["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]
    assert service["spec"]["selector"] == _one(docs, "Deployment")["spec"]["selector"]["matchLabels"]


def test_the_webhook_tls_modes() -> None:
    docs = _render(IMAGE_MODE)
    assert not [d for d in docs if d["kind"] == "Secret"]  # an existing Secret is used, not made
    (hook,) = _one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["caBundle"] == "Q0E="
    pod = _pod(docs, "Deployment")
    assert pod["volumes"][0]["secret"]["secretName"] == "wh-tls"
    assert "--no-take-point" in pod["containers"][0]["args"]
    docs = _render(CERT_MANAGER_MODE)
    mwc = _one(docs, "MutatingWebhookConfiguration")
    assert mwc["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": f"{NS}/sg-snapguard-webhook"}
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"]
    assert _one(docs, "Certificate")["spec"]["secretName"] == "sg-snapguard-webhook-tls"


def test_the_generated_certificate_is_served_by_the_real_webhook(tmp_path: Path) -> None:
    """helm's CA and certificate: the real `snapguard webhook` serves them and a client that trusts
    only the caBundle verifies it for the Service's DNS name, as the API server does."""
    docs = _render()
    secret = _one(docs, "Secret")
    (hook,) = _one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert secret["data"]["ca.crt"] == hook["clientConfig"]["caBundle"]
    for key in ("tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([SNAPGUARD, "webhook", f"--tls-cert={tmp_path / 'tls.crt'}",
                             f"--tls-key={tmp_path / 'tls.key'}", "--address=127.0.0.1", f"--port={port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ctx = ssl.create_default_context(cadata=base64.b64decode(hook["clientConfig"]["caBundle"]).decode())
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                        ctx.wrap_socket(raw, server_hostname=f"sg-snapguard-webhook.{NS}.svc") as tls:
                    tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    answer = tls.recv(4096)
                break
            except ConnectionRefusedError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.1)
        assert answer.startswith(b"HTTP/1.") and b" 200 " in answer.split(b"\r\n")[0]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                pytest.raises(ssl.SSLCertVerificationError):
            ctx.wrap_socket(raw, server_hostname="other.example")  # the name is checked, too
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_rbac_is_minimal() -> None:
    for sets in ((), CERT_MANAGER_MODE):
        docs = _render(sets)
        roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
        assert [r["metadata"]["name"] for r in roles] == ["sg-snapguard-agent"]  # the webhook reads no API
        for rule in roles[0]["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], rule
            assert set(rule["verbs"]) <= {"get", "list", "watch"} and set(rule["resources"]) <= {"nodes", "pods"}
        for binding in (d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")):
            assert binding["roleRef"]["name"] == "sg-snapguard-agent", binding  # never cluster-admin
            assert [s["name"] for s in binding["subjects"]] == ["sg-snapguard-agent"]
        accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
        assert set(accounts) == {"sg-snapguard-agent", "sg-snapguard-webhook"}
        assert all(a["automountServiceAccountToken"] is False for a in accounts.values())
    # without the kubernetes source the agent reads nothing of the API: no role at all
    docs = _render(["agent.sources={aws,gce}"])
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")]


def test_the_runtime_class_and_the_namespace() -> None:
    docs = _render()
    rc = _one(docs, "RuntimeClass")
    assert rc["metadata"]["name"] == "snapguard" and rc["handler"] == "snapguard"
    assert rc["scheduling"]["nodeSelector"] == _pod(docs, "DaemonSet")["nodeSelector"]
    assert not [d for d in docs if d["kind"] == "Namespace"]
    docs = _render(CERT_MANAGER_MODE)
    ns = _one(docs, "Namespace")
    assert ns["metadata"]["name"] == NS and ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert _one(docs, "RuntimeClass")["metadata"]["name"] == "snapguard-gpu"
    args = build_parser().parse_args(_snapguard_argv(_pod(docs, "DaemonSet")["containers"][0]))
    assert args.source == ["kubernetes", "aws"]


@pytest.mark.parametrize("bad, where", [
    ("webhook.failurePolicy=Never", "/webhook/failurePolicy"),
    ("webhook.timeoutSeconds=31", "/webhook/timeoutSeconds"),
    ("agent.sources={local,spot}", "/agent/sources"),
    ("agent.images=relative/dir", "/agent/images"),
    ("store.url=ftp://host/x", "/store/url"),
    ("agent.keep=0", "/agent/keep"),
    ("webhook.tls.mode=secret", "/webhook/tls"),
    ("agent.privilegd=true", "privilegd"),
    ("agent.cri.registry=registry.example", "/agent/cri/registry"),
], ids=lambda v: v.split("=")[0] if "=" in v else "")
def test_the_values_schema_refuses_a_bad_value(bad: str, where: str) -> None:
    out = _helm("template", "sg", str(CHART), "--namespace", NS, "--set", bad)
    assert out.returncode != 0 and out.stdout == ""
    assert "values don't meet the specifications of the schema" in out.stderr and where in out.stderr, out.stderr
