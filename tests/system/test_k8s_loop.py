"""The kubelet's path end to end, through an OCI checkpoint image: two containerd 2.1.9 "nodes" on
this machine (snapguard_lab.k8s_nodes: own roots, state, sockets, runc roots, snapguard state
directories and network namespaces; the agent's push runs in node A's; the runtime handler `snapguard` is snapguard-runc on both), a real registry (Debian's
docker-registry on loopback) and a file:// store.

Node A: a counter pod opted in (RuntimeClass `snapguard`: the sandbox's runtime handler; the
annotation snapguard.io/job). `snapguard agent --once --cri-socket --registry --store` in node A's
network namespace, with a notice in its inbox (`snapguard notice --queue --lead`): it finds the pod
itself through CRI (ListPodSandbox, ListContainers), schedules it as kind `pod`, and its step,
snapguard.notice._cri.snapshot_pod, runs within the notice's lead: CRI CheckpointContainer
(snapguard-runc checkpoints and seals), StopContainer, the archive made an OCI checkpoint image,
pushed, digest-checked, recorded in the job's store entry with its epoch. Nobody calls
snapshot_pod by hand.

Node B: what the kubelet does for the replacement pod whose container's image is that reference
by digest: PullImage, RunPodSandbox, CreateContainer, StartContainer. containerd sees the
checkpoint annotation and restores through snapguard-runc (verification of the seal, CRIU); the
counter goes on from its last archived line. The pod carries the webhook's snapguard.io/epoch
(the image's + 1), which reaches the container's spec through the runtime's pod_annotations:
snapguard-runc takes it in the store (SNAPGUARD_STORE of node B's containerd) right before runc's
restore, and a second replacement pod under the same epoch is refused ALREADY_RESTORED, nothing
started; a replacement whose restore fails in runc's restore after it took the epoch rolls the
epoch back, so that a retry takes one. A checkpoint snapguard-runc refuses or fails reaches the
agent's journal as its typed reason. No kubelet runs: snapguard_lab.cri makes its calls.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from snapguard import ocicheckpoint
from snapguard.notice._cri import checkpoint_request, snapshot_pod, stop_request
from snapguard.notice._cripods import decode, list_containers_request, list_sandboxes_request
from snapguard.reasons import Reason, SnapguardError
from snapguard.store import PublishedImage, newest_published, open_store, record_published
from snapguard_lab.cri import CounterRows, api, counter_rows, tampered_archive, wait_rows
from snapguard_lab.k8s_nodes import Node, TwoNodes
from snapguard_lab.targets import criu_wrapper
from snapguard_lab.testbed import compat_missing

pytestmark = pytest.mark.stack

JOB, NAMESPACE, NAME = "train-counter", "ml", "trainer"
REPO = f"snapguard/ckpt/{JOB}"
EXE = os.path.join(os.path.dirname(sys.executable), "snapguard")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    why = compat_missing()
    if why:
        pytest.skip(f"the compat stack is not installed: {why}")
    if os.geteuid() != 0:
        pytest.fail("the Kubernetes loop test needs root (CI and the README's test command run as root)")
    work = tmp_path_factory.mktemp("k8s-loop")
    os.chmod(work, 0o700)
    config = work / "snapguard-config.toml"
    config.write_text("")
    lab = TwoNodes(str(work / "lab"), str(config))
    try:
        lab.start()
        yield lab
    finally:
        lab.stop()


@dataclass
class Pod:
    id: str
    config: Any


def _run_pod(node: Node, name: str, job: str | None = JOB, epoch: int | None = None) -> Pod:
    """RunPodSandbox as the kubelet sends it for a pod of RuntimeClass `snapguard` (its handler);
    `epoch`: the snapguard.io/epoch the webhook recorded on the replacement pod."""
    uid = str(uuid.uuid4())
    logs = node.containerd.workdir.parent / "pods" / f"{NAMESPACE}_{name}_{uid}"
    logs.mkdir(parents=True)
    config = node.cri.sandbox_config(name, NAMESPACE, uid, str(logs))
    if job is not None:
        config.annotations["snapguard.io/job"] = job
    if epoch is not None:
        config.annotations["snapguard.io/epoch"] = str(epoch)
    return Pod(node.cri.run_sandbox(config), config)


def _in_node(nodes: TwoNodes, name: str) -> list[str]:
    """The prefix that runs a command in node `name`'s network namespace: nsenter, not a
    preexec_fn (a fork that runs Python in a process with gRPC channels open can abort)."""
    return ["/usr/bin/nsenter", f"--net=/var/run/netns/{nodes.net.ns(name)}", "--"]


def _rows(node: Node, cid: str) -> CounterRows:
    return wait_rows(node.cri, cid, 0)


def _wait_rows(node: Node, cid: str, count: int, timeout: float = 20.0) -> CounterRows:
    return wait_rows(node.cri, cid, count, timeout)


def _registry_get(nodes: TwoNodes, path: str, accept: str = "") -> tuple[bytes, Any]:
    req = urllib.request.Request(f"http://{nodes.registry.host}{path}",
                                 headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read(), r.headers


@dataclass
class Published:
    image: PublishedImage
    seconds: float
    container_id: str
    state_after: str  # node A's container after the agent's step
    manifest: bytes
    layer: bytes  # the archive, as the registry serves it
    archived: CounterRows  # /out/counter.log as the layer's rootfs-diff.tar holds it
    store: Any
    journal: list[dict[str, Any]]  # the agent's
    agent_dir: Path
    bystander: str  # a running container of a pod not opted in, on node A

@pytest.fixture(scope="module")
def published(nodes: TwoNodes, tmp_path_factory: pytest.TempPathFactory) -> Published:
    a = nodes["a"]
    a.cri.pull(nodes.counter_image)
    other = _run_pod(a, "bystander-0", job=None)  # not opted in: the agent leaves it alone
    bystander = a.cri.create(other.id, other.config, a.cri.container_config("web", nodes.counter_image, other.config))
    a.cri.start(bystander)
    pod = _run_pod(a, "trainer-0")
    cid = a.cri.create(pod.id, pod.config, a.cri.container_config(NAME, nodes.counter_image, pod.config))
    a.cri.start(cid)
    _wait_rows(a, cid, 20)
    store = open_store(nodes.store_url)  # SNAPGUARD_STORE of both nodes' snapguard-runc
    agent_state = a.state_dir.parent / "agent-state"
    agent_state.mkdir(mode=0o700)
    env = {**os.environ, "SNAPGUARD_CONFIG": nodes.config_file, "SNAPGUARD_STATE_DIR": str(agent_state)}
    posted = subprocess.run([EXE, "notice", "--queue", "--lead", "60", "--reason", "spot"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert posted.returncode == 0, posted.stderr
    t0 = time.monotonic()
    agent = subprocess.run([*_in_node(nodes, "a"), EXE, "agent", "--once", "--host-checks-every", "0",
                            "--cri-socket", a.containerd.socket, "--registry", f"http://{nodes.host}", "--store",
                            nodes.store_url], env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    assert agent.returncode == 0, agent.stderr
    journal = [json.loads(x) for x in (agent_state / "agent" / "journal.jsonl").read_text().splitlines()]
    image = newest_published(store, JOB)
    assert image is not None, agent.stderr
    manifest, _ = _registry_get(nodes, f"/v2/{REPO}/manifests/{image.digest}", ocicheckpoint._image.MT_MANIFEST)
    layer, _ = _registry_get(nodes, f"/v2/{REPO}/blobs/{json.loads(manifest)['layers'][0]['digest']}")
    with tarfile.open(fileobj=io.BytesIO(layer)) as tf:
        diff = tf.extractfile("rootfs-diff.tar").read()  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(diff)) as tf:
        archived = counter_rows(tf.extractfile("out/counter.log").read().decode())  # type: ignore[union-attr]
    return Published(image, seconds, cid, a.cri.state(cid), manifest, layer, archived, store, journal,
                     agent_state / "agent", bystander)


@dataclass
class Restored:
    pod: Pod
    container_id: str
    status: Any
    rows: CounterRows
    seconds: float


@pytest.fixture(scope="module")
def restored(nodes: TwoNodes, published: Published) -> Restored:
    """Node B, the replacement pod: the kubelet's calls from its spec (image: the reference by
    digest; the annotation snapguard.io/epoch the webhook recorded, the image's epoch + 1)."""
    b = nodes["b"]
    t0 = time.monotonic()
    b.cri.pull(published.image.reference)
    pod = _run_pod(b, "trainer-0", epoch=published.image.epoch + 1)
    config = b.cri.container_config(NAME, published.image.reference, pod.config)
    config.image.user_specified_image = published.image.reference  # the kubelet's: the pod spec's image
    rid = b.cri.create(pod.id, pod.config, config)
    b.cri.start(rid)
    seconds = time.monotonic() - t0
    rows = _wait_rows(b, rid, len(published.archived.rows) + 10)
    return Restored(pod, rid, b.cri.status(rid), rows, seconds)


