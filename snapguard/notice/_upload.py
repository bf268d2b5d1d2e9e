"""Sealed images to the image store (snapguard.store, optional): streamed while CRIU writes, or
pushed whole after the seal, under the workload's fencing epoch; the job's older images pruned;
an upload a killed agent began swept from the store.

Each upload is bound by the notice's lead: what is left of the notice's deadline when it starts
(at least `MIN_UPLOAD_S`) is the store's `deadline_s` for the whole push or stream, so that no
upload runs on past the reclaim; a notice with no deadline leaves the store's own deadlines.

The agent's Prometheus textfile (`snapguard-agent.prom`, for node-exporter's textfile collector)
is written here: snapguard_agent_store_writable (the probe at start), and, after each notice,
snapguard_agent_last_notice_snapshotted{job} and snapguard_agent_last_notice_fell_back{job,reason}
(1 per workload; the reason is the typed one it fell back with, snapguard-runc's own when the
executor refused or failed it).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..reasons import Failure, Reason, SnapguardError, failure_from
from ._state import Registry, marked, safe_name

__all__ = ["MIN_UPLOAD_S", "ImageStore", "Uploads", "left_of"]

MIN_UPLOAD_S = 1.0


def left_of(deadline: float | None) -> float | None:
    """Seconds left to the notice's `deadline` (wall clock), at least MIN_UPLOAD_S; None without one."""
    return None if deadline is None else max(deadline - time.time(), MIN_UPLOAD_S)


class ImageStore(Protocol):
    """What the agent needs of snapguard.store's Store (`open_store(url)`)."""

    def put_image(self, image_dir: str, job: str, name: str, progress: Callable[..., Any] | None = None) -> Any: ...


def _push_epoch(store: Any, w: dict[str, Any]) -> int:
    """The fencing epoch a workload's image is pushed under: its own (`protect --epoch`), else the
    job's current one in the store (a newer epoch taken by a replacement refuses the push with
    FENCED)."""
    epoch = w.get("epoch")
    return store.current_epoch(w["job"]) if epoch is None else int(epoch)


def _put(store_mod: Any, store: Any, image: str, w: dict[str, Any], name: str, progress: Callable[..., Any],
         deadline_s: float | None = None) -> Any:
    """Put a sealed image through whichever face the store has: `put_image(dir, job, name,
    progress)` (the ImageStore protocol) or snapguard.store's `push(dir, job, name=, epoch=,
    progress=Progress, deadline_s=)` under the workload's fencing epoch (`_push_epoch`), within
    `deadline_s`."""
    if hasattr(store, "put_image"):
        return store.put_image(image, w["job"], name, progress=progress)
    ref = store.push(image, w["job"], name=name, epoch=_push_epoch(store, w),
                     progress=store_mod.Progress(callback=lambda state: progress(state)), deadline_s=deadline_s)
    return {"job": ref.job, "name": ref.name, "complete": ref.complete, "epoch": ref.epoch}


def _write_gauge(path: str, writable: bool | None, outcomes: list[Any] | None = None) -> None:
    """The agent's textfile (the module's docstring); `outcomes`: the last notice's schedule
    Outcomes. Never raises: a textfile that cannot be written is not worth a notice."""
    try:
        from prometheus_client import CollectorRegistry, Gauge, write_to_textfile
    except ImportError:
        return
    reg = CollectorRegistry()
    if writable is not None:
        Gauge("snapguard_agent_store_writable", "1 when the agent's image store took a probe write at start",
              registry=reg).set(1 if writable else 0)
    if outcomes is not None:
        ok = Gauge("snapguard_agent_last_notice_snapshotted", "1 for each job whose workload's snapshot was "
                   "taken (and published) at the last notice", ["job"], registry=reg)
        fell = Gauge("snapguard_agent_last_notice_fell_back", "1 for each job whose workload fell back to its "
                     "file checkpoint at the last notice, by the typed reason", ["job", "reason"], registry=reg)
        for o in outcomes:
            if o.status == "snapshotted":
                ok.labels(o.job).set(1)
            else:
                fell.labels(o.job, o.reason or "UNKNOWN").set(1)
    try:
        write_to_textfile(path, reg)
    except OSError:
        pass


