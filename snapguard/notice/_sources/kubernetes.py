"""The Kubernetes notice sources: a list, then a watch, of this node and of its opted-in pods.

Each is the API's list+watch: `GET <collection>?fieldSelector=...` for the items and the
collection's resourceVersion, then `GET ...&watch=1&resourceVersion=RV&allowWatchBookmarks=true
&timeoutSeconds=N`, whose chunked body is one JSON watch event a line (ADDED, MODIFIED, DELETED,
BOOKMARK, ERROR). A 410 Gone (as the watch's status, or as an ERROR event's Status) means the
resourceVersion is too old: the next round lists again. Each round is bounded by its deadline
(the agent gives a watch `window_s`); one malformed event is refused (recorded) and the watch
goes on. The bearer token is re-read at each round (projected tokens rotate) and the API server is
verified against the service account's CA.

What counts as a reclaim, as the cloud or the cluster means one (the keys are the owners'):
- node taints: GKE's `cloud.google.com/impending-node-termination`; Karpenter's
  `karpenter.sh/disrupted` (v1) and `karpenter.sh/disruption=disrupting` (v1beta1); the cluster
  autoscaler's `ToBeDeletedByClusterAutoscaler`; `node.kubernetes.io/out-of-service` (non-graceful
  shutdown); the AWS Node Termination Handler's `aws-node-termination-handler/spot-itn`,
  `.../scheduled-maintenance` and `.../asg-lifecycle-termination`;
- graceful node shutdown: the kubelet's Ready condition not True with "node is shutting down";
- a node condition type named in `node_conditions` True;
- an opted-in pod's (annotation `snapguard.io/job`) `DisruptionTarget` condition True.
A plain cordon (`spec.unschedulable`, the `node.kubernetes.io/unschedulable` taint) is a notice
only with `notice_on_cordon`. AKS's `kubernetes.azure.com/scalesetpriority=spot` taint is on every
spot node from its start, so it is not one (an AKS eviction reaches the agent through Azure's
Scheduled Events, `--source azure`).
"""

from __future__ import annotations

import os
import ssl
import time
import urllib.parse
from typing import Any

from ...reasons import SnapguardError
from ._base import Notice, Refusals, with_deadline
from ._http import Exchange, request, unavailable
from ._parse import check, parse
from ._schemas import K8S_LIST, K8S_NODE, K8S_POD, K8S_WATCH_EVENT

__all__ = ["K8S_CA", "K8S_TOKEN", "K8S_URL", "RECLAIM_TAINTS", "KubeNode", "KubePods", "default_url",
           "kubernetes_sources"]

SERVICEACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
K8S_TOKEN = f"{SERVICEACCOUNT}/token"
K8S_CA = f"{SERVICEACCOUNT}/ca.crt"
K8S_URL = "https://kubernetes.default.svc"
JOB_ANNOTATION = "snapguard.io/job"
RECLAIM_TAINTS = {
    "cloud.google.com/impending-node-termination": "GKE impending node termination",
    "karpenter.sh/disrupted": "Karpenter disruption",
    "karpenter.sh/disruption": "Karpenter disruption",
    "ToBeDeletedByClusterAutoscaler": "cluster autoscaler scale-down",
    "node.kubernetes.io/out-of-service": "node out of service",
    "aws-node-termination-handler/spot-itn": "EC2 spot interruption (AWS Node Termination Handler)",
    "aws-node-termination-handler/scheduled-maintenance": "EC2 scheduled maintenance (AWS Node Termination Handler)",
    "aws-node-termination-handler/asg-lifecycle-termination": "ASG termination (AWS Node Termination Handler)",
}
CORDON_TAINT = "node.kubernetes.io/unschedulable"
SHUTTING_DOWN = "node is shutting down"
WINDOW_S = 60.0
_MAX_LIST = 16 << 20  # a PodList of one node's pods
_MAX_EVENT = 4 << 20


