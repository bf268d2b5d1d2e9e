"""What the webhook changes in a pod: the JSONPatch (RFC 6902) of one AdmissionReview.

A pod is opted in by its RuntimeClass (`WebhookConfig.runtime_class`, `snapguard` by default) and
the annotation JOB_ANNOTATION naming its job. In every container of an opted-in pod:
  - the take point: PYTHONPATH gets the node's take-point directory (HOOK_DIR, a hostPath mounted
    read-only at the same path) put first, what the container's spec had after it; TAKE_DIR_ENV
    is set unless the spec sets it; the node's spill tmpfs (`WebhookConfig.spill_dir`,
    takepoint.SPILL_TMPFS unless given) is mounted from the host at the same path, and another
    than the default is named to the take point by SPILL_DIR_ENV unless the spec sets it. The
    directory holds the standard-library-only take point (snapguard.takepoint.hookdir), no
    site-packages: the container's own packages stay its own.
    A PYTHONPATH the image sets in its own config (not in the pod's spec) is replaced by the
    spec's: such a pod names it in its spec to keep it.
  - the restore: when the job's snapshot is restorable (snapshots.SnapshotSource), the job's
    container (the one the snapshot was taken from; else the one annotated CONTAINER_ANNOTATION;
    else the first) gets the checkpoint image by digest, and the pod the annotations EPOCH_ANNOTATION
    (the attempt's epoch) and ORIGINAL_IMAGE_ANNOTATION (the image its spec named).
Nothing it cannot do blocks the pod: what it skipped, and why, is a warning of the answer.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

from ..takepoint import SPILL_TMPFS, TAKE_DIR_ENV
from ..takepoint.protocol import SPILL_DIR_ENV
from ..takepoint.hookdir import HOOK_DIR
from .review import Answer

__all__ = ["CONTAINER_ANNOTATION", "EPOCH_ANNOTATION", "JOB_ANNOTATION", "ORIGINAL_IMAGE_ANNOTATION", "TAKE_DIR", "WebhookConfig", "opted_in", "restore_patch", "take_point_patch"]

JOB_ANNOTATION = "snapguard.io/job"
CONTAINER_ANNOTATION = "snapguard.io/container"
EPOCH_ANNOTATION = "snapguard.io/epoch"
ORIGINAL_IMAGE_ANNOTATION = "snapguard.io/original-image"
TAKE_DIR = "/run/snapguard/take"  # in the container: the take point's sockets
HOOK_VOLUME, SPILL_VOLUME = "snapguard-takepoint", "snapguard-spill"
_JOB = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # a job name the store accepts


@dataclass(frozen=True)
class WebhookConfig:
    """What the webhook injects and where: the RuntimeClass that opts a pod in, the node's
    take-point directory, the take point's socket directory in the container, the spill tmpfs."""

    runtime_class: str = "snapguard"
    hook_dir: str = HOOK_DIR
    take_dir: str = TAKE_DIR
    spill_dir: str = SPILL_TMPFS
    inject: bool = True


def _pointer(*parts: str | int) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def opted_in(pod: dict[str, Any], config: WebhookConfig) -> tuple[str | None, str]:
    """(the pod's job, "") when it is opted in, else (None, why not)."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    job = annotations.get(JOB_ANNOTATION)
    runtime = pod["spec"].get("runtimeClassName")
    if job is None:
        return None, f"no {JOB_ANNOTATION} annotation"
    if runtime != config.runtime_class:
        return None, f"runtimeClassName is {runtime!r}, not {config.runtime_class!r}"
    if not _JOB.match(job):
        return None, f"{JOB_ANNOTATION} {job[:64]!r} is not a job name (letters, digits, '.', '_', '-'; at most 128)"
    return job, ""


def _volumes(pod: dict[str, Any], config: WebhookConfig, answer: Answer) -> set[str]:
    """Add the two hostPath volumes (a name already there is kept as it is); the names added."""
    wanted = {HOOK_VOLUME: config.hook_dir, SPILL_VOLUME: config.spill_dir}
    present = {v["name"] for v in pod["spec"].get("volumes") or []}
    new = [{"name": n, "hostPath": {"path": p, "type": "DirectoryOrCreate"}} for n, p in wanted.items()
           if n not in present]
    if "volumes" not in pod["spec"]:
        answer.patch.append({"op": "add", "path": "/spec/volumes", "value": new})
    else:
        answer.patch.extend({"op": "add", "path": "/spec/volumes/-", "value": v} for v in new)
    return set(wanted)


def _env(i: int, container: dict[str, Any], config: WebhookConfig, answer: Answer) -> bool:
    """Add the take point's environment to container i; False (and a warning) when it cannot."""
    env = container.get("env")
    name = container["name"]
    # the last of several wins in the container, as the kubelet builds its environment
    path_at = next((j for j in reversed(range(len(env or []))) if env[j]["name"] == "PYTHONPATH"), None)
    if path_at is not None and "value" not in env[path_at]:
        answer.warn(f"snapguard: container {name}: PYTHONPATH comes from valueFrom; the take point is not injected")
        return False
    ours: list[dict[str, Any]] = []
    if path_at is None:
        ours.append({"name": "PYTHONPATH", "value": config.hook_dir})
    else:
        old = env[path_at]["value"]
        entries = old.split(":") if old else []
        if entries[:1] != [config.hook_dir]:  # injected already: left as it is
            value = ":".join([config.hook_dir, *[e for e in entries if e != config.hook_dir]])
            answer.patch.append({"op": "replace", "path": _pointer("spec", "containers", i, "env", path_at, "value"),
                                 "value": value})
    if not any(e["name"] == TAKE_DIR_ENV for e in env or []):
        ours.append({"name": TAKE_DIR_ENV, "value": config.take_dir})
    # the take point looks for SPILL_TMPFS by itself; another mount of the spill is named to it
    if config.spill_dir != SPILL_TMPFS and not any(e["name"] == SPILL_DIR_ENV for e in env or []):
        ours.append({"name": SPILL_DIR_ENV, "value": config.spill_dir})
    if env is None:
        if ours:
            answer.patch.append({"op": "add", "path": _pointer("spec", "containers", i, "env"), "value": ours})
    else:
        answer.patch.extend({"op": "add", "path": _pointer("spec", "containers", i, "env", "-"), "value": e}
                            for e in ours)
    return True