def test_snapshot_is_an_oci_checkpoint_image_recorded_with_digest_and_epoch(
        nodes: TwoNodes, published: Published) -> None:
    p = published
    assert p.image.reference == f"{nodes.host}/{REPO}@{p.image.digest}"
    assert p.image.digest == "sha256:" + hashlib.sha256(p.manifest).hexdigest()
    assert p.image.epoch == 0 and p.image.job == JOB
    assert (p.image.container, p.image.pod, p.image.namespace) == (NAME, "trainer-0", NAMESPACE)
    assert newest_published(p.store, JOB) == p.image

    manifest = json.loads(p.manifest)
    ann = manifest["annotations"]
    assert ann[ocicheckpoint.ANNOTATION_CONTAINER] == NAME
    assert ann["org.criu.checkpoint.pod.name"] == "trainer-0" and ann["org.criu.checkpoint.pod.namespace"] == NAMESPACE
    assert ann["org.criu.checkpoint.rootfsImageRef"] == f"{nodes.host}/snapguard/counter@{nodes.counter_digest}"
    assert ann["io.snapguard.job"] == JOB and ann["io.snapguard.epoch"] == "0"
    (layer_desc,) = manifest["layers"]
    assert layer_desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    assert layer_desc["digest"] == "sha256:" + hashlib.sha256(p.layer).hexdigest()
    config, _ = _registry_get(nodes, f"/v2/{REPO}/blobs/{manifest['config']['digest']}")
    assert json.loads(config)["rootfs"]["diff_ids"] == [layer_desc["digest"]]
    with tarfile.open(fileobj=io.BytesIO(p.layer)) as tf:
        names = {m.name.rstrip("/") for m in tf.getmembers()}
        seal = tf.extractfile("checkpoint/snapguard-manifest.json").read()  # type: ignore[union-attr]
    assert {"config.dump", "spec.dump", "rootfs-diff.tar", "checkpoint/snapguard-complete.json"} <= names
    assert ann["io.snapguard.seal.sha256"] == hashlib.sha256(seal).hexdigest()
    # a stopping snapshot: node A's container does not go on past what was dumped
    assert p.state_after == "CONTAINER_EXITED"
    assert p.archived.rows and p.archived.chain_errors() == []
    # the agent's working archive is gone; nothing else left in its directory
    assert os.listdir(p.agent_dir / "cri") == []
    assert p.seconds < 30, p.seconds


