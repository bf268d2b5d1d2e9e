"""A CRI checkpoint archive as an OCI image: checked, its one layer the archive itself, its config and
its manifest with the checkpoint annotations containerd 2.x and CRI-O restore from.

The archive is untrusted input to this module in the sense that it decides what a restore on
another node copies: every member must be a regular file or a directory with a relative name and
no `..`, and config.dump, spec.dump and checkpoint/ (with snapguard's seal, snapguard-manifest.json)
must be there; anything else is CHECKPOINT_ARCHIVE_INVALID. The layer is uncompressed
(application/vnd.oci.image.layer.v1.tar): its digest is its diff_id, and CRIU's pages do not
compress enough to pay for the time on a reclaim notice.

`scan_archive` reads what the image needs from the archive without reading its bytes (tar's
headers and the small metadata files): the annotations, the sizes of its parts (`ImageParts`:
CRIU's page files, the take point's spill files, the container's rootfs diff, the rest).
`build_image` adds the layer's digest by one pass over the archive; a push that streams the
layer (`_push.publish_archive`) hashes it as it sends it and assembles the image after.

Annotations (on the manifest, where containerd's checkIfCheckpointOCIImage reads them once the
image is pulled by digest; names from checkpointctl's lib/annotations.go, which containerd
2.1.9 vendors and CRI-O sets):

    org.criu.checkpoint.container.name   the container's name (the one containerd keys on)
    org.criu.checkpoint.pod.name / .pod.namespace / .pod.id    the pod it ran in
    org.criu.checkpoint.rootfsImageName  the image the container ran (config.dump)
    org.criu.checkpoint.rootfsImageRef   ... by NAME@DIGEST, which containerd pulls at restore
    org.criu.checkpoint.engine.name      "containerd"
    org.criu.checkpoint.host.arch        the node's architecture
    io.snapguard.job / io.snapguard.epoch / io.snapguard.seal.sha256   the job, its fencing epoch
                                         and the sha256 of the seal inside checkpoint/
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tarfile
from dataclasses import dataclass, field
from typing import Any

from ..names import MANIFEST_NAME, MARKER_NAME, TAKE_SPILL
from ..reasons import Reason, SnapguardError

__all__ = ["ANNOTATION_CONTAINER", "CheckpointImage", "ImageParts", "Scanned", "assemble", "build_image", "scan_archive"]

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar"
ANNOTATION_CONTAINER = "org.criu.checkpoint.container.name"
_CRIU = "org.criu.checkpoint."
_DUMP_CAP = 4 << 20  # config.dump and spec.dump are a few KiB
_CHUNK = 1 << 20
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


@dataclass(frozen=True)
class ImageParts:
    """The archive's bytes by part (members' sizes): CRIU's page files (checkpoint/pages-*.img:
    the processes' memory, the GPU's too where CRIU's CUDA plugin took it), the take point's spill
    files (checkpoint/snapguard-take-*.bin), the container's rootfs diff (rootfs-diff.tar), the
    rest (CRIU's other images, the dumps, the seal); `archive` the archive file's size."""

    pages: int = 0
    spill: int = 0
    rootfs_diff: int = 0
    other: int = 0
    archive: int = 0
    files: int = 0


@dataclass(frozen=True)
class CheckpointImage:
    """What is pushed: the layer (a file, the archive), the config and manifest bytes; the layer's
    bytes by part."""

    layer_path: str
    layer_digest: str
    layer_size: int
    config: bytes
    manifest: bytes
    annotations: dict[str, str] = field(default_factory=dict)
    parts: ImageParts = field(default_factory=ImageParts)

    @property
    def config_digest(self) -> str:
        return _digest(self.config)

    @property
    def digest(self) -> str:
        """The manifest's digest: the image's identity in the registry."""
        return _digest(self.manifest)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _refuse(archive: str, detail: str) -> SnapguardError:
    return SnapguardError(Reason.CHECKPOINT_ARCHIVE_INVALID, f"{archive}: {detail}", evidence={"archive": archive})


def _safe_name(name: str) -> str | None:
    clean = name.rstrip("/")
    while clean.startswith("./"):
        clean = clean[2:]
    if not clean or clean == ".":
        return "."
    if clean.startswith("/") or any(part in ("", "..") for part in clean.split("/")):
        return None
    return clean


def _part(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    if name.startswith("checkpoint/") and base.startswith("pages-") and base.endswith(".img"):
        return "pages"
    if name.startswith("checkpoint/") and TAKE_SPILL.fullmatch(base):
        return "spill"
    return "rootfs_diff" if name == "rootfs-diff.tar" else "other"


def _scan(archive: str) -> tuple[dict[str, bytes], set[str], dict[str, int]]:
    """({config.dump, spec.dump, checkpoint/<seal>: bytes}, every member's name, the members'
    bytes by part), the archive checked."""
    wanted = {"config.dump", "spec.dump", f"checkpoint/{MANIFEST_NAME}", f"checkpoint/{MARKER_NAME}"}
    found: dict[str, bytes] = {}
    names: set[str] = set()
    sizes = {"pages": 0, "spill": 0, "rootfs_diff": 0, "other": 0, "files": 0}
    try:
        with tarfile.open(archive, mode="r:") as tf:
            for member in tf:
                name = _safe_name(member.name)
                if name is None:
                    raise _refuse(archive, f"member {member.name[:120]!r} is not a relative path inside the archive")
                if not (member.isfile() or member.isdir()):
                    raise _refuse(archive, f"member {name[:120]} is not a regular file or a directory")
                names.add(name)
                if member.isfile():
                    sizes[_part(name)] += member.size
                    sizes["files"] += 1
                if name in wanted and member.isfile():
                    if member.size > _DUMP_CAP:
                        raise _refuse(archive, f"{name} has {member.size} bytes, over {_DUMP_CAP}")
                    body = tf.extractfile(member)
                    found[name] = body.read() if body is not None else b""
    except (tarfile.TarError, OSError, EOFError) as e:
        raise _refuse(archive, f"not a readable tar archive ({e})") from None
    missing = sorted(w for w in wanted if w not in found)
    if missing or "checkpoint" not in names:
        raise _refuse(archive, f"missing {', '.join(missing) or 'checkpoint/'} (not a CRI checkpoint sealed by "
                      "snapguard-runc)")
    return found, names, sizes


def _json(archive: str, name: str, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as e:
        raise _refuse(archive, f"{name} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise _refuse(archive, f"{name} is not a JSON object")
    return value


def _text(value: Any) -> str:
    return value if isinstance(value, str) and len(value) <= 1024 and value.isprintable() else ""


def _layer_digest(archive: str) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(archive, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


@dataclass(frozen=True)
class Scanned:
    """What the image takes from the archive apart from its bytes' digest (`scan_archive`)."""

    archive: str
    annotations: dict[str, str]
    container: str
    arch: str
    created: str
    parts: ImageParts


def scan_archive(archive: str, *, job: str, epoch: int, created: str | None = None) -> Scanned:
    """The CRI checkpoint archive at `archive` checked (its headers and metadata files, not its
    bytes) for `job`'s snapshot under fencing `epoch`."""
    found, _, sizes = _scan(archive)
    config_dump = _json(archive, "config.dump", found["config.dump"])
    spec = _json(archive, "spec.dump", found["spec.dump"])
    spec_ann = spec.get("annotations") if isinstance(spec.get("annotations"), dict) else {}
    container = _text(spec_ann.get("io.kubernetes.cri.container-name")) or _text(config_dump.get("name"))
    if not container:
        raise _refuse(archive, "neither spec.dump's io.kubernetes.cri.container-name nor config.dump's name "
                      "names the container")
    arch = _ARCH.get(platform.machine(), platform.machine())
    annotations = {
        ANNOTATION_CONTAINER: container,
        _CRIU + "pod.name": _text(spec_ann.get("io.kubernetes.cri.sandbox-name")),
        _CRIU + "pod.namespace": _text(spec_ann.get("io.kubernetes.cri.sandbox-namespace")),
        _CRIU + "pod.id": _text(spec_ann.get("io.kubernetes.cri.sandbox-id")),
        _CRIU + "rootfsImageName": _text(config_dump.get("rootfsImageName")),
        _CRIU + "rootfsImageRef": _text(config_dump.get("rootfsImageRef")),
        _CRIU + "engine.name": "containerd",
        _CRIU + "host.arch": arch,
        "io.snapguard.job": job,
        "io.snapguard.epoch": str(int(epoch)),
        "io.snapguard.seal.sha256": hashlib.sha256(found[f"checkpoint/{MANIFEST_NAME}"]).hexdigest(),
    }
    try:
        archive_size = os.stat(archive).st_size
    except OSError as e:
        raise _refuse(archive, f"cannot stat it ({e.strerror})") from None
    parts = ImageParts(pages=sizes["pages"], spill=sizes["spill"], rootfs_diff=sizes["rootfs_diff"],
                       other=sizes["other"], archive=archive_size, files=sizes["files"])
    return Scanned(os.path.abspath(archive), {k: v for k, v in annotations.items() if v}, container, arch,
                   created or _text(config_dump.get("checkpointedTime")), parts)


def assemble(scanned: Scanned, layer_digest: str, layer_size: int) -> CheckpointImage:
    """The image of a scanned archive whose bytes have `layer_digest` and `layer_size`."""
    image_config: dict[str, Any] = {
        "architecture": scanned.arch, "os": "linux",
        "config": {"Labels": {ANNOTATION_CONTAINER: scanned.container}},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "snapguard: CRI CheckpointContainer archive", "comment": scanned.container}],
    }
    if scanned.created:
        image_config["created"] = scanned.created
    config = json.dumps(image_config, sort_keys=True, separators=(",", ":")).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": MT_MANIFEST,
        "config": {"mediaType": MT_CONFIG, "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": MT_LAYER, "digest": layer_digest, "size": layer_size}],
        "annotations": scanned.annotations,
    }, sort_keys=True, separators=(",", ":")).encode()
    return CheckpointImage(scanned.archive, layer_digest, layer_size, config, manifest, dict(scanned.annotations),
                           scanned.parts)


def build_image(archive: str, *, job: str, epoch: int, created: str | None = None) -> CheckpointImage:
    """The OCI checkpoint image of the CRI checkpoint archive at `archive` (checked) for `job`'s
    snapshot under fencing `epoch`: scanned, then its layer digested by one pass over its bytes."""
    scanned = scan_archive(archive, job=job, epoch=epoch, created=created)
    layer_digest, layer_size = _layer_digest(archive)
    return assemble(scanned, layer_digest, layer_size)
