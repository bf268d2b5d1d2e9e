"""The node agent: on a reclaim notice, one stopping snapshot of each registered workload.

State, all in `<state_dir>/agent` (0700, root's; snapguard.notice._state): `registry.json` (the
protected workloads, what `snapguard protect` adds), `notices.json` (every notice id seen, written
BEFORE acting on it, so a notice read twice, or read again by a restarted agent, is acted on once),
`journal.jsonl` (one fsynced JSON line per step: noticed, snapshot started for a workload into an
image dir, sealed, failed, discarded, upload started, uploaded), `inbox/` (what `snapguard notice`
writes) and, unless `images` names another place, `images/`.

Restart (`_recover`): an agent killed mid-snapshot is settled by the next one before it acts.
Uploads (`_upload`): with a store URL, each sealed image goes to the store, streamed while CRIU
writes when the store allows it.

Warm host checks (`_warm`): a running agent keeps the snapshot's host checks (privileges, CRIU, the
network lock, the CUDA plugin: `preflight.host_checks_ahead`) fresh in a thread of its own (at
start and then every `host_checks_every_s`), and the snapshot it takes on a notice reuses those
that passed when they are at most `host_checks_max_age_s` old; an older or missing result means the
snapshot runs them itself. NVML's inventory is always read anew (it names the CUDA pids), by the
snapshot alone: the agent does not call NVML between notices, it only reads libcuda's symbols
once, ahead, for the snapshot's NVML check.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import files, tally
from ..config import Config
from ..reasons import Failure, Reason, SnapguardError, failure_from
from ._recover import recover
from ._schedule import measured_rate, schedule
from ._sources import Notice, Source
from ._state import (IMAGES, INBOX, NOTICES, Registry, agent_dir, append_journal, marked, read_journal,
                     read_private_json, safe_name)
from ._targets import target_for
from ._upload import Uploads
from ._warm import HOST_CHECKS_EVERY_S, WarmHostChecks
from ._workload import alive, runner

if TYPE_CHECKING:
    from ..preflight import HostChecks

__all__ = ["Agent"]


class Agent:
    """The agent of one state directory: its sources watched, each notice acted on once."""

    def __init__(self, config: Config, sources: list[Source], *, store_url: str | None = None,
                 images: str | None = None, interval_s: float = 5.0,
                 log: Callable[[str], None] | None = None, containerd: Any = None, cri: Any = None,
                 keep: int | None = None, host_checks_every_s: float | None = HOST_CHECKS_EVERY_S,
                 host_checks_max_age_s: float | None = None, workers: int | None = None,
                 metrics_path: str | None = None) -> None:
        self.config = config
        self.dir = agent_dir(config)
        self.images = files.ensure_private_dir(images or os.path.join(self.dir, IMAGES))
        self.inbox = files.ensure_private_dir(os.path.join(self.dir, INBOX))
        self.sources = sources
        self.store_url = store_url
        self.interval_s = interval_s
        self.registry = Registry(self.dir)
        self._log = log or (lambda line: print(line, flush=True))
        self._queue: queue.Queue[Notice] = queue.Queue()
        self._stop = threading.Event()
        self._source_state: dict[str, str | None] = {}
        self._lock_fd: int | None = None
        self.containerd = containerd  # a _containerd.ContainerdWatch: annotated containers join the registry
        self.cri = cri  # a _cripods.CriPods: opted-in pods join the registry as kind `pod` (the CRI path)
        self.metrics_path = metrics_path  # the store's probe gauge (a Prometheus textfile)
        self.workers = workers  # snapshots at once on a notice (None: snapguard.notice._schedule.pool_size)
        self.keep = keep  # after an upload, the job's older images beyond this many whole ones are pruned
        self._skipped_said: set[str] = set()
        # the snapshot's host checks, kept warm while the agent runs (None: off, or --once)
        self.host_checks_every_s = host_checks_every_s
        self.host_checks_max_age_s = host_checks_max_age_s
        self.warm: WarmHostChecks | None = None
        self._host_checks_said: tuple[tuple[str, str], ...] | str | None = None
        self.uploads = Uploads(store_url, keep, journal=self.journal, log=self.log, registry=self.registry,
                               discard=self.discard)

    # -- plumbing --------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        self._log(f"snapguard agent: {text}")

    def journal(self, event: str, **fields: Any) -> None:
        append_journal(self.dir, event, **fields)

    def read_journal(self) -> list[dict[str, Any]]:
        return read_journal(self.dir)

    def notices(self) -> dict[str, Any]:
        return read_private_json(os.path.join(self.dir, NOTICES), {})

    def _save_notices(self, seen: dict[str, Any]) -> None:
        files.write_private_json(os.path.join(self.dir, NOTICES), seen)

    def lock(self) -> None:
        """One agent per state dir (flock: a killed agent lets go by itself)."""
        fd = os.open(os.path.join(self.dir, "agent.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise SnapguardError(Reason.USAGE_ERROR, f"another snapguard agent runs on {self.dir}") from None
        self._lock_fd = fd

    # -- restart ---------------------------------------------------------------------------------
    def recover(self) -> None:
        """Settle what a previous agent left half done (snapguard.notice._recover)."""
        recover(self)

    def requeue(self, notice: Notice) -> None:
        """Act on `notice` again (one whose handling a previous agent did not finish)."""
        self._queue.put(notice)

    def discard(self, image: str, why: str) -> None:
        shutil.rmtree(image, ignore_errors=True)
        self.journal("discarded", image=image, why=why)
        self.log(f"discarded {image}: {why}")

    # -- containers annotated through containerd -----------------------------------------------
    def sync_containers(self) -> None:
        """Bring the registry in line with containerd and CRI: every running container annotated
        `snapguard.io/job` protected (kind `container`; with the CRI path, the opted-in pods'
        containers as kind `pod`), the ones a sync added and whose task is gone dropped. Entries
        `snapguard protect` made are never touched."""
        watches = [(name, kind, w) for name, kind, w in (("cri", "pod", self.cri),
                                                          ("containerd", "container", self.containerd)) if w is not None]
        for name, kind, watch in watches:
            try:
                entries, skipped = watch.opted_in() if kind == "pod" else watch.annotated()
            except SnapguardError as err:
                self._note_source(name, err.failure.message)
                continue
            self._note_source(name, None)
            for line in skipped:
                if line not in self._skipped_said:
                    self._skipped_said.add(line)
                    self.log(f"{name}: not protected: {line}")
            self._sync_entries(name, kind, entries)

    def _sync_entries(self, name: str, kind: str, entries: list[dict[str, Any]]) -> None:
        added, dropped = [], []
        with self.registry.locked() as w:
            listed = set()
            for e in entries:
                key = f"{kind}:{e['container']}"
                if kind == "container" and f"pod:{e['container']}" in w:
                    continue  # the CRI path takes this one
                listed.add(key)
                cur = w.get(key)
                fields = {k: v for k, v in e.items() if k != "container"}
                if cur is None:
                    w[key] = {"kind": kind, "container": e["container"], **fields, "state": "protected",
                              "added": time.time(), "source": name, "key": key}
                    added.append(key)
                elif cur.get("source") == name and cur.get("state") == "protected":
                    cur.update(fields)
            for key, cur in list(w.items()):
                if cur.get("source") == name and cur.get("state") == "protected" and key not in listed:
                    del w[key]
                    dropped.append(key)
        for key in added:
            self.journal("protected", key=key, source=name)
            self.log(f"{key} protected: annotated snapguard.io/job in {name}")
        for key in dropped:
            self.journal("unprotected", key=key, source=name, why="its task no longer runs")

    # -- acting on a notice ----------------------------------------------------------------------
    def handle(self, notice: Notice) -> bool:
        """Act on a notice once: False when its id was seen before and its handling finished."""
        seen = self.notices()
        rec = seen.get(notice.id)
        rec = rec if isinstance(rec, dict) else None  # a record of the wrong shape: acted on as new
        self._consume_inbox(notice)
        if rec is not None and rec.get("status") == "done":
            self.log(f"notice {notice.id} seen before: nothing to do")
            return False
        if rec is None:
            seen[notice.id] = {"notice": notice.to_dict(), "status": "acting", "first_seen": time.time()}
            self._save_notices(seen)  # before acting: a restart must not act on it as new
            tally.note(state_dir=self.config.state_dir, source=notice.source)  # snapguard_notices_total
            self.journal("noticed", notice=notice.id, source=notice.source, kind=notice.kind, detail=notice.detail,
                         deadline=notice.deadline, lead_s=notice.lead_s)
            lead = f", {notice.lead_s:.0f} s left" if notice.lead_s is not None else ""
            self.log(f"notice {notice.id} from {notice.source}: {notice.detail}{lead}")
        with self.warm.acting() if self.warm is not None else contextlib.nullcontext():
            self._act(notice)
        seen = self.notices()
        seen[notice.id]["status"] = "done"
        seen[notice.id]["done"] = time.time()
        self._save_notices(seen)
        self.journal("notice_done", notice=notice.id)
        return True

    def _act(self, notice: Notice) -> None:
        """The registry's live workloads snapshotted concurrently within the notice's lead
        (snapguard.notice._schedule), each uploaded after its seal when it was not streamed."""
        self.sync_containers()  # what runs now, not what ran at the last sync
        try:
            workloads = self.registry.load()
        except SnapguardError as e:
            self.journal("registry_refused", notice=notice.id, record=e.failure.to_dict())
            self.log(f"the registry could not be read, nothing snapshotted: snapguard {e.reason.name}: "
                     f"{e.failure.message}")
            return
        for key, why in sorted(self.registry.refused.items()):
            self.journal("registry_entry_refused", notice=notice.id, key=key, why=why)
            self.log(f"registry entry {key} skipped: {why}")
        targets = []
        for key, w in sorted(workloads.items()):
            if w.get("state") != "protected":
                continue
            if not alive(self.config, w):
                self.journal("workload_gone", key=key, notice=notice.id)
                self.registry.update(key, state="gone")
                self.log(f"{key} (job {w.get('job')}) no longer runs: not snapshotted")
                continue
            targets.append(target_for(self, key, w, notice.deadline, self._runner(key, w, notice)))
        if targets:
            outcomes = schedule(targets, notice=notice.id, journal=self.journal, log=self.log,
                                rate_bps=measured_rate(self.read_journal()), workers=self.workers)
            self.uploads.note_outcomes(outcomes)  # the agent's textfile: what fit, what fell back and why

    def _runner(self, key: str, w: dict[str, Any], notice: Notice) -> Callable[[float | None], Failure | None]:
        def run(left: float | None) -> Failure | None:
            image, failure = self._snapshot(key, w, notice)
            if image and self.store_url and not self.registry.load().get(key, {}).get("uploaded"):
                # not streamed, or the stream failed: pushed whole
                self.uploads.upload(key, {**w, "image": image, "notice": notice.id}, notice.deadline)
            return failure
        return run

    def _consume_inbox(self, notice: Notice) -> None:
        path = (notice.raw or {}).get("path") if notice.source == "local" and isinstance(notice.raw, dict) else None
        if path and os.path.dirname(path) == self.inbox:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _snapshot(self, key: str, w: dict[str, Any], notice: Notice) -> tuple[str | None, Failure | None]:
        from .. import pipeline

        digest = hashlib.sha256(notice.id.encode()).hexdigest()[:12]
        name = f"{safe_name(w['job'])}-{safe_name(key.replace(':', '-'))}-{digest}"
        image = os.path.join(self.images, name)
        if os.path.lexists(image):
            if marked(image):
                self.registry.update(key, state="snapshotted", image=image, uploaded=False)
                return image, None
            self.discard(image, "an unmarked image of an earlier attempt")
        self.journal("snapshot_started", key=key, image=image, notice=notice.id, job=w["job"])
        self.log(f"snapshotting {key} (job {w['job']}) into {image}, stopping it")
        start = time.monotonic()
        stream = None
        try:
            files.ensure_private_dir(image)
            stream = self.uploads.start_stream(key, w, image, notice.id, notice.deadline) if self.store_url else None
            req = pipeline.Request(image, leave_running=False, timeouts=pipeline.Timeouts.from_config(self.config))
            warm = self.warm.latest() if self.warm is not None else None  # never waits for a run
            result = pipeline.checkpoint(runner(self.config, w, image), req, self.config, host_checks=warm)
        except Exception as e:
            if stream is not None:
                stream.abort()
                self.journal("upload_aborted", key=key, image=image, notice=notice.id)
            failure = failure_from(e)
            if os.path.isdir(image) and not marked(image):
                self.discard(image, f"snapshot failed: {failure.reason.name}")
            intact = alive(self.config, w)
            self.journal("snapshot_failed", key=key, image=image, notice=notice.id,
                         record={**failure.to_dict(), "workload_intact": intact})
            self.log(f"{key} not snapshotted ({'still running' if intact else 'gone'}): {failure.message}")
            if not intact:
                self.registry.update(key, state="lost", reason=failure.reason.name)
            return None, failure
        took = time.monotonic() - start
        self.journal("snapshot_sealed", key=key, image=image, notice=notice.id, seconds=round(took, 3),
                     image_bytes=result.get("image_bytes"), timings=result.get("timings"),
                     criu_marks=result.get("criu_marks"))
        self.registry.update(key, state="snapshotted", image=image, uploaded=False, notice=notice.id)
        tally.note(state_dir=self.config.state_dir, job=w["job"])  # its last whole snapshot
        age = (result.get("timings") or {}).get("host_checks_age_s")
        self.log(f"image sealed at {image} ({result.get('image_bytes', 0) / 1e6:.1f} MB, {took:.2f} s"
                 + (f", host checks of {age:.0f} s ago reused)" if age is not None else ")"))
        if stream is not None:
            self.uploads.finish_stream(key, w, image, stream, start, notice.id)
        return image, None

    # -- polling ---------------------------------------------------------------------------------
    def _note_source(self, name: str, error: str | None) -> None:
        if self._source_state.get(name, "") != error:
            self._source_state[name] = error
            self.log(error if error else f"source {name} answers")
            self.journal("source", source=name, error=error)

    def _note_refused(self, src: Source) -> None:
        """Journal (and log) what a source refused and went past: a bad inbox entry, a bad event."""
        for r in getattr(src, "take", lambda: [])():
            self.journal("notice_refused", source=src.name, **r)
            self.log(f"source {src.name} refused {r['where']}: snapguard {r['reason']}: {r['detail']}")

    def poll_once(self) -> list[Notice]:
        """Each source once (each bounded by the interval): the notices read. Errors are logged."""
        notices = []
        for src in self.sources:
            try:
                n = src.poll(time.monotonic() + max(self.interval_s, 1.0))
            except Exception as e:
                self._note_source(src.name, failure_from(e).message)
                continue
            finally:
                self._note_refused(src)
            self._note_source(src.name, None)
            if n is not None:
                notices.append(n)
        return notices

    def _watch(self, src: Source) -> None:
        last_id = None  # a source answers the same notice on every poll: queued once (handle dedupes too)
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                # a watch (window_s) holds its connection a round of its own; a poll is bounded by the interval
                n = src.poll(start + max(getattr(src, "window_s", None) or self.interval_s, 1.0))
            except Exception as e:
                self._note_source(src.name, failure_from(e).message)
                n = None
            else:
                self._note_source(src.name, None)
            self._note_refused(src)
            if n is not None and (n.id != last_id or src.name == "local"):  # the inbox file goes once handled
                last_id = n.id
                self._queue.put(n)
            rest = max(0.0, self.interval_s - (time.monotonic() - start))
            wait = getattr(src, "wait", None)  # the inbox wakes its poll as soon as an entry lands
            if wait is not None:
                wait(rest, self._stop)
            else:
                self._stop.wait(rest)

    def run(self, once: bool = False) -> int:
        self.lock()
        self.journal("agent_started", pid=os.getpid(), sources=[s.name for s in self.sources], store=self.store_url)
        self.log(f"started (pid {os.getpid()}), sources {', '.join(s.name for s in self.sources) or 'none'}, "
                 f"store {self.store_url or 'none: images stay in ' + self.images}")
        self.uploads.probe(self.metrics_path or os.path.join(self.dir, "snapguard-agent.prom"))
        self.recover()
        self.sync_containers()
        if once:
            while not self._queue.empty():
                self.handle(self._queue.get())
            for n in self.poll_once():
                self.handle(n)
            return 1 if any(self._source_state.values()) else 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        if self.host_checks_every_s:
            self.warm = WarmHostChecks(self.config, self.host_checks_every_s, self.host_checks_max_age_s,
                                       said=self._note_host_checks)
            self.warm.start()
        for src in self.sources:
            threading.Thread(target=self._watch, args=(src,), name=f"notice-{src.name}", daemon=True).start()
        synced = time.monotonic()
        try:
            while not self._stop.is_set():
                if time.monotonic() - synced >= max(30.0, self.interval_s):
                    self.sync_containers()  # so that `snapguard protect --list` shows them between notices
                    synced = time.monotonic()
                try:
                    n = self._queue.get(timeout=0.5)
                except queue.Empty:
                    continue
                self.handle(n)
        finally:
            if self.warm is not None:
                self.warm.stop()
        self.log("stopping")
        return 0

    def _note_host_checks(self, value: HostChecks | None, error: str | None) -> None:
        """Journal (and log) the warm host checks when what they say changes, not every run."""
        def word(r: Any) -> str:  # ok, warning, or the typed reason it blocks or could not run with
            reason = r.reason or (r.blockers[0].reason if r.blockers else None)
            return str(reason.name) if reason is not None else str(r.status)

        checks = {name: word(result) for name, _, result, _ in value.results} if value is not None else {}
        state: tuple[tuple[str, str], ...] | str = str(error) if value is None else tuple(checks.items())
        if state == self._host_checks_said:
            return
        self._host_checks_said = state
        if value is None:
            self.journal("host_checks", error=error)
            self.log(f"the host checks could not run ahead ({error}); a snapshot runs them itself")
            return
        self.journal("host_checks", checks=checks, seconds=round(value.seconds, 3))
        self.log("host checks kept warm for a notice: " + ", ".join(f"{k} {v}" for k, v in checks.items()))