def test_agent_finds_the_opted_in_pod_through_cri_and_publishes_within_the_lead(
        nodes: TwoNodes, published: Published) -> None:
    """The agent alone: the pod found through CRI (the pod not opted in left running), scheduled as
    kind `pod` within the notice's 60 s lead, published and journalled."""
    events = {e["event"]: e for e in published.journal}
    key = f"pod:{published.container_id}"
    assert events["protected"]["key"] == key and events["protected"]["source"] == "cri"
    (planned,) = events["schedule"]["order"]
    assert (planned["key"], planned["kind"], planned["job"]) == (key, "pod", JOB)
    assert planned["deadline"] == events["noticed"]["deadline"] and 0 < events["noticed"]["lead_s"] <= 60
    assert events["published"]["digest"] == published.image.digest and events["published"]["epoch"] == 0
    assert events["schedule_done"]["fit"] == [key] and events["schedule_done"]["fell_back"] == {}
    assert nodes["a"].cri.state(published.bystander) == "CONTAINER_RUNNING"
    # the two list requests are the bytes the CRI stubs make, and their answers decode the same
    pb, _ = api()
    assert list_sandboxes_request() == pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(
        state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY))).SerializeToString()
    assert list_containers_request() == pb.ListContainersRequest(filter=pb.ContainerFilter(
        state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING))).SerializeToString()
    sandbox = pb.PodSandbox(id="x", runtime_handler="snapguard", annotations={"snapguard.io/job": JOB},
                            metadata=pb.PodSandboxMetadata(name="p", namespace="ns"))
    fields = decode(pb.ListPodSandboxResponse(items=[sandbox]).SerializeToString())
    assert decode(fields[1][0])[7] == [b"snapguard"]