def _mounts(i: int, container: dict[str, Any], config: WebhookConfig, answer: Answer) -> None:
    mounts = container.get("volumeMounts")
    taken = {posixpath.normpath(m["mountPath"]): m["name"] for m in mounts or []}
    ours = []
    for volume, path, read_only in ((HOOK_VOLUME, config.hook_dir, True), (SPILL_VOLUME, config.spill_dir, False)):
        if taken.get(path) == volume:
            continue  # injected already
        if path in taken:
            answer.warn(f"snapguard: container {container['name']}: {path} is mounted from volume {taken[path]}; "
                        f"not mounted again")
            continue
        ours.append({"name": volume, "mountPath": path, "readOnly": read_only})
    if mounts is None:
        if ours:
            answer.patch.append({"op": "add", "path": _pointer("spec", "containers", i, "volumeMounts"), "value": ours})
    else:
        answer.patch.extend({"op": "add", "path": _pointer("spec", "containers", i, "volumeMounts", "-"), "value": m}
                            for m in ours)


def take_point_patch(pod: dict[str, Any], config: WebhookConfig, answer: Answer) -> None:
    """The take point into every container of the pod (its init containers aside)."""
    containers = pod["spec"]["containers"]
    volume_names = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    for n in (HOOK_VOLUME, SPILL_VOLUME):
        if n in volume_names and volume_names[n].get("hostPath", {}).get("path") not in (config.hook_dir,
                                                                                          config.spill_dir):
            answer.warn(f"snapguard: the pod has a volume named {n} of its own; the take point is not injected")
            return
    injected = [i for i, c in enumerate(containers) if _env(i, c, config, answer)]
    if not injected:
        return
    _volumes(pod, config, answer)
    for i in injected:
        _mounts(i, containers[i], config, answer)
    answer.actions.append(f"take point into {', '.join(containers[i]['name'] for i in injected)}")


def _job_container(pod: dict[str, Any], wanted: str | None) -> tuple[int | None, str]:
    containers = pod["spec"]["containers"]
    annotations = pod.get("metadata", {}).get("annotations") or {}
    name = wanted or annotations.get(CONTAINER_ANNOTATION)
    if name is None:
        return 0, ""
    at = next((i for i, c in enumerate(containers) if c["name"] == name), None)
    return (at, "") if at is not None else (None, f"the pod has no container {name!r}")


def restore_patch(pod: dict[str, Any], image: Any, attempt_epoch: int, answer: Answer) -> bool:
    """Point the job's container at the checkpoint image (snapshots.CheckpointImage) by digest and
    record the attempt in the pod's annotations; False (and a warning) when it cannot."""
    at, why = _job_container(pod, image.container)
    if at is None:
        answer.warn(f"snapguard: snapshot {image.snapshot} not restored: {why}; the pod starts as written")
        return False
    container = pod["spec"]["containers"][at]
    answer.patch.append({"op": "replace" if "image" in container else "add",
                         "path": _pointer("spec", "containers", at, "image"), "value": image.reference})
    notes = {EPOCH_ANNOTATION: str(attempt_epoch), ORIGINAL_IMAGE_ANNOTATION: str(container.get("image", ""))}
    annotations = pod.get("metadata", {}).get("annotations")
    if "metadata" not in pod:
        answer.patch.append({"op": "add", "path": "/metadata", "value": {"annotations": notes}})
    elif annotations is None:
        answer.patch.append({"op": "add", "path": "/metadata/annotations", "value": notes})
    else:
        answer.patch.extend({"op": "replace" if k in annotations else "add",
                             "path": _pointer("metadata", "annotations", k), "value": v} for k, v in notes.items())
    answer.actions.append(f"restore {container['name']} from {image.reference} (epoch {attempt_epoch})")
    return True