def default_url(env: dict[str, str] | None = None) -> str:
    """The in-cluster API server: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT."""
    env = os.environ if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT") or "443"
    if not host:
        return K8S_URL
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class _Watch(Refusals):
    """List, then watch, one collection; `judge(obj)` says whether an object is a notice."""

    name = "k8s"
    lead_s = None
    window_s = WINDOW_S
    schema: dict[str, Any] = {}

    def __init__(self, base_url: str, path: str, selector: str, *, token_file: str | None, ca_file: str | None) -> None:
        super().__init__()
        self.base = base_url.rstrip("/")
        self.path, self.selector = path, selector
        self.token_file, self.ca_file = token_file, ca_file
        self.rv: str | None = None
        self.relists = 0
        self._pending: list[Notice] = []
        self._said: set[str] = set()

    def judge(self, obj: dict[str, Any]) -> Notice | None:
        raise NotImplementedError

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_file:
            try:
                with open(self.token_file, "rb") as f:
                    token = f.read(64 * 1024).decode("ascii", "replace").strip()
            except OSError as e:
                raise unavailable(self.name, self.base, f"token {self.token_file}: {e.strerror or e}") from None
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _context(self) -> ssl.SSLContext | None:
        if not self.base.startswith("https:"):
            return None
        if self.ca_file and not os.path.exists(self.ca_file):
            raise unavailable(self.name, self.base, f"CA {self.ca_file} is missing")
        try:
            return ssl.create_default_context(cafile=self.ca_file or None)
        except (OSError, ssl.SSLError) as e:
            raise unavailable(self.name, self.base, f"CA {self.ca_file}: {e}") from None

    def _url(self, **extra: str) -> str:
        return f"{self.base}{self.path}?" + urllib.parse.urlencode({"fieldSelector": self.selector, **extra})

    def _offer(self, obj: dict[str, Any], where: str) -> None:
        try:
            check(self.name, where, obj, self.schema)
        except SnapguardError as err:
            self.refuse(err, where)
            return
        n = self.judge(obj)
        if n is not None and n.id not in self._said:
            self._said.add(n.id)
            self._pending.append(n)

    def _list(self, deadline: float) -> None:
        url = self._url()
        resp = request(self.name, url, deadline, headers=self._headers(), context=self._context(), max_body=_MAX_LIST)
        doc = parse(self.name, url, resp.body, max_bytes=_MAX_LIST, schema=K8S_LIST)
        for item in doc["items"]:
            self._offer(item, url)
        self.rv = doc["metadata"]["resourceVersion"]

    def _watch(self, deadline: float) -> None:
        assert self.rv is not None
        timeout = max(1, int(deadline - time.monotonic()))
        url = self._url(watch="1", resourceVersion=self.rv, allowWatchBookmarks="true", timeoutSeconds=str(timeout))
        with Exchange(self.name, url, deadline, headers=self._headers(), context=self._context()) as ex:
            ex.open()
            if ex.status == 410:
                self.rv = None  # too old: list again
                return
            if not 200 <= ex.status < 300:
                ex.body(64 * 1024)
                raise unavailable(self.name, url, f"HTTP {ex.status} {ex.reason}".strip())
            for line in ex.lines(_MAX_EVENT):
                try:
                    ev = parse(self.name, url, line, max_bytes=_MAX_EVENT, schema=K8S_WATCH_EVENT)
                except SnapguardError as err:
                    self.refuse(err, url)
                    continue
                obj = ev["object"]
                if ev["type"] == "ERROR":
                    if obj.get("code") == 410:
                        self.rv = None
                        return
                    raise unavailable(self.name, url, f"watch ERROR {obj.get('code')} {obj.get('reason', '')}: "
                                      f"{str(obj.get('message', ''))[:200]}")
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if ev["type"] != "DELETED":
                    if ev["type"] != "BOOKMARK":
                        self._offer(obj, url)
                if rv:
                    self.rv = rv
                if self._pending:
                    return  # a notice: act now; the next round resumes from rv

    def poll(self, deadline: float) -> Notice | None:
        """The next notice: what the list or the watch turned up; None at `deadline`."""
        while not self._pending and time.monotonic() < deadline - 0.05:
            start = time.monotonic()
            if self.rv is None:
                self.relists += 1
                self._list(deadline)
                continue
            self._watch(deadline)
            if not self._pending and self.rv is not None and time.monotonic() - start < 0.5:
                time.sleep(max(0.0, min(0.5, deadline - time.monotonic() - 0.05)))  # a watch ended at once
        return self._pending.pop(0) if self._pending else None