def test_replacement_pod_on_node_b_restores_from_the_image_and_continues_exactly(
        nodes: TwoNodes, published: Published, restored: Restored) -> None:
    b = nodes["b"]
    # two nodes: each containerd (and so its host-network pods) in a network namespace of its own
    nets = {os.readlink(f"/proc/{n.containerd.proc.pid}/ns/net") for n in (nodes["a"], b)  # type: ignore[union-attr]
            } | {os.readlink("/proc/self/ns/net")}
    assert len(nets) == 3, nets
    assert b.cri.pb.ContainerState.Name(restored.status.state) == "CONTAINER_RUNNING"
    assert restored.status.annotations["restored"] == "true"
    assert restored.status.annotations["checkpointImage"] == published.image.reference
    archived, rows = published.archived.rows, restored.rows.rows
    assert rows[:len(archived)] == archived
    assert rows[len(archived)][0] == published.archived.last() + 1, rows[len(archived) - 2:len(archived) + 3]
    assert restored.rows.chain_errors() == []
    # node B's snapguard-runc drove it: CRIU ran with the config of node B's private run directory
    log = (b.containerd.root / "io.containerd.runtime.v2.task" / "k8s.io" / restored.container_id / "restore.log")
    assert f"Parsing config file {b.state_dir}/run-" in log.read_text(errors="replace")[:4096]
    assert restored.seconds < 30, restored.seconds
    # the restore took the webhook's epoch in the store, the last step before runc's restore
    assert published.store.current_epoch(JOB) == published.image.epoch + 1


def test_second_replacement_under_the_older_epoch_is_refused_and_nothing_starts(
        nodes: TwoNodes, published: Published, restored: Restored) -> None:
    """A second replacement pod of the same job, admitted under the same (now older) epoch:
    StartContainer fails with snapguard's ALREADY_RESTORED, nothing runs, the job's epoch stays."""
    b = nodes["b"]
    pod = _run_pod(b, "trainer-0-twin", epoch=published.image.epoch + 1)
    config = b.cri.container_config(NAME, published.image.reference, pod.config)
    rid = b.cri.create(pod.id, pod.config, config)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            b.cri.start(rid)
        message = refused.value.details()
        assert "snapguard ALREADY_RESTORED: " in message and "\n" not in message, message
        assert b.cri.state(rid) != "CONTAINER_RUNNING"
        assert published.store.current_epoch(JOB) == published.image.epoch + 1
        assert b.cri.state(restored.container_id) == "CONTAINER_RUNNING"
    finally:
        b.cri.stop_and_remove(rid)


