"""An agent's restart: settle what a previous agent left half done.

An agent killed mid-snapshot leaves a journal whose last word on an image is "started". The
restarted agent kills whatever still runs on that image (CRIU runs in a process group of its own
and outlives its parent: found by its `--images-dir` argument), brings the workload's CUDA
processes back to running, and then: an image with the completion marker is whole (the marker is
written last) and counts as sealed; one without it is discarded, never uploaded or marked. A
workload still running is snapshotted again while its notice is open; one that is gone (CRIU
finished the dump and ended it, but the seal never happened) is recorded as lost with
AGENT_SNAPSHOT_INTERRUPTED and its file checkpoint named as the fallback. An upload begun and never
ended is swept from the store, and a sealed image not yet in the store is pushed whole.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from ..config import Config
from ..reasons import Failure, Reason
from ._sources import Notice
from ._state import Registry, marked
from ._upload import Uploads
from ._workload import alive, bring_back, end_strays

__all__ = ["recover"]


class Agent(Protocol):
    """What a restart needs of the agent (snapguard.notice._agent.Agent)."""

    config: Config
    images: str
    registry: Registry
    store_url: str | None
    uploads: Uploads

    def log(self, text: str) -> None: ...

    def journal(self, event: str, **fields: Any) -> None: ...

    def read_journal(self) -> list[dict[str, Any]]: ...

    def notices(self) -> dict[str, Any]: ...

    def requeue(self, notice: Notice) -> None: ...

    def discard(self, image: str, why: str) -> None: ...

_SNAPSHOT_EVENTS = ("snapshot_started", "snapshot_sealed", "snapshot_failed", "snapshot_interrupted", "discarded")
_UPLOAD_ENDS = ("uploaded", "upload_failed", "upload_aborted", "upload_swept")


def _journal_state(events: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]],
                                                          dict[str, str]]:
    """From the journal: the last snapshot event of each image, the images whose upload began and
    did not end, and each image's job."""
    last: dict[str, dict[str, Any]] = {}
    streaming: dict[str, dict[str, Any]] = {}
    jobs: dict[str, str] = {}
    for ev in events:
        image = ev.get("image")
        if not image:
            continue
        if ev["event"] in _SNAPSHOT_EVENTS:
            last[image] = ev
        if ev["event"] == "snapshot_started" and ev.get("job"):
            jobs[image] = ev["job"]
        if ev["event"] == "upload_started":
            streaming[image] = ev
        elif ev["event"] in _UPLOAD_ENDS:
            streaming.pop(image, None)
    return last, streaming, jobs


def _settle(agent: Agent, image: str, ev: dict[str, Any], workloads: dict[str, dict[str, Any]]) -> None:
    """An image whose snapshot started and never ended: sealed after all, or discarded."""
    strays = end_strays(image)
    entry = workloads.get(ev.get("key", ""), {})
    bring_back(agent.config, entry, agent.log)
    if os.path.isdir(image) and marked(image):
        agent.journal("snapshot_sealed", key=ev.get("key"), image=image, notice=ev.get("notice"), recovered=True)
        agent.registry.update(ev["key"], state="snapshotted", image=image, uploaded=False)
        agent.log(f"recovered: the image {image} of {ev.get('key')} was sealed before the restart")
        return
    agent.discard(image, "no completion marker: the agent stopped mid-snapshot")
    intact = alive(agent.config, entry)
    failure = Failure(Reason.AGENT_SNAPSHOT_INTERRUPTED,
                      f"{ev.get('key')}: the agent stopped while snapshotting into {image}; "
                      + ("the workload still runs and is snapshotted again while its notice is open"
                         if intact else "the workload is gone; resume it from its file checkpoint "
                         f"{entry.get('file_checkpoint') or '(none registered)'}"),
                      workload_intact=intact, evidence={"image": image, "strays_killed": strays})
    agent.journal("snapshot_interrupted", key=ev.get("key"), notice=ev.get("notice"), record=failure.to_dict())
    agent.log(failure.message)
    if not intact and ev.get("key") in workloads:
        agent.registry.update(ev["key"], state="lost", reason=failure.reason.name)


def recover(agent: Agent) -> None:
    """Settle what a previous agent left half done (see the module's docstring)."""
    last, streaming, jobs = _journal_state(agent.read_journal())
    for image, ev in streaming.items():
        agent.uploads.sweep(image, jobs.get(image), ev)
    workloads = agent.registry.load()
    for image, ev in last.items():
        if ev["event"] == "snapshot_started":
            _settle(agent, image, ev, workloads)
    # an unmarked image nobody journalled (killed between mkdir and the journal line): never kept
    for name in os.listdir(agent.images):
        path = os.path.join(agent.images, name)
        if os.path.isdir(path) and not os.path.islink(path) and not marked(path):
            agent.discard(path, "no completion marker")
    # notices whose handling did not finish: act again (workloads already snapshotted are skipped)
    for nid, rec in agent.notices().items():
        if not isinstance(rec, dict) or rec.get("status") == "done":
            continue
        try:
            notice = Notice.from_dict(rec["notice"])
        except (KeyError, TypeError, ValueError, AttributeError):  # a record of the wrong shape: said, skipped
            agent.journal("notice_refused", source="notices.json", reason=Reason.AGENT_STATE_INVALID.name,
                          where=str(nid)[:128], detail="a notice record that is not the shape snapguard writes")
            continue
        agent.log(f"notice {nid} was not finished before the restart: acting on it again")
        agent.requeue(notice)
    if agent.store_url:
        for key, w in agent.registry.load().items():
            if w.get("state") == "snapshotted" and not w.get("uploaded") and w.get("image") and marked(w["image"]):
                agent.uploads.upload(key, w)
