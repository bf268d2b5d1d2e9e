"""The kubelet's path (issue 11, item 4): CRI CheckpointContainer, and a restore from its archive, on
containerd 2.1.9 with a runtime handler `snapguard` whose BinaryName is snapguard-runc (runc 1.3.6
behind it), through the real CRI gRPC API (grpcio, runtime.v1 compiled from Kubernetes' api.proto).

No kubelet: snapguard_lab.cri makes the calls it makes. The pod is host-network (no CNI), its sandbox
image built locally and imported; the counter image is pushed to a local docker-registry, which a
CRI restore pulls by NAME@DIGEST. The counter (lab workload counter.sh) appends `i h` (h a hash
chain over 1..i) to /out/counter.log in its own rootfs, which the archive's rootfs-diff.tar carries
as it was at the dump (the task is paused for both): the restored file must go on from its last line.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from snapguard.image import verify
from snapguard.names import MANIFEST_NAME, MARKER_NAME, RESULT_NAME
from snapguard_lab.cri import COUNTER_REPO, CounterRows, CriLab, counter_rows, tampered_archive, wait_rows
from snapguard_lab.testbed import CONTAINERD_UMASK, compat_missing

pytestmark = pytest.mark.stack

POD, NAMESPACE, NAME = "ckpt-pod", "default", "counter"
# what checkpointctl reads and containerd writes beside checkpoint/ (containerd 2.1.9,
# internal/cri/server/container_checkpoint_linux.go)
CHECKPOINTCTL_FILES = {"config.dump", "spec.dump", "status.dump", "status", "container.log", "dump.log",
                       "stats-dump", "rootfs-diff.tar"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CriLab]:
    why = compat_missing()
    if why:
        pytest.skip(f"the compat stack is not installed: {why}")
    if os.geteuid() != 0:
        pytest.fail("the kubelet path test needs root (CI and the README's test command run as root)")
    work = tmp_path_factory.mktemp("kubelet-path")
    config = work / "snapguard-config.toml"  # SNAPGUARD_CONFIG of every snapguard-runc the shim runs
    config.write_text("")
    cri_lab = CriLab(str(work / "lab"), str(config))
    try:
        cri_lab.start()
        yield cri_lab
    finally:
        cri_lab.stop()


@dataclass
class Pod:
    id: str
    config: Any
    checkpoints: Path  # the kubelet's /var/lib/kubelet/checkpoints: root's, 0700


@pytest.fixture(scope="module")
def pod(lab: CriLab) -> Pod:
    assert lab.cri is not None
    lab.cri.pull(lab.counter_image)  # as the kubelet does: the image then has its repo digest
    uid = str(uuid.uuid4())
    logs = lab.workdir / "pods" / f"{NAMESPACE}_{POD}_{uid}"
    logs.mkdir(parents=True)
    config = lab.cri.sandbox_config(POD, NAMESPACE, uid, str(logs))
    checkpoints = lab.workdir / "kubelet" / "checkpoints"
    checkpoints.mkdir(mode=0o700, parents=True)
    return Pod(lab.cri.run_sandbox(config), config, checkpoints)


def _location(pod: Pod, container: str) -> str:
    """The kubelet's archive name: checkpoint-<pod>_<namespace>-<container>-<RFC 3339 time>.tar."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return str(pod.checkpoints / f"checkpoint-{POD}_{NAMESPACE}-{container}-{stamp}.tar")


def _rows(lab: CriLab, container_id: str) -> CounterRows:
    assert lab.cri is not None
    return wait_rows(lab.cri, container_id, 0)


def _wait_rows(lab: CriLab, container_id: str, count: int, timeout: float = 20.0) -> CounterRows:
    assert lab.cri is not None
    return wait_rows(lab.cri, container_id, count, timeout)


def _start_counter(lab: CriLab, pod: Pod, name: str) -> str:
    assert lab.cri is not None
    cid = lab.cri.create(pod.id, pod.config, lab.cri.container_config(name, lab.counter_image, pod.config))
    lab.cri.start(cid)
    return cid


@dataclass
class Checkpointed:
    container_id: str
    archive: str
    seconds: float
    members: dict[str, tarfile.TarInfo]
    data: dict[str, bytes]  # every regular member's bytes
    archived: CounterRows  # /out/counter.log as the archive's rootfs-diff.tar holds it
    original_state: str  # the original container after the checkpoint
    original_after: CounterRows