def test_tampered_layer_is_refused_at_start_as_one_typed_line(
        nodes: TwoNodes, published: Published, restored: Restored, tmp_path: Path) -> None:
    """An image rebuilt with one flipped bit in a page file (its digests all consistent, as an
    attacker with push rights would make it): StartContainer on node B fails with snapguard's
    IMAGE_CORRUPT, CRIU never having run, nothing running."""
    b = nodes["b"]
    bad = tmp_path / "tampered.tar"
    pages = tampered_archive(published.layer, bad)
    image = ocicheckpoint.build_image(str(bad), job=JOB, epoch=0)
    pushed = nodes.in_node("a", lambda: ocicheckpoint.push_image(image, f"http://{nodes.host}", REPO, "tampered",
                                                                 deadline_s=30))
    b.cri.pull(pushed.reference)
    pod = _run_pod(b, "trainer-tampered")
    rid = b.cri.create(pod.id, pod.config, b.cri.container_config("tampered", pushed.reference, pod.config))
    message = b.cri.start_refused(rid)
    assert f"snapguard IMAGE_CORRUPT: image file {pages.split('/', 1)[1]} has sha256 " in message, message


def test_a_restore_that_fails_after_taking_the_epoch_rolls_it_back_and_a_retry_takes_it(
        nodes: TwoNodes, published: Published, tmp_path: Path) -> None:
    """A replacement pod (snapguard.io/epoch 1) whose restore through containerd fails in runc's
    restore, after snapguard-runc took the job's epoch (a stand-in CRIU that exits at once): the
    epoch is rolled back (the job's current epoch is the image's again), so the job is not fenced
    by an attempt that never ran, and a second pod under the same epoch restores and takes one."""
    b, job = nodes["b"], "rollback-job"
    archive = tmp_path / "a.tar"
    archive.write_bytes(published.layer)
    image = ocicheckpoint.build_image(str(archive), job=job, epoch=0)
    pushed = nodes.in_node("a", lambda: ocicheckpoint.push_image(image, f"http://{nodes.host}", REPO, "rollback",
                                                                 deadline_s=30))
    b.cri.pull(pushed.reference)
    store = published.store
    Path(nodes.config_file).write_text(f'criu = "{criu_wrapper(tmp_path / "criu-fails", "fail")}"\n')
    started: list[str] = []
    try:
        pod = _run_pod(b, "rollback-0", job=job, epoch=1)
        rid = b.cri.create(pod.id, pod.config, b.cri.container_config("rollback", pushed.reference, pod.config))
        started.append(rid)
        with pytest.raises(grpc.RpcError) as failed:
            b.cri.start(rid)
        assert "snapguard CRIU_RESTORE_FAILED: " in failed.value.details(), failed.value.details()
        assert b.cri.state(rid) != "CONTAINER_RUNNING"
        assert store.current_epoch(job) == 0  # taken (1), then rolled back
        Path(nodes.config_file).write_text("")
        pod = _run_pod(b, "rollback-1", job=job, epoch=1)
        rid = b.cri.create(pod.id, pod.config, b.cri.container_config("rollback", pushed.reference, pod.config))
        started.append(rid)
        b.cri.start(rid)
        assert b.cri.state(rid) == "CONTAINER_RUNNING"
        assert _wait_rows(b, rid, len(published.archived.rows) + 3).chain_errors() == []
        assert store.current_epoch(job) == 2  # the retry's, past the aborted attempt's number
    finally:
        Path(nodes.config_file).write_text("")
        for rid in started:
            b.cri.stop_and_remove(rid)


class _Liar(http.server.BaseHTTPRequestHandler):
    """A registry peer that accepts every upload and answers a digest other than the bytes'."""

    def log_message(self, *_: Any) -> None:
        pass

    def _answer(self, status: int, headers: dict[str, str]) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        while length > 0:
            length -= len(self.rfile.read(min(length, 1 << 20)))
        self.send_response(status)
        for k, v in {"Content-Length": "0", **headers}.items():
            self.send_header(k, v)
        self.end_headers()

    def do_HEAD(self) -> None:
        self._answer(404, {})

    def do_POST(self) -> None:
        self._answer(202, {"Location": "/v2/upload/1"})

    def do_PUT(self) -> None:
        self._answer(201, {"Docker-Content-Digest": "sha256:" + "0" * 64})


