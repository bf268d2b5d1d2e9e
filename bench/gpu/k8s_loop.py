"""The whole Kubernetes loop with a PyTorch trainer pod, against the trainer's own file checkpoint.

One command, as root, on the machine whose GPU the trainer uses (`--device cuda`, the default) or on
the CPU (`--device cpu`, a small model: the same machinery where there is no GPU):

  reference  the trainer (lab workload torch/train.py) uninterrupted, a plain process on the host
  snapguard  node A (containerd 2.1.9 with CRI, runtime handler `snapguard` = snapguard-runc, its own
             root, sockets and network namespace: snapguard_lab.k8s_nodes.TwoNodes) runs the trainer
             pod. The pod is a v1 Pod as the job's controller creates it (RuntimeClass snapguard, the
             annotation snapguard.io/job, the host's Python and torch and a shared directory as
             hostPath volumes, one GPU), sent as an AdmissionReview v1 CREATE to snapguard's own
             webhook (snapguard.webhook.Webhook, the real server over HTTPS on loopback with a
             self-signed certificate; its handler in this process where there is no /usr/bin/openssl),
             the JSONPatch it answers applied as the API server applies it (the take point: PYTHONPATH,
             SNAPGUARD_TAKE_DIR, the hook directory `snapguard webhook --lay-out-hook` wrote and the
             node's spill tmpfs as hostPath mounts), and the result handed to node A as the kubelet
             does (RunPodSandbox with the pod's annotations, CreateContainer with its command, env
             and mounts, the GPU's device files as the device plugin allocates them, StartContainer).
             At step --at the notice: the agent's CRI step (snapguard.notice._cri.snapshot_pod: CRI
             CheckpointContainer through snapguard-runc with the take point and CRIU's CUDA plugin,
             StopContainer beside the publish, the archive made an OCI checkpoint image and streamed
             to the registry, Debian's docker-registry, hashed as it is sent, digest-checked,
             recorded in the job's store entry with its epoch). Node B: the replacement pod, the
             job's same pod through the webhook, which points its container at that image by digest
             and records the attempt's epoch (snapguard.io/epoch); PullImage, RunPodSandbox,
             CreateContainer, StartContainer; containerd restores it through snapguard-runc, which
             takes the epoch in the store.
  file       the trainer's own path: a pod (not opted in) on node A with --save-dir on a hostPath both
             nodes share; at step --at the notice: SIGUSR1 (the trainer's urgent save, as a preStop
             hook would ask), the save waited for, the pod stopped; node B's new pod cold-starts from
             the file.

Reported: notice -> image whole (recorded in the store), whether that fits a 30 s notice (GCP's;
--deadline defaults to AWS's two minutes), and notice -> first new step on node B for snapguard,
with where the seconds went (CheckpointContainer and inside it snapguard-runc's own timings from its
result record in containerd's work path, StopContainer, archive -> image, the push, node B's calls,
the restore inside StartContainer) and the image's bytes by part (the archive's members); notice ->
file saved and notice -> first new step for the file path; steps lost; loss bits at every step and
the state digests at the end against the reference. No kubelet and no API server run: the CRI calls
and the AdmissionReview are what they send for those pods; the notice is this script's moment of
deciding (a node's agent would have it from its notice source). A table, and JSON (--json).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

from snapguard.notice._cri import SnapshotTrace, snapshot_pod
from snapguard.store import newest_published, open_store
from snapguard_lab.cri import _image_blobs
from snapguard_lab.k8s_nodes import Node, TwoNodes
from snapguard_lab.testbed import compat_missing
from snapguard_lab.torch_drill import CONTAINER_ENV_PREFIXES, TRAIN, TRAINER_ENV, Trainer, compare

JOB, NAMESPACE, CONTAINER = "train-gpu", "ml", "trainer"
JOB_ANNOTATION, EPOCH_ANNOTATION = "snapguard.io/job", "snapguard.io/epoch"
pods: list[Pod] = []  # the running arm's pods
CREATED_DIRS: list[str] = []  # hostPath directories the "kubelet" made (removed at the end when empty)
GCP_NOTICE_S = 30.0  # a GCP spot VM's preemption notice; AWS's is two minutes (--deadline's default)
REPOSITORY = f"snapguard/ckpt/{JOB}"
IMAGE_REPO = "snapguard/trainer"
SHARED = "/ckpt"  # the file path's hostPath in both nodes' pods


def _layer() -> bytes:
    """The trainer image's one layer: the top-level directories, and the host's /bin, /lib, ...
    symlinks where it has them (merged /usr), so that the bound /usr serves them."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in ("usr", "etc", "out", "tmp", "proc", "sys", "dev", "run", "root", SHARED.strip("/")):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name in ("tmp", "out") else 0o755
            tf.addfile(info)
        for name in ("bin", "sbin", "lib", "lib64"):
            info = tarfile.TarInfo(name)
            if os.path.islink("/" + name):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink("/" + name)
            else:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(info)
    return buf.getvalue()


