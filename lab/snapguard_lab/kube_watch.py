"""A loopback server shaped like the Kubernetes API for list+watch of nodes and pods, for tests of
the agent's Kubernetes source. It speaks what kube-apiserver speaks on these paths (API concepts,
"Efficient detection of changes"):

- `GET /api/v1/nodes?fieldSelector=metadata.name=N`, `GET /api/v1/pods?fieldSelector=spec.nodeName=N`,
  `GET /api/v1/namespaces/NS/pods?fieldSelector=metadata.name=P`: a `NodeList` / `PodList` with the
  collection's `metadata.resourceVersion`;
- the same with `watch=1&resourceVersion=RV[&allowWatchBookmarks=true][&timeoutSeconds=S]`: HTTP 200,
  `Transfer-Encoding: chunked`, one JSON watch event per line (`{"type": ADDED|MODIFIED|DELETED|
  BOOKMARK|ERROR, "object": ...}`) for every change after RV, until timeoutSeconds; an RV older
  than the last `compact()` gets one `ERROR` event holding a `Status` with code 410 (Expired), as
  the API server sends it, or, with `gone_as_status`, an HTTP 410 answer;
- a bearer token is required (401 `Status` otherwise); with `tls=(cert, key)` it serves HTTPS, as
  the API server does to a pod. Only 127.0.0.1 is ever listened on.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from .loopback_http import LoopbackHttp

__all__ = ["KubeWatchApi"]


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class KubeWatchApi(LoopbackHttp):
    """Nodes and pods, every change a new resourceVersion, watched by any number of clients."""

    METHODS = ("GET",)  # any other method: 501, as BaseHTTPRequestHandler answers it

    def __init__(self, token: str = "test-token", node: str = "node-1", tls: tuple[str, str] | None = None) -> None:
        self.token = token
        self.rv = 100
        self.compacted = 0
        self.gone_as_status = False
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, "nodes"|"pods", type, object)
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[str] = []
        self.watches = 0  # watch requests so far
        self._bad: bytes | None = None
        self._bad_after = 0
        super().__init__(tls)  # snapguard_lab.loopback_http: no client knows its url before it returns
        self.put_node(node)

    @property
    def bad_event(self) -> bytes | None:
        """Raw bytes sent once as a watch event, by the first watch that starts after they are set:
        a watch begun before may be one whose client already left at the end of its window, and
        bytes written to it would be lost."""
        return self._bad

    @bad_event.setter
    def bad_event(self, data: bytes | None) -> None:
        with self.cond:
            self._bad, self._bad_after = data, self.watches

    def _request(self, h: Any, method: str) -> None:
        self.requests.append(h.path)
        self._get(h)

    # -- the objects ------------------------------------------------------------------------------
    def _changed(self, kind: str, etype: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, kind, etype, copy.deepcopy(obj)))
        self.cond.notify_all()

    def put_node(self, name: str) -> None:
        with self.cond:
            self.nodes[name] = {"kind": "Node", "apiVersion": "v1",
                                "metadata": {"name": name, "uid": f"uid-{name}", "labels": {}},
                                "spec": {}, "status": {"conditions": [
                                    {"type": "Ready", "status": "True", "reason": "KubeletReady",
                                     "message": "kubelet is posting ready status",
                                     "lastTransitionTime": "2026-12-01T09:00:00Z"}]}}
            self._changed("nodes", "ADDED", self.nodes[name])

    def edit_node(self, name: str, fn: Callable[[dict[str, Any]], None]) -> None:
        with self.cond:
            fn(self.nodes[name])
            self._changed("nodes", "MODIFIED", self.nodes[name])

    def taint(self, name: str, key: str, effect: str = "NoSchedule", value: str | None = None) -> None:
        t = {"key": key, "effect": effect, "timeAdded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if value is not None:
            t["value"] = value
        self.edit_node(name, lambda n: n["spec"].setdefault("taints", []).append(t))

    def cordon(self, name: str) -> None:
        def fn(n: dict[str, Any]) -> None:  # what `kubectl cordon` does, and the node lifecycle controller after it
            n["spec"]["unschedulable"] = True
            n["spec"].setdefault("taints", []).append(
                {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": "2026-12-01T10:00:00Z"})
        self.edit_node(name, fn)

    def heartbeat(self, name: str) -> None:
        self.edit_node(name, lambda n: n["status"].__setitem__("heartbeat", time.time()))

    def put_pod(self, ns: str, name: str, node: str, annotations: dict[str, str] | None = None) -> None:
        with self.cond:
            self.pods[(ns, name)] = {"kind": "Pod", "apiVersion": "v1",
                                     "metadata": {"name": name, "namespace": ns, "uid": f"uid-{ns}-{name}",
                                                  "annotations": dict(annotations or {})},
                                     "spec": {"nodeName": node, "runtimeClassName": "snapguard"},
                                     "status": {"phase": "Running",
                                                "conditions": [{"type": "Ready", "status": "True"}]}}
            self._changed("pods", "ADDED", self.pods[(ns, name)])

    def disrupt(self, ns: str, name: str, reason: str = "EvictionByEvictionAPI") -> None:
        """The condition the API server's eviction (or the taint manager, the scheduler's preemption,
        the kubelet's shutdown) sets on a pod it is about to delete."""
        with self.cond:
            self.pods[(ns, name)]["status"]["conditions"].append({
                "type": "DisruptionTarget", "status": "True", "reason": reason,
                "message": "Eviction API: evicting", "lastTransitionTime": "2026-12-01T10:00:00Z"})
            self._changed("pods", "MODIFIED", self.pods[(ns, name)])

    def compact(self) -> None:
        """etcd compaction: every resourceVersion up to now is too old to watch from."""
        with self.cond:
            self.compacted = self.rv
            self.events.clear()

    # -- serving ----------------------------------------------------------------------------------
    def _match(self, kind: str, path: str, selector: str) -> Callable[[dict[str, Any]], bool]:
        field, _, value = selector.partition("=")
        ns = path.split("/")[4] if path.startswith("/api/v1/namespaces/") else None

        def ok(obj: dict[str, Any]) -> bool:
            if ns is not None and obj["metadata"].get("namespace") != ns:
                return False
            if field == "metadata.name":
                return bool(obj["metadata"]["name"] == value)
            if field == "spec.nodeName":
                return bool(obj.get("spec", {}).get("nodeName") == value)
            return not field
        return ok

    def _reply(self, h: Any, code: int, doc: Any) -> None:
        h.reply(code, json.dumps(doc), {"Content-Type": "application/json"})

    def _get(self, h: Any) -> None:
        if h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._reply(h, 401, _status(401, "Unauthorized", "Unauthorized"))
        u = urllib.parse.urlsplit(h.path)
        q = dict(urllib.parse.parse_qsl(u.query))
        if u.path == "/api/v1/nodes":
            kind = "nodes"
        elif u.path == "/api/v1/pods" or (u.path.startswith("/api/v1/namespaces/") and u.path.endswith("/pods")):
            kind = "pods"
        else:
            return self._reply(h, 404, _status(404, "NotFound", "the server could not find the requested resource"))
        ok = self._match(kind, u.path, q.get("fieldSelector", ""))
        if q.get("watch") not in ("1", "true"):
            with self.cond:
                objs = self.nodes.values() if kind == "nodes" else self.pods.values()
                items = [copy.deepcopy(o) for o in objs if ok(o)]
                rv = self.rv
            return self._reply(h, 200, {"kind": "NodeList" if kind == "nodes" else "PodList", "apiVersion": "v1",
                                        "metadata": {"resourceVersion": str(rv)}, "items": items})
        since = int(q.get("resourceVersion") or 0)
        if since < self.compacted and self.gone_as_status:
            return self._reply(h, 410, _status(410, "Gone", "too old resource version"))
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(doc: Any) -> None:
            data = doc if isinstance(doc, bytes) else json.dumps(doc).encode() + b"\n"
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        with self.cond:
            self.watches += 1
            mine = self.watches
        try:
            if since < self.compacted:
                send({"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {since} "
                                                               f"({self.compacted})")})
                return h.wfile.write(b"0\r\n\r\n")
            end = time.monotonic() + float(q.get("timeoutSeconds") or 30)
            if q.get("allowWatchBookmarks") == "true":
                send({"type": "BOOKMARK", "object": {"kind": "Node" if kind == "nodes" else "Pod", "apiVersion": "v1",
                                                     "metadata": {"resourceVersion": str(max(since, self.rv))}}})
            while time.monotonic() < end and not self.closed:
                with self.cond:
                    new = [(rv, t, o) for rv, k, t, o in self.events if k == kind and rv > since and ok(o)]
                    bad = None
                    if mine > self._bad_after:
                        bad, self._bad = self._bad, None
                    if not new and bad is None:
                        self.cond.wait(min(0.2, max(0.0, end - time.monotonic())))
                        continue
                if bad is not None:
                    send(bad)
                for rv, t, o in new:
                    send({"type": t, "object": o})
                    since = rv
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        return None