class Uploads:
    """The agent's uploads to the store at `store_url`: each step journalled and logged, the
    registry told when an image is in the store, and, with `keep`, the job's older images beyond
    that many whole ones pruned after an upload."""

    def __init__(self, store_url: str | None, keep: int | None, *, journal: Callable[..., None],
                 log: Callable[[str], None], registry: Registry, discard: Callable[[str, str], None]) -> None:
        self.store_url = store_url
        self.keep = keep
        self.journal = journal
        self.log = log
        self.registry = registry
        self.discard = discard
        self.metrics_path: str | None = None
        self.writable: bool | None = None  # what the probe at start found (None: no store, or not yet)

    def note_outcomes(self, outcomes: list[Any]) -> None:
        """The last notice's outcomes into the agent's textfile (with the probe's gauge)."""
        if self.metrics_path:
            _write_gauge(self.metrics_path, self.writable, outcomes)

    def probe(self, metrics_path: str | None = None) -> bool:
        """At start: can the agent write to its store? A probe object put and deleted. A store that
        refuses or does not answer is a loud warning in the log, a `store_check` journal line and
        the gauge snapguard_agent_store_writable 0 (a Prometheus textfile at `metrics_path`), not a
        surprise on the notice."""
        self.metrics_path = metrics_path
        if not self.store_url:
            return True
        key = f"snapguard-probe/agent-{safe_name(socket.gethostname())}-{os.getpid()}"
        try:
            from .. import store as store_mod

            st = store_mod.open_store(self.store_url)
            st._put(key, b"snapguard agent write probe\n")
            st._delete(key)
            ok, failure = True, None
        except Exception as e:
            ok, f = False, failure_from(e)
            failure = Failure(Reason.STORE_NOT_WRITABLE, f"{self.store_url}: {f.message}",
                              evidence={"store": self.store_url, "cause": f.reason.name})
        self.journal("store_check", store=self.store_url, writable=ok,
                     record=failure.to_dict() if failure else None)
        if failure is not None:
            self.log(f"WARNING: snapguard {failure.reason.name}: {failure.message}; a notice now would leave "
                     "its images on this node")
        self.writable = ok
        if metrics_path:
            _write_gauge(metrics_path, ok)
        return ok

    def sweep(self, image: str, job: str | None, ev: dict[str, Any]) -> None:
        """An upload the previous agent began and never ended: what it sent is removed from the
        store (never marked, so never restorable; but it holds space), and a sealed image is
        pushed again whole afterwards."""
        url = ev.get("store") or self.store_url
        if not url or not job:
            return
        name = os.path.basename(image)
        try:
            from .. import store as store_mod

            store = store_mod.open_store(url)
            if name in [r.name for r in store.images(job)]:  # its marker went in before the kill
                self.journal("uploaded", key=ev.get("key"), image=image, notice=ev.get("notice"), store=url,
                             recovered=True)
                if ev.get("key"):
                    self.registry.update(ev["key"], uploaded=True)
                return
            removed = store.discard_partial(job, name)
        except SnapguardError as e:
            self.log(f"could not remove the unfinished upload of {name} from {url}: {e.failure.message}")
            return
        self.journal("upload_swept", image=image, store=url, removed=removed)
        self.log(f"removed the unfinished upload of {name} from {url} ({removed} part(s))")

    def start_stream(self, key: str, w: dict[str, Any], image: str, notice: str,
                     deadline: float | None = None) -> Any:
        """Start sending the image to the store while CRIU writes it (snapguard.store's
        StreamingPush); None when the store refuses or cannot be reached: the sealed image is then
        pushed after the seal, as a restarted agent does. It ends by the notice's `deadline`."""
        name = os.path.basename(image)
        try:
            from .. import store as store_mod

            store = store_mod.open_store(str(self.store_url))
            epoch = _push_epoch(store, w)
            stream = store.stream(image, w["job"], name=name, epoch=epoch,
                                  progress=store_mod.Progress(callback=self._progress_logger(name)),
                                  deadline_s=left_of(deadline))
        except Exception as e:
            f = failure_from(e)
            self.journal("stream_refused", key=key, image=image, notice=notice, record=f.to_dict())
            self.log(f"{name}: not streamed to {self.store_url} ({f.message}); pushing after the seal")
            return None
        self.journal("upload_started", key=key, image=image, notice=notice, store=self.store_url, streaming=True,
                     epoch=epoch, deadline=deadline)
        return stream

    def finish_stream(self, key: str, w: dict[str, Any], image: str, stream: Any, start: float, notice: str) -> None:
        name = os.path.basename(image)
        try:
            ref = stream.finish()
        except Exception as e:
            self.failed(key, image, e, notice)
            return
        self.journal("uploaded", key=key, image=image, notice=notice, store=self.store_url, streaming=True,
                     seconds=round(time.monotonic() - start, 3), streamed_bytes=stream.streamed_bytes,
                     resent=stream.resent, result={"job": ref.job, "name": ref.name, "epoch": ref.epoch})
        self.registry.update(key, uploaded=True)
        self.log(f"uploaded {name} to {self.store_url}, whole {time.monotonic() - start:.2f} s after the snapshot "
                 f"began ({stream.streamed_bytes >> 20} MiB of it sent while CRIU wrote)")
        self.prune(w["job"])

    def failed(self, key: str, image: str, e: Exception, notice: str | None) -> None:
        f = failure_from(e)
        failure = Failure(Reason.AGENT_UPLOAD_FAILED, f"{os.path.basename(image)} to {self.store_url}: {f.message}",
                          evidence={"image": image, "cause": f.reason.name})
        self.journal("upload_failed", key=key, image=image, notice=notice, record=failure.to_dict())
        self.log(failure.message)

    def prune(self, job: str) -> None:
        if not self.keep or not self.store_url:
            return
        try:
            from .. import store as store_mod

            gone = store_mod.open_store(self.store_url).prune(job, self.keep)
        except SnapguardError as e:
            self.log(f"could not prune job {job} in {self.store_url}: {e.failure.message}")
            return
        if gone:
            self.journal("pruned", job=job, store=self.store_url, images=gone)
            self.log(f"pruned {len(gone)} older image(s) of job {job} from {self.store_url}")

    def _progress_logger(self, name: str) -> Callable[[dict[str, Any]], None]:
        def report(state: dict[str, Any]) -> None:
            eta = f", ETA {state['eta_s']:.0f} s" if state.get("eta_s") is not None else ""
            self.log(f"uploading {name}: {state['bytes'] >> 20}/{state['total'] >> 20} MiB, "
                     f"{state['rate_bps'] / 2**20:.0f} MiB/s{eta}")
        return report

    def upload(self, key: str, w: dict[str, Any], deadline: float | None = None) -> None:
        """Push the sealed image `w["image"]` whole (never one without its completion marker), by
        the notice's `deadline` (wall clock; None: the store's own deadlines)."""
        image = w["image"]
        name = os.path.basename(image)
        if not marked(image):  # never upload what is not whole
            self.discard(image, "no completion marker at upload")
            return
        notice = w.get("notice")  # the notice it was taken for (the registry keeps it over a restart)
        try:
            import importlib

            store_mod = importlib.import_module("snapguard.store")
        except ImportError as e:
            failure = Failure(Reason.AGENT_UPLOAD_FAILED, f"snapguard.store is not available ({e}); the sealed image "
                              f"stays at {image}", evidence={"image": image})
            self.journal("upload_skipped", key=key, image=image, notice=notice, record=failure.to_dict())
            self.log(failure.message)
            return
        self.journal("upload_started", key=key, image=image, notice=notice, store=self.store_url, deadline=deadline)
        last = [0.0]

        def progress(*args: Any, **kw: Any) -> None:
            if time.monotonic() - last[0] >= 1.0:
                last[0] = time.monotonic()
                self.log(f"uploading {name}: {' '.join(map(str, args))} {kw or ''}".rstrip())

        start = time.monotonic()
        try:
            store = store_mod.open_store(self.store_url)
            out = _put(store_mod, store, image, w, name, progress, left_of(deadline))
        except Exception as e:
            self.failed(key, image, e, notice)
            return
        self.journal("uploaded", key=key, image=image, notice=notice, store=self.store_url,
                     seconds=round(time.monotonic() - start, 3),
                     result=out if isinstance(out, (str, int, float, dict, list, type(None))) else str(out))
        self.registry.update(key, uploaded=True)
        self.log(f"uploaded {name} to {self.store_url} in {time.monotonic() - start:.2f} s")
        self.prune(w["job"])