@pytest.fixture(scope="module")
def checkpointed(lab: CriLab, pod: Pod) -> Checkpointed:
    assert lab.cri is not None
    cid = _start_counter(lab, pod, NAME)
    _wait_rows(lab, cid, 20)
    archive = _location(pod, NAME)
    t0 = time.monotonic()
    lab.cri.checkpoint(cid, archive, timeout_s=60)
    seconds = time.monotonic() - t0
    with tarfile.open(archive) as tf:
        members = {m.name.rstrip("/"): m for m in tf.getmembers()}
        data = {name: tf.extractfile(m).read() for name, m in members.items() if m.isfile()}  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(data["rootfs-diff.tar"])) as diff:
        archived = counter_rows(diff.extractfile("out/counter.log").read().decode())  # type: ignore[union-attr]
    state = lab.cri.state(cid)
    after = _wait_rows(lab, cid, len(archived.rows) + 10) if state == "CONTAINER_RUNNING" else CounterRows()
    return Checkpointed(cid, archive, seconds, members, data, archived, state, after)


@dataclass
class Restored:
    container_id: str
    status: Any
    rows: CounterRows
    seconds: float


@pytest.fixture(scope="module")
def restored(lab: CriLab, pod: Pod, checkpointed: Checkpointed) -> Restored:
    """The kubelet's restore: the original removed, a container created in the pod with the archive
    as its image (attempt 1), started."""
    assert lab.cri is not None
    lab.cri.stop_and_remove(checkpointed.container_id)
    t0 = time.monotonic()
    rid = lab.cri.create(pod.id, pod.config, lab.cri.container_config(NAME, checkpointed.archive, pod.config,
                                                                      attempt=1))
    lab.cri.start(rid)
    seconds = time.monotonic() - t0
    rows = _wait_rows(lab, rid, len(checkpointed.archived.rows) + 10)
    return Restored(rid, lab.cri.status(rid), rows, seconds)


def test_checkpoint_container_writes_checkpointctl_layout_with_snapguards_seal_inside(
        lab: CriLab, checkpointed: Checkpointed, tmp_path: Path) -> None:
    ck = checkpointed
    st = os.stat(ck.archive)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0, oct(st.st_mode)

    names = set(ck.members)
    assert CHECKPOINTCTL_FILES <= names, sorted(names)
    assert ck.members["checkpoint"].isdir()
    assert all(m.isfile() or m.isdir() for m in ck.members.values())
    image = {n.split("/", 1)[1] for n in names if n.startswith("checkpoint/")}
    assert {"inventory.img", "pstree.img", MANIFEST_NAME, MARKER_NAME} <= image
    assert any(n.startswith("pages-") for n in image)
    # snapguard's files live inside checkpoint/ only, beside CRIU's images
    assert not {MANIFEST_NAME, MARKER_NAME} & names

    # Modes. snapguard seals every image file 0600 in the image directory the shim hands runc, but
    # containerd 2.1.9 re-creates each file of checkpoint/ with os.Create (0666 less its umask)
    # when it copies the CRIU tarball out of its content store; what keeps them root's alone is the
    # archive's 0600, checkpoint/'s 0700 and, at restore, the 0700 directory it is unpacked into.
    assert stat.S_IMODE(ck.members["checkpoint"].mode) == 0o700
    image_modes = {n: stat.S_IMODE(ck.members[f"checkpoint/{n}"].mode) for n in image}
    assert set(image_modes.values()) == {0o666 & ~CONTAINERD_UMASK}, image_modes
    for name in ("config.dump", "status.dump", "status", "container.log"):
        assert stat.S_IMODE(ck.members[name].mode) == 0o600, (name, oct(ck.members[name].mode))
    assert all(not m.mode & 0o022 for m in ck.members.values()), "a member others could write"

    # the seal survived the copies: the product's own verification of the unpacked checkpoint/
    unpacked = tmp_path / "checkpoint"
    unpacked.mkdir(mode=0o700)
    for n in image:
        (unpacked / n).write_bytes(ck.data[f"checkpoint/{n}"])
        os.chmod(unpacked / n, image_modes[n])
    manifest = verify(str(unpacked)).to_json()
    assert set(manifest["files"]) == image - {MANIFEST_NAME, MARKER_NAME}
    marker = json.loads(ck.data[f"checkpoint/{MARKER_NAME}"])
    assert marker["manifest_sha256"] == hashlib.sha256(ck.data[f"checkpoint/{MANIFEST_NAME}"]).hexdigest()
    assert manifest["container_id"] == ck.container_id and manifest["leave_running"] is True
    assert {p["comm"] for p in manifest["processes"]} >= {"sh"}

    # snapguard's record of the run, from the work path containerd gave (archived with dump.log)
    record = json.loads(ck.data[RESULT_NAME])
    assert record["ok"] is True and record["operation"] == "checkpoint", record
    assert record["container_id"] == ck.container_id and record["leave_running"] is True
    assert os.path.basename(record["image"]).startswith("ctrd-checkpoint")

    config = json.loads(ck.data["config.dump"])
    assert config["id"] == ck.container_id
    assert config["rootfsImageName"] == lab.counter_image
    assert config["rootfsImageRef"] == f"{lab.registry.host}/{COUNTER_REPO}@{lab.counter_digest}"
    assert ck.seconds < 30, ck.seconds