class KubeNode(_Watch):
    """This node: its reclaim taints, a graceful shutdown, configured conditions, (a cordon)."""

    name = "k8s-node"
    schema = K8S_NODE

    def __init__(self, base_url: str, node: str, *, token_file: str | None = K8S_TOKEN, ca_file: str | None = K8S_CA,
                 node_conditions: tuple[str, ...] = (), notice_on_cordon: bool = False) -> None:
        super().__init__(base_url, "/api/v1/nodes", f"metadata.name={node}", token_file=token_file, ca_file=ca_file)
        self.node = node
        self.node_conditions = node_conditions
        self.notice_on_cordon = notice_on_cordon

    def judge(self, obj: dict[str, Any]) -> Notice | None:
        meta, spec = obj["metadata"], obj.get("spec") or {}
        if meta["name"] != self.node:
            return None
        uid = meta.get("uid", "")
        base = f"k8s:node:{self.node}:{uid}"
        for t in spec.get("taints") or []:
            what = RECLAIM_TAINTS.get(t["key"])
            if what and not (t["key"] == "karpenter.sh/disruption" and t.get("value") != "disrupting"):
                return with_deadline(f"{base}:taint:{t['key']}:{t.get('timeAdded', '')}", self.name, "reclaim",
                                     f"node {self.node} taint {t['key']}:{t['effect']} ({what})", None, t)
        for c in (obj.get("status") or {}).get("conditions") or []:
            text = f"{c.get('reason', '')} {c.get('message', '')}".lower()
            if c["type"] == "Ready" and c["status"] != "True" and SHUTTING_DOWN in text:
                return with_deadline(f"{base}:shutdown:{c.get('lastTransitionTime', '')}", self.name, "shutdown",
                                     f"node {self.node} is shutting down (kubelet: {c.get('message', '')[:200]})",
                                     None, c)
            if c["type"] in self.node_conditions and c["status"] == "True":
                return with_deadline(f"{base}:condition:{c['type']}:{c.get('lastTransitionTime', '')}", self.name,
                                     "condition", f"node {self.node} condition {c['type']} True: "
                                     f"{c.get('reason', '')}", None, c)
        if self.notice_on_cordon:
            cordon = next((t for t in spec.get("taints") or [] if t["key"] == CORDON_TAINT), None)
            if spec.get("unschedulable") is True or cordon is not None:
                added = (cordon or {}).get("timeAdded", "")
                return with_deadline(f"{base}:cordon:{added}", self.name, "drain",
                                     f"node {self.node} cordoned (spec.unschedulable; --notice-on-cordon)", None,
                                     {"spec": spec})
        return None


class KubePods(_Watch):
    """The opted-in pods (annotation snapguard.io/job) of this node, or one pod: DisruptionTarget."""

    name = "k8s-pods"
    schema = K8S_POD

    def __init__(self, base_url: str, *, node: str | None = None, pod: str | None = None,
                 token_file: str | None = K8S_TOKEN, ca_file: str | None = K8S_CA) -> None:
        if pod:
            ns, name = pod.split("/")
            path, selector = f"/api/v1/namespaces/{urllib.parse.quote(ns, safe='')}/pods", f"metadata.name={name}"
        else:
            path, selector = "/api/v1/pods", f"spec.nodeName={node}"
        super().__init__(base_url, path, selector, token_file=token_file, ca_file=ca_file)

    def judge(self, obj: dict[str, Any]) -> Notice | None:
        meta = obj["metadata"]
        if not (meta.get("annotations") or {}).get(JOB_ANNOTATION):
            return None  # not opted in
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c["type"] == "DisruptionTarget" and c["status"] == "True":
                ns, name = meta["namespace"], meta["name"]
                return with_deadline(f"k8s:pod:{ns}/{name}:{meta.get('uid', '')}:DisruptionTarget:"
                                     f"{c.get('lastTransitionTime', '')}", self.name, "disruption",
                                     f"pod {ns}/{name} DisruptionTarget {c.get('reason', '')}: "
                                     f"{c.get('message', '')}".strip(), None, c)
        return None


def kubernetes_sources(base_url: str, *, node: str | None, pod: str | None = None,
                       token_file: str | None = K8S_TOKEN, ca_file: str | None = K8S_CA,
                       node_conditions: tuple[str, ...] = (), notice_on_cordon: bool = False) -> list[_Watch]:
    """The watches `--source kubernetes` runs: the node's, and its pods' (or the one pod's)."""
    from ...reasons import Reason

    if not node and not pod:
        raise SnapguardError(Reason.USAGE_ERROR, "the kubernetes source needs this node's name (--k8s-node or "
                             "$NODE_NAME), a pod (--k8s-pod NS/NAME) or both")
    if pod and (pod.count("/") != 1 or not all(pod.split("/"))):
        raise SnapguardError(Reason.USAGE_ERROR, f"--k8s-pod {pod!r}: give NAMESPACE/NAME")
    for what, value in (("--k8s-node", node), ("--k8s-pod", pod)):
        if value and any(c in value for c in ",=!\0\r\n "):
            raise SnapguardError(Reason.USAGE_ERROR, f"{what} {value!r} is not a Kubernetes object name")
    out: list[_Watch] = []
    if node:
        out.append(KubeNode(base_url, node, token_file=token_file, ca_file=ca_file, node_conditions=node_conditions,
                            notice_on_cordon=notice_on_cordon))
    out.append(KubePods(base_url, node=node, pod=pod, token_file=token_file, ca_file=ca_file))
    return out

