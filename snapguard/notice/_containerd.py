"""Containers annotated for the agent, found through containerd's API (its `ctr` client).

A container is protected when its OCI spec annotations (or its containerd labels) carry
`snapguard.io/job`; `snapguard.io/file-checkpoint` names its file checkpoint (the fallback) and
`snapguard.io/epoch` the fencing epoch the attempt holds. Kubernetes pod annotations reach a
container's spec through the runtime's `pod_annotations`, which `snapguard install` sets to
`snapguard.io/*` for its runtime. Only containers whose task runs are listed; runc knows them
under `<runc root>/<namespace>` (containerd's runc shim's default root).

Everything read here is the container owner's input: values are checked as the registry's
(`Registry.add_container`), ids as runc's, and a malformed entry is skipped with a line in the
agent's log, never trusted further.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from .. import children
from ..reasons import Reason, SnapguardError
from ._sources._retry import retry

__all__ = ["ANNOTATION_EPOCH", "ANNOTATION_FILE_CHECKPOINT", "ANNOTATION_JOB", "ContainerdWatch"]

ANNOTATION_JOB = "snapguard.io/job"
ANNOTATION_FILE_CHECKPOINT = "snapguard.io/file-checkpoint"
ANNOTATION_EPOCH = "snapguard.io/epoch"
DEFAULT_ADDRESS = "/run/containerd/containerd.sock"
DEFAULT_RUNC_ROOT = "/run/containerd/runc"
DEFAULT_CTR = "/usr/bin/ctr"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,1023}\Z")
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,75}\Z")
_JOB = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")


@dataclass(frozen=True)
class ContainerdWatch:
    ctr: str  # the pinned client (checked root's alone by the caller, as every binary snapguard runs)
    address: str = DEFAULT_ADDRESS
    namespaces: tuple[str, ...] = ("k8s.io", "default")
    runc_root: str = DEFAULT_RUNC_ROOT
    timeout_s: float = 15.0

    def __post_init__(self) -> None:
        bad = [n for n in self.namespaces if not _NAMESPACE.match(n)]
        if bad:
            raise SnapguardError(Reason.USAGE_ERROR, f"containerd namespace {bad[0]!r} is not a namespace name")

    def _ctr(self, namespace: str, *args: str, deadline: float | None = None) -> str:
        """ctr's output; within `deadline` (monotonic), a ctr that exits non-zero (containerd
        restarting, its socket not up yet) is run again with jittered backoff (_sources._retry)."""
        def once() -> str:
            left = self.timeout_s if deadline is None else max(0.001, min(self.timeout_s, deadline - time.monotonic()))
            out = children.run_captured([self.ctr, "--address", self.address, "--namespace", namespace, *args],
                                        timeout_s=left, what=f"ctr {args[0]} {args[1]}",
                                        reason=Reason.CONTAINERD_UNAVAILABLE)
            if out.returncode != 0:
                raise _Exited(Reason.CONTAINERD_UNAVAILABLE, f"ctr --namespace {namespace} {' '.join(args[:2])}: "
                              f"exit {out.returncode}: {(out.stderr.strip().splitlines() or [''])[-1][:300]}",
                              evidence={"address": self.address, "namespace": namespace})
            return out.stdout

        if deadline is None:
            return once()
        return retry(once, deadline, lambda e: isinstance(e, _Exited))

    def annotated(self) -> tuple[list[dict[str, Any]], list[str]]:
        """(entries for the registry, lines on what was skipped and why)."""
        entries: list[dict[str, Any]] = []
        skipped: list[str] = []
        for ns in self.namespaces:
            running = set()
            listed = self._ctr(ns, "tasks", "list", deadline=time.monotonic() + self.timeout_s)
            for line in listed.splitlines()[1:]:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "RUNNING":
                    running.add(parts[0])
            for cid in sorted(running):
                if not _ID.match(cid):
                    skipped.append(f"{ns}/{cid[:80]!r}: not a container id runc accepts")
                    continue
                try:
                    info = json.loads(self._ctr(ns, "containers", "info", cid))
                except ValueError:
                    skipped.append(f"{ns}/{cid}: ctr printed no JSON for it")
                    continue
                except SnapguardError as e:  # gone between the two calls
                    skipped.append(f"{ns}/{cid}: {e.failure.detail}")
                    continue
                found = _annotations(info)
                job = found.get(ANNOTATION_JOB)
                if job is None:
                    continue
                entry, why = _entry(ns, cid, found, self.runc_root)
                if entry is None:
                    skipped.append(f"{ns}/{cid}: {why}")
                else:
                    entries.append(entry)
        return entries, skipped


class _Exited(SnapguardError):
    """ctr ran and exited non-zero: transient for the listing (ctr's own timeout is not retried)."""


def _annotations(info: Any) -> dict[str, str]:
    """The snapguard.io/ keys of a container's OCI spec annotations, else of its labels."""
    found: dict[str, str] = {}
    if not isinstance(info, dict):
        return found
    spec = info.get("Spec")
    sources = [info.get("Labels"), spec.get("annotations") if isinstance(spec, dict) else None]
    for source in sources:  # the spec last: it wins
        if isinstance(source, dict):
            found.update({k: v for k, v in source.items() if isinstance(k, str) and k.startswith("snapguard.io/")
                          and isinstance(v, str)})
    return found


def _entry(ns: str, cid: str, found: dict[str, str], runc_root: str) -> tuple[dict[str, Any] | None, str]:
    job = found[ANNOTATION_JOB]
    if not _JOB.match(job):
        return None, f"{ANNOTATION_JOB} {job[:80]!r} is not a job name (letters, digits, '.', '_', '-')"
    fc = found.get(ANNOTATION_FILE_CHECKPOINT) or None
    if fc is not None and ("\0" in fc or "\n" in fc or len(fc) > 4096):
        return None, f"{ANNOTATION_FILE_CHECKPOINT} is not a path or URL"
    epoch: int | None = None
    if ANNOTATION_EPOCH in found:
        text = found[ANNOTATION_EPOCH]
        if not text.isdigit() or len(text) > 12:
            return None, f"{ANNOTATION_EPOCH} {text[:40]!r} is not a number"
        epoch = int(text)
    return {"container": cid, "root": os.path.join(runc_root, ns), "job": job, "file_checkpoint": fc,
            "epoch": epoch, "namespace": ns}, ""