def test_restore_from_the_archive_continues_exactly(
        lab: CriLab, checkpointed: Checkpointed, restored: Restored) -> None:
    ck, rs = checkpointed, restored
    archived = ck.archived.rows
    assert archived and ck.archived.chain_errors() == [], archived[-3:]
    # the kubelet's checkpoint leaves the container running (pause, dump, resume)
    assert ck.original_state == "CONTAINER_RUNNING"
    assert ck.original_after.last() > ck.archived.last()

    assert lab.cri is not None
    assert lab.cri.pb.ContainerState.Name(rs.status.state) == "CONTAINER_RUNNING"
    assert rs.status.annotations["restored"] == "true"
    assert rs.status.annotations["checkpointedAt"]
    rows = rs.rows.rows
    # the file as dumped, then exactly the next value: the process went on from its dumped state
    assert rows[:len(archived)] == archived
    assert rows[len(archived)][0] == ck.archived.last() + 1, rows[len(archived) - 2:len(archived) + 3]
    assert rs.rows.chain_errors() == []

    # snapguard-runc restore drove it: CRIU ran with the config of snapguard's private run directory
    assert lab.containerd is not None
    log = lab.containerd.root / "io.containerd.runtime.v2.task" / "k8s.io" / rs.container_id / "restore.log"
    assert f"Parsing config file {lab.state_dir}/run-" in log.read_text(errors="replace")[:4096]
    assert rs.seconds < 30, rs.seconds


def test_restore_record_reaches_the_shims_work_path(lab: CriLab, restored: Restored) -> None:
    """README: the record of a run, success or failure, goes to <work dir>/snapguard-result.json."""
    assert lab.containerd is not None
    work = lab.containerd.state / "io.containerd.runtime.v2.task" / "k8s.io" / restored.container_id / "work"
    record = json.loads((work / RESULT_NAME).read_text())
    assert record["ok"] is True and record["operation"] == "restore"


def test_tampered_archive_is_refused_at_start_as_one_typed_line(
        lab: CriLab, pod: Pod, checkpointed: Checkpointed) -> None:
    """The restore side of the same path is guarded: one flipped bit in a page file of the archive,
    and StartContainer's error is snapguard's IMAGE_CORRUPT line, CRIU never having run."""
    assert lab.cri is not None
    bad = str(pod.checkpoints / "tampered.tar")
    pages = tampered_archive(Path(checkpointed.archive).read_bytes(), bad)
    os.chmod(bad, 0o600)
    rid = lab.cri.create(pod.id, pod.config, lab.cri.container_config("tampered", bad, pod.config))
    message = lab.cri.start_refused(rid)
    assert f"snapguard IMAGE_CORRUPT: image file {pages.split('/', 1)[1]} has sha256 " in message, message


def test_preflight_refusal_reaches_the_cri_caller_as_one_typed_line(lab: CriLab, pod: Pod, tmp_path: Path) -> None:
    assert lab.cri is not None
    missing = tmp_path / "no-such-criu"
    Path(lab.config_file).write_text(f'criu = "{missing}"\n')
    cid = _start_counter(lab, pod, "refused")
    try:
        _wait_rows(lab, cid, 5)
        archive = _location(pod, "refused")
        with pytest.raises(grpc.RpcError) as refused:
            lab.cri.checkpoint(cid, archive, timeout_s=60)
        message = refused.value.details()
        # what `kubectl` users see: containerd's wrapping around the first line runc's stderr had
        assert "\n" not in message, message
        assert f"snapguard CRIU_MISSING: criu {missing}" in message, message
        assert not os.path.exists(archive)
        # a blocked preflight changes nothing: containerd resumed the paused task and it goes on
        assert lab.cri.state(cid) == "CONTAINER_RUNNING"
        before = _rows(lab, cid)
        after = _wait_rows(lab, cid, len(before.rows) + 5)
        assert after.last() > before.last() and after.chain_errors() == []
    finally:
        Path(lab.config_file).write_text("")
        lab.cri.stop_and_remove(cid)