def test_wrong_digest_and_stalled_registry_are_refused_typed_and_nothing_recorded(
        published: Published, tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    archive.write_bytes(published.layer)
    image = ocicheckpoint.build_image(str(archive), job=JOB, epoch=0)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Liar)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SnapguardError) as lied:
            ocicheckpoint.push_image(image, f"http://127.0.0.1:{server.server_address[1]}", REPO, "x", deadline_s=10)
        assert lied.value.reason is Reason.REGISTRY_DIGEST_MISMATCH, lied.value
    finally:
        server.shutdown()
        server.server_close()
    # a peer that takes the connection and never answers: the whole push ends at its deadline
    with socket.socket() as stall:
        stall.bind(("127.0.0.1", 0))
        stall.listen(4)
        t0 = time.monotonic()
        with pytest.raises(SnapguardError) as slow:
            ocicheckpoint.push_image(image, f"http://127.0.0.1:{stall.getsockname()[1]}", REPO, "x", deadline_s=1.5)
        assert slow.value.reason is Reason.REGISTRY_TOO_SLOW, slow.value
        assert time.monotonic() - t0 < 4
    assert newest_published(published.store, JOB) == published.image


def test_late_record_from_the_old_node_is_fenced(published: Published, restored: Restored) -> None:
    """Once node B's restore took the job's next epoch, node A's record under the old one is refused."""
    store = published.store
    taken = store.current_epoch(JOB)
    late = PublishedImage(JOB, published.image.epoch, published.image.reference.replace(
        published.image.digest, "sha256:" + "1" * 64), "sha256:" + "1" * 64)
    with pytest.raises(SnapguardError) as fenced:
        record_published(store, late)
    assert fenced.value.reason is Reason.FENCED and taken == published.image.epoch + 1
    assert newest_published(store, JOB) == published.image


def test_cri_requests_are_the_bytes_the_cri_stubs_make(tmp_path: Path) -> None:
    pb, _ = api()
    for cid, location, timeout in [("abc123", "/var/lib/x.tar", 60), ("f" * 64, "", 0), ("é", "/ü", 1 << 40)]:
        want = pb.CheckpointContainerRequest(container_id=cid, location=location, timeout=timeout)
        assert checkpoint_request(cid, location, timeout) == want.SerializeToString()
        assert stop_request(cid, timeout) == pb.StopContainerRequest(container_id=cid, timeout=timeout).SerializeToString()


def test_archive_that_is_not_a_cri_checkpoint_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "link.tar"
    with tarfile.open(link, "w") as tf:
        info = tarfile.TarInfo("checkpoint/evil")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/shadow"
        tf.addfile(info)
    missing = tmp_path / "missing.tar"
    with tarfile.open(missing, "w") as tf:
        data = b"{}"
        info = tarfile.TarInfo("config.dump")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    for path, says in [(link, "not a regular file or a directory"), (missing, "missing"),
                       (tmp_path / "nope.tar", "not a readable tar archive")]:
        with pytest.raises(SnapguardError) as refused:
            ocicheckpoint.build_image(str(path), job=JOB, epoch=0)
        assert refused.value.reason is Reason.CHECKPOINT_ARCHIVE_INVALID and says in str(refused.value), refused.value