def push_trainer_image(nodes: TwoNodes) -> str:
    layer = _layer()
    config, manifest = _image_blobs(layer, ["/bin/sh"])
    digest = nodes.registry.push(IMAGE_REPO, "1", manifest, {
        "sha256:" + hashlib.sha256(b).hexdigest(): b for b in (config, layer)})
    return f"{nodes.host}/{IMAGE_REPO}@{digest}"


def pod_manifest(name: str, image: str, args: list[str], shared: Path) -> dict[str, Any]:
    """The trainer pod as its Job's controller would create it (a v1 Pod): RuntimeClass snapguard,
    the job's annotation, the host's Python and torch and the shared directory as hostPath
    volumes, one GPU (the device plugin's). No take point, no checkpoint image: the webhook's part."""
    script = " ".join(_quote(a) for a in [sys.executable, str(TRAIN), *args]) + "; exec sleep 100000"
    env = {k: v for k, v in os.environ.items() if k.startswith(CONTAINER_ENV_PREFIXES)}
    env.update(TRAINER_ENV)
    env.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "PYTHONUNBUFFERED": "1"})
    volumes, mounts = [], []
    for n, host in enumerate(_host_binds()):
        volumes.append({"name": f"host-{n}", "hostPath": {"path": host}})
        mounts.append({"name": f"host-{n}", "mountPath": host, "readOnly": True})
    volumes.append({"name": "ckpt", "hostPath": {"path": str(shared), "type": "Directory"}})
    mounts.append({"name": "ckpt", "mountPath": SHARED})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"job-name": JOB},
                         "annotations": {JOB_ANNOTATION: JOB}},
            "spec": {"runtimeClassName": "snapguard", "restartPolicy": "Never", "hostNetwork": True,
                     "containers": [{"name": CONTAINER, "image": image, "command": ["/bin/sh", "-c", script],
                                     "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
                                     "volumeMounts": mounts,
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                     "volumes": volumes}}


def admission_review(pod: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview v1 the kube-apiserver sends a mutating webhook for a pod's CREATE
    (the Job controller's request)."""
    gvk, gvr = {"group": "", "version": "v1", "kind": "Pod"}, {"group": "", "version": "v1", "resource": "pods"}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
        "name": pod["metadata"]["name"], "namespace": NAMESPACE, "operation": "CREATE",
        "userInfo": {"username": "system:serviceaccount:kube-system:job-controller",
                     "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"]},
        "object": pod, "oldObject": None, "dryRun": False,
        "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}}}


def apply_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 add / replace / remove (what the webhook answers), as the API server applies them."""
    import copy

    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if op["op"] not in ("add", "replace", "remove"):
            raise ValueError(f"JSONPatch op {op['op']!r} is not one the webhook answers")
        if isinstance(parent, list):
            if op["op"] == "add":
                parent.insert(len(parent) if last == "-" else int(last), op["value"])
            elif op["op"] == "replace":
                parent[int(last)] = op["value"]
            else:
                del parent[int(last)]
        elif op["op"] == "remove":
            del parent[last]
        else:
            if op["op"] == "replace" and last not in parent:
                raise ValueError(f"JSONPatch replace of {op['path']}: no such member")
            parent[last] = op["value"]
    return doc


class Admission:
    """snapguard's webhook as the API server reaches it: the real server (snapguard.webhook.Webhook)
    over HTTPS on loopback with a self-signed certificate (openssl), the store the agent publishes
    to as its SnapshotSource; where there is no openssl, its handler called in this process."""

    def __init__(self, work: Path, store: Any, hook_dir: str) -> None:
        from snapguard.webhook import ServerConfig, StoreSnapshots, Webhook, WebhookConfig

        self.config = WebhookConfig(hook_dir=hook_dir)
        self.source = StoreSnapshots(store)
        self.server: Any = None
        self.reviews: list[dict[str, Any]] = []
        openssl = "/usr/bin/openssl"
        if os.access(openssl, os.X_OK):
            cert, key = work / "webhook.crt", work / "webhook.key"
            import subprocess

            subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
                            "-subj", "/CN=snapguard-webhook.snapguard.svc",
                            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                           check=True, capture_output=True, timeout=30)
            self.cert = cert
            self.server = Webhook(ServerConfig(str(cert), str(key), address="127.0.0.1", port=0), self.config,
                                  self.source)
            import threading

            threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        self.how = "https" if self.server is not None else "in-process"

    def admit(self, pod: dict[str, Any]) -> dict[str, Any]:
        """The pod as the API server stores it after the webhook's answer."""
        import base64

        body = json.dumps(admission_review(pod)).encode()
        if self.server is not None:
            import http.client
            import ssl

            ctx = ssl.create_default_context(cafile=str(self.cert))
            conn = http.client.HTTPSConnection("127.0.0.1", self.server.server_address[1], context=ctx, timeout=10)
            conn.request("POST", "/mutate?timeout=10s", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            data = answer.read()
            conn.close()
            if answer.status != 200:
                raise RuntimeError(f"the webhook answered HTTP {answer.status}: {data[:300]!r}")
            review = json.loads(data)
        else:
            from snapguard.webhook.server import _Lookups, handle

            review = handle(body, self.config, _Lookups(self.source, 3.0)).review()
        response = review["response"]
        ops = json.loads(base64.b64decode(response["patch"])) if response.get("patch") else []
        self.reviews.append({"pod": pod["metadata"]["name"], "patch": ops, "warnings": response.get("warnings", [])})
        return apply_patch(pod, ops) if ops else pod

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class Pod:
    """One trainer pod on one node, from the v1 Pod the API server stored (after the webhook): the
    kubelet's calls (RunPodSandbox with the pod's annotations, the RuntimeClass's handler;
    CreateContainer with its command, env and hostPath mounts; the GPU's device files as the
    device plugin allocates them), and the trainer's log read through the container's root
    (/proc/PID/root: no exec into the container while it is snapshotted)."""

    def __init__(self, node: Node, pod: dict[str, Any]) -> None:
        self.node, self.name, self.spec = node, pod["metadata"]["name"], pod
        cri = node.cri
        pb = cri.pb
        uid = str(uuid.uuid4())
        logs = node.containerd.workdir.parent / "pods" / f"{NAMESPACE}_{self.name}_{uid}"
        logs.mkdir(parents=True)
        self.sandbox = cri.sandbox_config(self.name, NAMESPACE, uid, str(logs))
        for k, v in (pod["metadata"].get("annotations") or {}).items():
            self.sandbox.annotations[k] = v  # the kubelet hands the pod's annotations to the sandbox
        (c,) = pod["spec"]["containers"]
        self.config = cri.container_config(c["name"], c["image"], self.sandbox)
        self.config.image.user_specified_image = c["image"]  # the kubelet's: the pod spec's image
        self.config.command[:] = c["command"]
        self.config.envs.extend(pb.KeyValue(key=e["name"], value=e["value"]) for e in c.get("env") or [])
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        for m in c.get("volumeMounts") or []:
            host = volumes[m["name"]]["hostPath"]
            if host.get("type") == "DirectoryOrCreate" and not os.path.exists(host["path"]):
                os.makedirs(host["path"], mode=0o755)  # the kubelet's, for that type
                CREATED_DIRS.append(host["path"])
            self.config.mounts.append(pb.Mount(container_path=m["mountPath"], host_path=host["path"],
                                               readonly=bool(m.get("readOnly"))))
        for dev in sorted(glob.glob("/dev/nvidia*")):
            if stat.S_ISCHR(os.stat(dev).st_mode):
                self.config.devices.append(pb.Device(container_path=dev, host_path=dev, permissions="rwm"))
        self.sandbox_id = cri.run_sandbox(self.sandbox)
        self.id = ""
        self.start_record: dict[str, Any] = {}

    def start(self, watch: bool = False) -> dict[str, float]:
        """PullImage (imagePullPolicy IfNotPresent), CreateContainer, StartContainer: their seconds;
        `watch`: snapguard-runc's record of the start (a restore) kept in `self.start_record`."""
        cri = self.node.cri
        t0 = time.time()
        cri.pull(self.config.image.image)
        t1 = time.time()
        self.id = cri.create(self.sandbox_id, self.sandbox, self.config)
        t2 = time.time()
        watcher = RecordWatch(self.node, self.id) if watch else None
        try:
            cri.start(self.id)
        finally:
            self.start_record = watcher.stop() if watcher is not None else {}
        return {"pull_s": t1 - t0, "create_s": t2 - t1, "start_s": time.time() - t2}

    def pid(self) -> int:
        cri = self.node.cri
        st = cri.runtime.ContainerStatus(cri.pb.ContainerStatusRequest(container_id=self.id, verbose=True), timeout=10)
        return int(json.loads(st.info["info"])["pid"])

    def trainer_pid(self) -> int:
        sh = self.pid()
        with open(f"/proc/{sh}/task/{sh}/children") as f:
            kids = [int(x) for x in f.read().split()]
        if len(kids) != 1:
            raise RuntimeError(f"{self.name}: the pod's shell has children {kids}, not the one trainer")
        return kids[0]

    def read(self, name: str) -> str | None:
        try:
            return Path(f"/proc/{self.pid()}/root/out/{name}").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None

    def stop(self) -> None:
        try:
            self.node.cri.stop_and_remove(self.id)
        except Exception:  # a container the agent already stopped
            pass


class RecordWatch:
    """snapguard-runc's result record (snapguard-result.json) of one container's checkpoint or
    restore, caught while it exists: it is written into the work path containerd's shim gives
    runc (the bundle's work directory, or the CRI plugin's directory of the container), which go
    with the container's task. A thread looks every 50 ms in those few places until `stop()`."""

    def __init__(self, node: Node, container_id: str) -> None:
        import threading

        wd = node.containerd.workdir
        self.patterns = [f"{wd}/state/io.containerd.runtime.v2.task/*/{container_id}/work/snapguard-result.json",
                         f"{wd}/root/io.containerd.runtime.v2.task/*/{container_id}/snapguard-result.json",
                         f"{wd}/root/io.containerd.grpc.v1.cri/containers/{container_id}/*/snapguard-result.json",
                         f"{wd}/tmp/*/snapguard-result.json"]
        self.record: dict[str, Any] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _look(self) -> None:
        for pattern in self.patterns:
            for path in glob.glob(pattern):
                try:
                    record = json.loads(Path(path).read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(record, dict):
                    self.record = {**record, "path": path}

    def _run(self) -> None:
        while not self.done.wait(0.05):
            self._look()

    def stop(self) -> dict[str, Any]:
        self.done.set()
        self.thread.join()
        self._look()
        return self.record


def _quote(a: str) -> str:
    return "'" + a.replace("'", "'\\''") + "'"


def _host_binds() -> list[str]:
    """The host's Python and torch for the pod: /usr (with the image's /bin, /lib... symlinks), the
    interpreter's prefixes, the trainer's directory, the loader's cache and the user database."""
    import importlib.util
    import site

    torch = importlib.util.find_spec("torch")
    out = ["/usr"]
    out += [f"/{d}" for d in ("bin", "sbin", "lib", "lib64") if os.path.isdir(f"/{d}") and not os.path.islink(f"/{d}")]
    tops = [sys.base_prefix, sys.prefix, str(TRAIN.parent), *site.getsitepackages()]
    if torch is not None and torch.origin:
        tops.append(os.path.dirname(os.path.dirname(torch.origin)))
    for p in tops:
        if not os.path.isdir(p):
            continue
        real = os.path.realpath(p)
        if not any(real == d or real.startswith(d + "/") for d in out):
            out.append(real)
    out += _submounts(out)
    out += [f for f in ("/etc/ld.so.cache", "/etc/passwd", "/etc/group") if os.path.exists(f)]
    return out


def _submounts(binds: list[str]) -> list[str]:
    """The host's mounts below the bound directories (the GPU machine's /usr/local/nvidia under
    /usr): containerd binds a hostPath recursively, and CRIU refuses a mount of the container it
    is not told about (run16c: `mnt: FS mnt ./usr/local/nvidia ... unsupported`). Named as mounts
    of their own, runc hands each to CRIU as an external bind."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point not in binds and any(point.startswith(d.rstrip("/") + "/") for d in binds):
                found.append(point)
    return sorted(set(found), key=lambda p: (p.count("/"), p))


class PodRun:
    """Trainer-like rows() over a pod's log (torch_drill.compare reads nothing else)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def rows(self) -> list[tuple[int, str, float, int]]:
        out = []
        for line in self.text.splitlines():
            p = line.split()
            if len(p) == 5 and p[0] == "step":
                out.append((int(p[1]), p[2], float(p[3]), int(p[4])))
        return out


def _wait(what: str, check: Any, timeout: float, pod: Pod | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.01)
    seen = ""
    if pod is not None:  # what the trainer had got to, for the report
        log = (pod.read("trainer.log") or "").splitlines()
        err = (pod.read("trainer.err") or "").splitlines()
        seen = f"; its trainer.log ends {log[-2:]}, trainer.err ends {err[-3:]}"
    raise TimeoutError(f"waited {timeout:.0f} s for {what}{seen}")


def _step_at_least(pod: Pod, step: int) -> Any:
    rows = PodRun(pod.read("trainer.log") or "").rows()
    return rows if rows and rows[-1][0] >= step else None


def _first_after(pod: Pod, moment: float) -> Any:
    new = [r for r in PodRun(pod.read("trainer.log") or "").rows() if r[2] > moment]
    return new[0] if new else None


def _done(pod: Pod) -> Any:
    text = pod.read("result.json")
    return json.loads(text) if text else None


def trainer_args(a: argparse.Namespace) -> list[str]:
    return ["--steps", str(a.steps), "--device", a.device, "--width", str(a.width), "--layers", str(a.layers)]


def snapguard_arm(nodes: TwoNodes, a: argparse.Namespace, image: str, shared: Path, store: Any,
                  ref: Trainer, ref_result: dict[str, Any], adm: Admission) -> dict[str, Any]:
    args = [*trainer_args(a), "--log", "/out/trainer.log", "--result", "/out/result.json",
            "--stderr", "/out/trainer.err"]
    spec_a = adm.admit(pod_manifest("trainer-sg-0", image, args, shared))
    review_a = adm.reviews[-1]
    env_a = {e["name"]: e["value"] for e in spec_a["spec"]["containers"][0]["env"]}
    if not env_a.get("PYTHONPATH", "").startswith(adm.config.hook_dir) or "SNAPGUARD_TAKE_DIR" not in env_a:
        raise RuntimeError(f"the webhook did not inject the take point: {adm.reviews[-1]}")
    pa = Pod(nodes["a"], spec_a)
    pods.append(pa)
    pa.start()
    t = a.timeout
    _wait(f"node A's trainer at step {a.at}", lambda: _step_at_least(pa, a.at), t, pa)
    before = PodRun(pa.read("trainer.log") or "").rows()
    trace = SnapshotTrace()
    watch_a = RecordWatch(pa.node, pa.id)
    t_notice = time.time()
    try:
        published = nodes.in_node("a", lambda: snapshot_pod(
            cri_socket=pa.node.containerd.socket, container_id=pa.id, job=JOB, store=store,
            epoch=store.current_epoch(JOB), registry_url=f"http://{nodes.host}", repository=REPOSITORY,
            workdir=str(pa.node.state_dir / "cri"), deadline_s=a.deadline, trace=trace))
    finally:
        executor_a = watch_a.stop()
    t_image = time.time()
    assert newest_published(store, JOB) == published
    state_a = pa.node.cri.state(pa.id)
    # the replacement pod: the Job's same template, through the webhook, which points it at the image
    spec_b = adm.admit(pod_manifest("trainer-sg-0", image, args, shared))
    t_admitted = time.time()
    review_b = adm.reviews[-1]
    got = (spec_b["spec"]["containers"][0]["image"], spec_b["metadata"]["annotations"].get(EPOCH_ANNOTATION))
    if got != (published.reference, str(published.epoch + 1)):
        raise RuntimeError(f"the webhook did not point the replacement pod at {published.reference} under epoch "
                           f"{published.epoch + 1}: {got}; {adm.reviews[-1]}")
    b = nodes["b"]
    pb_ = Pod(b, spec_b)
    pods.append(pb_)
    t_sandbox = time.time()
    calls = pb_.start(watch=True)
    t_started = time.time()
    first = _wait("node B's first new step", lambda: _first_after(pb_, t_image), t, pb_)
    result = _wait("node B's trainer to finish", lambda: _done(pb_), t, pb_)
    status = b.cri.status(pb_.id)
    run = PodRun(pb_.read("trainer.log") or "")
    cmp = _compare(ref, run, ref_result, result)
    executor_b = pb_.start_record
    pub = trace.published
    parts = dataclasses.asdict(pub.image.parts) if pub is not None else {}
    whole = t_image - t_notice
    breakdown = {
        "cri_checkpoint_s": trace.checkpoint_s,  # CheckpointContainer: pause, snapguard-runc, the archive
        "executor_checkpoint": executor_a.get("timings", {}),  # snapguard-runc's own, inside CheckpointContainer
        "cri_stop_s": trace.stop_s,  # StopContainer, beside the publish
        "archive_scan_s": pub.timings.get("scan_s") if pub is not None else None,  # archive -> OCI image
        "push_layer_s": pub.timings.get("layer_s") if pub is not None else None,  # streamed, hashed as sent
        "push_config_manifest_s": pub.timings.get("rest_s") if pub is not None else None,
        "publish_s": trace.publish_s,
        "record_s": whole - trace.checkpoint_s - trace.publish_s,  # the stop's join + the store's record
        "webhook_admit_s": t_admitted - t_image,
        "node_b_sandbox_s": t_sandbox - t_admitted,
        "node_b_pull_s": calls["pull_s"], "node_b_create_s": calls["create_s"],
        "node_b_start_s": calls["start_s"],  # StartContainer: containerd's restore through snapguard-runc
        "executor_restore": executor_b.get("timings", {}),  # snapguard-runc's own, inside StartContainer
        "start_call_to_first_new_step_s": first[2] - (t_started - calls["start_s"]),
    }
    return {"arm": "snapguard-oci-image", "notice_at_step": before[-1][0], "reference": published.reference,
            "digest": published.digest, "epoch": published.epoch, "image_bytes": published.size,
            "image_parts": parts, "webhook": adm.how, "webhook_patch_node_a": review_a["patch"],
            "webhook_patch_node_b": review_b["patch"],
            "node_a_after": state_a, "restored_annotation": status.annotations.get("restored"),
            "notice_to_image_whole_s": whole, "fits_gcp_30s": whole <= GCP_NOTICE_S,
            "deadline_s": a.deadline, "notice_to_first_new_step_s": first[2] - t_notice,
            "image_to_first_new_step_s": first[2] - t_image, "node_b_create_start_s": t_started - t_image,
            "breakdown": breakdown, "executor_take_point": executor_a.get("take_point"),
            "executor_records": [executor_a.get("path"), executor_b.get("path")],
            "first_new_step": first[0], "steps_lost": before[-1][0] + 1 - first[0] if first[0] <= before[-1][0]
            else 0, **cmp}


def _not_opted_in(pod: dict[str, Any]) -> dict[str, Any]:
    """The same pod without snapguard's annotation: the trainer's own path, no take point."""
    del pod["metadata"]["annotations"][JOB_ANNOTATION]
    return pod


def file_arm(nodes: TwoNodes, a: argparse.Namespace, image: str, shared: Path,
             ref: Trainer, ref_result: dict[str, Any], adm: Admission) -> dict[str, Any]:
    ckdir = f"{SHARED}/file-arm"
    args = [*trainer_args(a), "--log", "/out/trainer.log", "--result", "/out/result.json",
            "--stderr", "/out/trainer.err", "--save-dir", ckdir]
    pa = Pod(nodes["a"], adm.admit(_not_opted_in(pod_manifest("trainer-file-0", image, args, shared))))
    pods.append(pa)
    pa.start()
    t = a.timeout
    _wait(f"node A's trainer at step {a.at}", lambda: _step_at_least(pa, a.at), t)
    t_notice = time.time()
    os.kill(pa.trainer_pid(), signal.SIGUSR1)  # the trainer's urgent save after the step it is in

    def saved() -> Any:
        lines = [ln.split() for ln in (pa.read("trainer.log") or "").splitlines() if ln.startswith("saved ")]
        return lines[0] if lines else None

    line = _wait("node A's urgent save", saved, t)
    t_saved = time.time()
    saved_step = int(line[1])
    last_a = PodRun(pa.read("trainer.log") or "").rows()[-1][0]
    pa.stop()
    path = f"{ckdir}/ckpt-{saved_step:09d}.pt"
    pb_ = Pod(nodes["b"], adm.admit(_not_opted_in(pod_manifest("trainer-file-0", image,
                                                               [*args[:-2], "--resume", path], shared))))
    pods.append(pb_)
    pb_.start()
    first = _wait("node B's first new step", lambda: _first_after(pb_, t_saved), t)
    result = _wait("node B's trainer to finish", lambda: _done(pb_), t)
    run = PodRun(pb_.read("trainer.log") or "")
    cmp = _compare(ref, run, ref_result, result)
    cmp["missing_steps"] = []  # the steps up to the save are node A's
    cmp["bit_identical"] = not cmp["loss_mismatches"] and cmp["digests_equal"]
    pb_.stop()
    return {"arm": "file-checkpoint", "notice_at_step": a.at, "saved_step": saved_step,
            "image_bytes": (shared / "file-arm" / os.path.basename(path)).stat().st_size,
            "save_stall_s": float(line[2]), "notice_to_file_saved_s": t_saved - t_notice,
            "notice_to_first_new_step_s": first[2] - t_notice, "first_new_step": first[0],
            "steps_lost": max(last_a - saved_step, 0), **cmp}


def _compare(ref: Trainer, run: PodRun, ref_result: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    if not ref_result:
        return {"loss_mismatches": [], "digests_equal": False, "bit_identical": False, "compared": "no reference"}
    return compare(ref, run, ref_result, result)


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'arm':<22}{'image MB':>10}{'notice->whole s':>17}{'fits 30 s':>11}{'notice->1st new step s':>24}"
            f"{'lost':>6}  bit-identical")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['arm']:<22}  FAILED: {r['error'][:200]}")
            continue
        whole = r.get("notice_to_image_whole_s", r.get("notice_to_file_saved_s", float("nan")))
        lines.append(f"{r['arm']:<22}{r['image_bytes'] / 1e6:>10.1f}{whole:>17.2f}{str(whole <= GCP_NOTICE_S):>11}"
                     f"{r['notice_to_first_new_step_s']:>24.2f}{r['steps_lost']:>6}  {r['bit_identical']}")
    for r in rows:
        if "breakdown" in r:
            lines.append("")
            lines.append(f"{r['arm']}: where the seconds went (s)")
            for k, v in r["breakdown"].items():
                if isinstance(v, dict):
                    lines.append(f"  {k:<32}" + " ".join(f"{n}={x:.2f}" for n, x in v.items() if n.endswith("_s")))
                elif v is not None:
                    lines.append(f"  {k:<32}{v:8.2f}")
            lines.append("  image MB by part                " + " ".join(
                f"{k}={v / 1e6:.1f}" for k, v in r.get("image_parts", {}).items() if k != "files"))
    return "\n".join(lines)


def _start_nodes(work: Path) -> TwoNodes:
    """TwoNodes started; a second try where the first does not come up (a registry relay's start
    in a node is seen to fail now and then in a process that already holds gRPC channels)."""
    for attempt in range(2):
        nodes = TwoNodes(str(work / f"lab{attempt}"), str(work / "config.toml"))
        try:
            return nodes.start()
        except RuntimeError as e:
            nodes.stop()
            if attempt:
                raise
            print(f"k8s_loop: the nodes did not start ({e}); once more", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", required=True, help="a fresh directory for the nodes, the registry and the store")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--at", type=int, default=50, help="the notice comes after this step")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=120, help="the agent's deadline for snapshot + push, s (default 120: AWS's two-minute "
                    "notice; the table says whether the snapshot would have fit GCP's 30 s)")
    ap.add_argument("--timeout", type=float, default=300, help="the longest wait for any one step of a pod (s)")
    ap.add_argument("--arms", default="snapguard,file", help="comma-separated: snapguard, file")
    ap.add_argument("--no-reference", action="store_true",
                    help="diagnostics: no uninterrupted run, so no bit comparison (bit_identical stays false)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    why = compat_missing()
    if why:
        print(f"k8s_loop: the compat stack is missing: {why}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("k8s_loop: must run as root (containerd, CRIU)", file=sys.stderr)
        return 2
    work = Path(a.workdir)
    work.mkdir(mode=0o700, parents=True)
    (work / "config.toml").write_text("")
    shared = work / "shared"
    shared.mkdir(mode=0o700)
    out: dict[str, Any] = {"device": a.device, "steps": a.steps, "at": a.at, "width": a.width, "layers": a.layers,
                           "agent_step": "snapguard.notice._cri.snapshot_pod", "rows": []}
    ref = Trainer(work, "reference", a.steps, extra=trainer_args(a)[2:])
    t0 = time.time()
    ref_result: dict[str, Any] = {}
    if not a.no_reference:
        ref.start()
        ref_result = ref.wait_done(timeout=a.timeout * 3)
    out["reference_s"] = time.time() - t0
    # the take point's directory as each node keeps it (the chart's DaemonSet writes it the same way)
    hook_dir = work / "takepoint"
    subprocess.run([sys.executable, "-m", "snapguard.cli", "webhook", "--lay-out-hook", str(hook_dir)],
                   check=True, capture_output=True, timeout=60)
    nodes = _start_nodes(work)
    adm = None
    try:
        image = push_trainer_image(nodes)
        out["trainer_image"] = image
        store = open_store(nodes.store_url)  # the agent's, the webhook's and node B's snapguard-runc's
        adm = Admission(work, store, str(hook_dir))
        out["webhook"] = adm.how
        arms = a.arms.split(",")
        for arm in arms:
            pods.clear()
            try:
                if arm == "snapguard":
                    row = snapguard_arm(nodes, a, image, shared, store, ref, ref_result, adm)
                elif arm == "file":
                    row = file_arm(nodes, a, image, shared, ref, ref_result, adm)
                else:
                    raise ValueError(f"no arm {arm!r}")
            except Exception as e:  # reported; the next arm runs
                row = {"arm": arm, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:1500]}"}
            finally:
                for pod in pods:  # an arm's pods end with it, so that the next has the machine
                    pod.stop()
            out["rows"].append(row)
            print(json.dumps(row, default=str), flush=True)
    finally:
        if adm is not None:
            out["webhook_reviews"] = adm.reviews
            adm.close()
        nodes.stop()
        for d in reversed(CREATED_DIRS):
            try:
                os.rmdir(d)
            except OSError:
                pass
    table = _table(out["rows"])
    print(table)
    out["table"] = table
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0 if all(r.get("bit_identical") for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