def test_refused_checkpoint_reaches_the_agent_typed_and_records_nothing(
        nodes: TwoNodes, published: Published, tmp_path: Path) -> None:
    """snapguard-runc's refusal (here no criu at the configured path) is the agent's typed reason,
    not containerd's wrapping; no archive, no image, no record, the container runs on. So is its
    failure once runc ran CRIU (CRIU_DUMP_FAILED), through the agent itself."""
    a = nodes["a"]
    pod = _run_pod(a, "trainer-1")
    cid = a.cri.create(pod.id, pod.config, a.cri.container_config("refused", nodes.counter_image, pod.config))
    a.cri.start(cid)
    missing = tmp_path / "no-such-criu"
    Path(nodes.config_file).write_text(f'criu = "{missing}"\n')
    try:
        _wait_rows(a, cid, 3)
        # a node whose epoch is stale freezes nothing: FENCED first
        store = published.store
        newer = store.take_epoch("fenced-job")
        with pytest.raises(SnapguardError) as fenced:
            snapshot_pod(cri_socket=a.containerd.socket, container_id=cid, job="fenced-job", store=store,
                         epoch=newer - 1, registry_url=f"http://{nodes.host}", repository="snapguard/ckpt/x",
                         workdir=str(a.state_dir / "cri"), deadline_s=30)
        assert fenced.value.reason is Reason.FENCED, fenced.value
        before = _rows(a, cid)
        assert _wait_rows(a, cid, len(before.rows) + 2).chain_errors() == []
        with pytest.raises(SnapguardError) as refused:
            nodes.in_node("a", lambda: snapshot_pod(
                cri_socket=a.containerd.socket, container_id=cid, job="refused-job", store=published.store,
                epoch=0, registry_url=f"http://{nodes.host}", repository="snapguard/ckpt/refused-job",
                workdir=str(a.state_dir / "cri"), deadline_s=30))
        assert refused.value.reason is Reason.CRIU_MISSING, refused.value
        assert str(missing) in str(refused.value) and "\n" not in str(refused.value)
        assert newest_published(published.store, "refused-job") is None
        assert os.listdir(a.state_dir / "cri") == []
        assert a.cri.state(cid) == "CONTAINER_RUNNING"
        # a failure after runc ran CRIU (a stand-in that exits at once): containerd keeps the first
        # line of the runtime's output, runc's; the agent's record names snapguard-runc's reason
        Path(nodes.config_file).write_text(f'criu = "{criu_wrapper(tmp_path / "criu-fails", "fail")}"\n')
        agent_state = tmp_path / "agent-state"
        agent_state.mkdir(mode=0o700)
        env = {**os.environ, "SNAPGUARD_CONFIG": nodes.config_file, "SNAPGUARD_STATE_DIR": str(agent_state)}
        subprocess.run([EXE, "notice", "--queue", "--lead", "60", "--reason", "spot"], env=env, check=True,
                       capture_output=True, timeout=60)
        agent = subprocess.run([*_in_node(nodes, "a"), EXE, "agent", "--once", "--host-checks-every", "0",
                                "--cri-socket", a.containerd.socket, "--registry", f"http://{nodes.host}", "--store",
                                nodes.store_url], env=env, capture_output=True, text=True, timeout=120)
        assert agent.returncode == 0, agent.stderr
        journal = [json.loads(x) for x in (agent_state / "agent" / "journal.jsonl").read_text().splitlines()]
        (failed,) = [e for e in journal if e["event"] == "snapshot_failed"]
        (fell,) = [e for e in journal if e["event"] == "fell_back"]
        assert failed["key"] == fell["key"] == f"pod:{cid}", journal
        assert failed["record"]["reason"] == fell["reason"] == "CRIU_DUMP_FAILED", failed
        assert failed["record"]["evidence"]["executor_said_in"].endswith(f"/{cid}/log.json"), failed
        assert "did not terminate successfully" in failed["record"]["evidence"]["cri"], failed
        metrics = (agent_state / "agent" / "snapguard-agent.prom").read_text()
        assert f'snapguard_agent_last_notice_fell_back{{job="{JOB}",reason="CRIU_DUMP_FAILED"}} 1.0' in metrics, metrics
        assert a.cri.state(cid) == "CONTAINER_RUNNING"
    finally:
        Path(nodes.config_file).write_text("")
        a.cri.stop_and_remove(cid)


def test_missing_cri_extra_and_unreachable_socket_are_typed(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['grpc'] = None\n"
            "from snapguard.notice._cri import CriClient\n"
            "from snapguard.reasons import SnapguardError\n"
            "try:\n    CriClient('/nonexistent.sock')\nexcept SnapguardError as e:\n    print(e.reason.name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "CRI_CLIENT_MISSING", out.stdout + out.stderr
    from snapguard.notice._cri import CriClient

    client = CriClient(str(tmp_path / "no.sock"))
    t0 = time.monotonic()
    try:
        with pytest.raises(SnapguardError) as gone:
            client.checkpoint("abc", str(tmp_path / "x.tar"), deadline_s=2)
    finally:
        client.close()
    assert gone.value.reason is Reason.CRI_UNAVAILABLE and time.monotonic() - t0 < 5, gone.value
