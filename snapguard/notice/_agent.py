"""The node agent: on a reclaim notice, one stopping snapshot of each registered workload.

State, all in `<state_dir>/agent` (0700, root's): `registry.json` (the protected workloads, what
`snapguard protect` adds), `notices.json` (every notice id seen, written BEFORE acting on it, so a
notice read twice, or read again by a restarted agent, is acted on once), `journal.jsonl` (one
fsynced JSON line per step: noticed, snapshot started for a workload into an image dir, sealed,
failed, discarded, upload started, uploaded), `inbox/` (what `snapguard notice` writes) and, unless
`images` names another place, `images/`.

Restart: an agent killed mid-snapshot leaves a journal whose last word on an image is "started".
The restarted agent kills whatever still runs on that image (CRIU runs in a process group of its
own and outlives its parent: found by its `--images-dir` argument), brings the workload's CUDA
processes back to running, and then: an image with the completion marker is whole (the marker is
written last) and counts as sealed; one without it is discarded, never uploaded or marked. A
workload still running is snapshotted again while its notice is open; one that is gone (CRIU
finished the dump and ended it, but the seal never happened) is recorded as lost with
AGENT_SNAPSHOT_INTERRUPTED and its file checkpoint named as the fallback.

Warm host checks: a running agent keeps the snapshot's host checks (privileges, CRIU, the network
lock, the CUDA plugin: `preflight.host_checks_ahead`) fresh in a thread of its own (`WarmHostChecks`,
at start and then every `host_checks_every_s`), and the snapshot it takes on a notice reuses those
that passed when they are at most `host_checks_max_age_s` old; an older or missing result means the
snapshot runs them itself. NVML's inventory is always read anew (it names the CUDA pids), by the
snapshot alone: the agent does not call NVML between notices, it only reads libcuda's symbols
once, ahead, for the snapshot's NVML check.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import re
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from .. import files
from ..config import Config
from ..names import MARKER_NAME
from ..reasons import Failure, Reason, SnapguardError, failure_from
from ._sources import Local, Notice, Source

if TYPE_CHECKING:
    from ..preflight import HostChecks

__all__ = ["Agent", "ImageStore", "Registry", "WarmHostChecks", "agent_dir", "post_notice", "read_journal"]

JOURNAL = "journal.jsonl"
REGISTRY = "registry.json"
NOTICES = "notices.json"
INBOX = "inbox"
IMAGES = "images"


class ImageStore(Protocol):
    """What the agent needs of snapguard.store's Store (`open_store(url)`)."""

    def put_image(self, image_dir: str, job: str, name: str, progress: Callable[..., Any] | None = None) -> Any: ...


def _push_epoch(store: Any, w: dict[str, Any]) -> int:
    """The fencing epoch a workload's image is pushed under: its own (`protect --epoch`), else the
    job's current one in the store (a newer epoch taken by a replacement refuses the push with
    FENCED)."""
    epoch = w.get("epoch")
    return store.current_epoch(w["job"]) if epoch is None else int(epoch)


def _put(store_mod: Any, store: Any, image: str, w: dict[str, Any], name: str, progress: Callable[..., Any]) -> Any:
    """Put a sealed image through whichever face the store has: `put_image(dir, job, name,
    progress)` (the ImageStore protocol) or snapguard.store's `push(dir, job, name=, epoch=,
    progress=Progress)` under the workload's fencing epoch (`_push_epoch`)."""
    if hasattr(store, "put_image"):
        return store.put_image(image, w["job"], name, progress=progress)
    ref = store.push(image, w["job"], name=name, epoch=_push_epoch(store, w),
                     progress=store_mod.Progress(callback=lambda state: progress(state)))
    return {"job": ref.job, "name": ref.name, "complete": ref.complete, "epoch": ref.epoch}


def agent_dir(config: Config) -> str:
    return files.ensure_private_dir(os.path.join(config.state_dir, "agent"))


def _read_json(path: str, default: Any) -> Any:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return default
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"{path} is not private to this user: refusing to read it",
                                 evidence={"path": path})
        try:
            return json.loads(f.read())
        except ValueError as e:
            raise SnapguardError(Reason.CONFIG_INVALID, f"{path} is not JSON ({e})", evidence={"path": path}) from None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22): a pid plus it names one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 and fields[0] != b"Z" else None


def _safe(text: str, n: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:n]


def _marked(image: str) -> bool:
    return os.path.isfile(os.path.join(image, MARKER_NAME)) and not os.path.islink(os.path.join(image, MARKER_NAME))


class Registry:
    """The protected workloads: {key: entry}; keys `pid:P` and `container:ID`."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, REGISTRY)

    def load(self) -> dict[str, dict[str, Any]]:
        doc = _read_json(self.path, {"workloads": {}})
        return dict(doc.get("workloads") or {})

    def save(self, workloads: dict[str, dict[str, Any]]) -> None:
        files.write_private_json(self.path, {"workloads": workloads})

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, dict[str, Any]]]:
        """Read-modify-write under a flock: `snapguard protect` and the agent edit it concurrently."""
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            w = self.load()
            yield w
            self.save(w)
        finally:
            os.close(fd)

    def update(self, key: str, **changes: Any) -> None:
        with self._locked() as w:
            if key in w:
                w[key].update(changes)

    def add_pid(self, pid: int, job: str, file_checkpoint: str | None, epoch: int | None = None) -> dict[str, Any]:
        start = _start_time(pid)
        if start is None:
            raise SnapguardError(Reason.PROCESS_NOT_FOUND, f"no running process {pid}", evidence={"pid": pid})
        entry = {"kind": "pid", "pid": pid, "start_time": start, "job": job, "file_checkpoint": file_checkpoint,
                 "epoch": epoch, "state": "protected", "added": time.time()}
        return self._add(f"pid:{pid}", entry)

    def add_container(self, cid: str, root: str | None, job: str, file_checkpoint: str | None,
                      epoch: int | None = None) -> dict[str, Any]:
        entry = {"kind": "container", "container": cid, "root": root, "job": job, "file_checkpoint": file_checkpoint,
                 "epoch": epoch, "state": "protected", "added": time.time()}
        return self._add(f"container:{cid}", entry)

    def _add(self, key: str, entry: dict[str, Any]) -> dict[str, Any]:
        if not entry["job"] or "/" in entry["job"] or entry["job"].startswith("."):
            raise SnapguardError(Reason.USAGE_ERROR, f"--job {entry['job']!r}: a name without '/', not starting with '.'")
        with self._locked() as w:
            w[key] = {**entry, "key": key}
            return w[key]

    def remove(self, key: str) -> bool:
        with self._locked() as w:
            return w.pop(key, None) is not None


def read_journal(directory: str) -> list[dict[str, Any]]:
    """The agent's journal in `directory` (`<state_dir>/agent`), one dict per line, oldest first."""
    try:
        with open(os.path.join(directory, JOURNAL), "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line torn by a kill mid-write
    return out


def post_notice(config: Config, reason: str, *, notice_id: str | None = None, lead_s: float | None = None) -> str:
    """`snapguard notice`: put a notice in the agent's inbox (atomic: a temporary file, renamed)."""
    inbox = files.ensure_private_dir(os.path.join(agent_dir(config), INBOX))
    nid = notice_id or uuid.uuid4().hex
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", nid):
        raise SnapguardError(Reason.USAGE_ERROR, f"--id {nid!r}: letters, digits and _.:- only")
    doc = {"id": nid, "reason": reason, "time": time.time(), "by_uid": os.getuid(),
           "deadline": None if lead_s is None else time.time() + lead_s}
    path = os.path.join(inbox, f"{_safe(nid, 128)}.json")
    files.write_private_json(path, doc)
    return path


def _stray_processes(image: str) -> list[int]:
    """Processes (CRIU, a wrapper, runc) that name `image` as an argument: left by a killed agent."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if image.encode() in argv:
            found.append(int(name))
    return found


def _end_strays(image: str, wait_s: float = 10.0) -> list[int]:
    strays = _stray_processes(image)
    own = os.getpgrp()
    for pid in strays:
        try:
            pgid = os.getpgid(pid)
            os.killpg(pgid, signal.SIGKILL) if pgid != own else os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + wait_s
    while strays and time.monotonic() < end and any(os.path.exists(f"/proc/{p}") and _start_time(p) is not None
                                                     for p in strays):
        time.sleep(0.05)
    return strays


HOST_CHECKS_EVERY_S = 60.0


def _warm_run(config: Config) -> HostChecks:
    """The host checks a snapshot may reuse, less NVML's inventory (it never reuses that one: the
    agent does not call NVML between notices); libcuda's checkpoint symbols, which the snapshot's
    NVML check reads, are read here once (remembered per file identity in this process)."""
    from .. import pipeline, preflight
    from ..cuda import find_libcuda, libcuda_checkpoint_symbols

    value = preflight.host_checks_ahead(config, leave=pipeline.FRESH_HOST_CHECKS)
    libcuda = find_libcuda()
    if libcuda is not None:
        with contextlib.suppress(OSError, ValueError):  # the snapshot's own check says what is wrong
            libcuda_checkpoint_symbols(libcuda)
    return value


class WarmHostChecks:
    """The snapshot's host checks (`preflight.host_checks_ahead`) kept warm for a notice: run in a
    daemon thread at `start()`, then every `every_s`; `latest()` hands the newest result no older
    than `max_age_s` (default twice `every_s`; age from when the checks began), else None, and
    never waits for a run under way (a lock held only to read or swap the result). A run that
    raises leaves the previous result to age out. No run starts while `acting()` (a snapshot
    under way); each child a run starts keeps its own deadline, so `stop()` waits at most
    `wait_s` for one under way, and the thread (a daemon) ends with the agent in any case."""

    THREAD = "snapguard warm host-checks"

    def __init__(self, config: Config, every_s: float = HOST_CHECKS_EVERY_S, max_age_s: float | None = None, *,
                 run: Callable[[Config], HostChecks] | None = None,
                 said: Callable[[HostChecks | None, str | None], None] | None = None) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, not {every_s}")
        self.config = config
        self.every_s = every_s
        self.max_age_s = 2 * every_s if max_age_s is None else max_age_s
        self._run = run
        self._said = said  # after each run: (its result, None) or (None, why it did not run)
        self._lock = threading.Lock()
        self._value: HostChecks | None = None
        self._stop = threading.Event()
        self._acting = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.THREAD, daemon=True)
        self._thread.start()

    def stop(self, wait_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @contextlib.contextmanager
    def acting(self) -> Iterator[None]:
        """While a notice is acted on: no new run starts (one under way finishes)."""
        self._acting.set()
        try:
            yield
        finally:
            self._acting.clear()

    def latest(self) -> HostChecks | None:
        with self._lock:
            value = self._value
        return value if value is not None and value.age_s() <= self.max_age_s else None

    def refresh(self) -> HostChecks | None:
        """One run, now, in the caller's thread; its result (None when it raised)."""
        try:
            value = (self._run or _warm_run)(self.config)
        except Exception as e:  # noqa: BLE001 - the snapshot then runs the checks itself, typed as ever
            self.runs += 1
            if self._said is not None:
                self._said(None, failure_from(e).message)
            return None
        with self._lock:
            self._value = value
        self.runs += 1
        if self._said is not None:
            self._said(value, None)
        return value

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._acting.is_set():
                self._stop.wait(0.2)
                continue
            self.refresh()
            self._stop.wait(self.every_s)


class Agent:
    def __init__(self, config: Config, sources: list[Source], *, store_url: str | None = None,
                 images: str | None = None, interval_s: float = 5.0,
                 log: Callable[[str], None] | None = None, containerd: Any = None,
                 keep: int | None = None, host_checks_every_s: float | None = HOST_CHECKS_EVERY_S,
                 host_checks_max_age_s: float | None = None) -> None:
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
        self.keep = keep  # after an upload, the job's older images beyond this many whole ones are pruned
        self._skipped_said: set[str] = set()
        # the snapshot's host checks, kept warm while the agent runs (None: off, or --once)
        self.host_checks_every_s = host_checks_every_s
        self.host_checks_max_age_s = host_checks_max_age_s
        self.warm: WarmHostChecks | None = None
        self._host_checks_said: tuple[tuple[str, str], ...] | str | None = None

    # -- plumbing --------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        self._log(f"snapguard agent: {text}")

    def journal(self, event: str, **fields: Any) -> None:
        line = (json.dumps({"t": round(time.time(), 3), "event": event, **fields}, sort_keys=True, default=str)
                + "\n").encode()
        fd = os.open(os.path.join(self.dir, JOURNAL), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_journal(self) -> list[dict[str, Any]]:
        return read_journal(self.dir)

    def _notices(self) -> dict[str, Any]:
        return _read_json(os.path.join(self.dir, NOTICES), {})

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
        """Settle what a previous agent left half done (see the module's docstring)."""
        last: dict[str, dict[str, Any]] = {}  # the last snapshot event of each image
        streaming: dict[str, dict[str, Any]] = {}  # images whose upload began and did not end
        jobs: dict[str, str] = {}
        for ev in self.read_journal():
            image = ev.get("image")
            if not image:
                continue
            if ev["event"] in ("snapshot_started", "snapshot_sealed", "snapshot_failed", "snapshot_interrupted",
                               "discarded"):
                last[image] = ev
            if ev["event"] == "snapshot_started" and ev.get("job"):
                jobs[image] = ev["job"]
            if ev["event"] == "upload_started":
                streaming[image] = ev
            elif ev["event"] in ("uploaded", "upload_failed", "upload_aborted", "upload_swept"):
                streaming.pop(image, None)
        for image, ev in streaming.items():
            self._sweep_upload(image, jobs.get(image), ev)
        workloads = self.registry.load()
        for image, ev in last.items():
            if ev["event"] != "snapshot_started":
                continue
            strays = _end_strays(image)
            entry = workloads.get(ev.get("key", ""), {})
            self._bring_back(entry)
            if os.path.isdir(image) and _marked(image):
                self.journal("snapshot_sealed", key=ev.get("key"), image=image, notice=ev.get("notice"), recovered=True)
                self.registry.update(ev["key"], state="snapshotted", image=image, uploaded=False)
                self.log(f"recovered: the image {image} of {ev.get('key')} was sealed before the restart")
                continue
            self._discard(image, "no completion marker: the agent stopped mid-snapshot")
            intact = self._alive(entry)
            failure = Failure(Reason.AGENT_SNAPSHOT_INTERRUPTED,
                              f"{ev.get('key')}: the agent stopped while snapshotting into {image}; "
                              + ("the workload still runs and is snapshotted again while its notice is open"
                                 if intact else "the workload is gone; resume it from its file checkpoint "
                                 f"{entry.get('file_checkpoint') or '(none registered)'}"),
                              workload_intact=intact, evidence={"image": image, "strays_killed": strays})
            self.journal("snapshot_interrupted", key=ev.get("key"), notice=ev.get("notice"), record=failure.to_dict())
            self.log(failure.message)
            if not intact and ev.get("key") in workloads:
                self.registry.update(ev["key"], state="lost", reason=failure.reason.name)
        # an unmarked image nobody journalled (killed between mkdir and the journal line): never kept
        for name in os.listdir(self.images):
            path = os.path.join(self.images, name)
            if os.path.isdir(path) and not os.path.islink(path) and not _marked(path):
                self._discard(path, "no completion marker")
        # notices whose handling did not finish: act again (workloads already snapshotted are skipped)
        for nid, rec in self._notices().items():
            if rec.get("status") != "done":
                self.log(f"notice {nid} was not finished before the restart: acting on it again")
                self._queue.put(Notice.from_dict(rec["notice"]))
        if self.store_url:
            for key, w in self.registry.load().items():
                if w.get("state") == "snapshotted" and not w.get("uploaded") and w.get("image") and _marked(w["image"]):
                    self._upload(key, w)

    def _sweep_upload(self, image: str, job: str | None, ev: dict[str, Any]) -> None:
        """An upload the previous agent began and never ended: what it sent is removed from the
        store (never marked, so never restorable; but it holds space), and a sealed image is
        pushed again whole below."""
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

    def _bring_back(self, entry: dict[str, Any]) -> None:
        """After a killed snapshot: a container CRIU froze is thawed, CUDA processes run again."""
        if entry.get("kind") == "container":
            from .. import pipeline

            runner = pipeline.RuncRunner(self.config.runc, [], root=entry.get("root"), container_id=entry["container"])
            runner.status_before = "running"
            try:
                runner.after_failed_dump()
            except SnapguardError:
                pass
            return
        pid = entry.get("pid")
        if not pid or not self._alive(entry):
            return
        try:
            from .. import gpu_suspend, procfs

            inv = procfs.inventory(procfs.process_tree(pid))
            cuda = [p.pid for p in inv.cuda_processes()]
            if cuda:
                self.log(f"CUDA processes {cuda} of pid {pid}: {gpu_suspend.resume(cuda)}")
        except Exception as e:  # best effort: the workload itself runs
            self.log(f"could not check CUDA state of pid {pid}: {failure_from(e).message}")

    def _discard(self, image: str, why: str) -> None:
        shutil.rmtree(image, ignore_errors=True)
        self.journal("discarded", image=image, why=why)
        self.log(f"discarded {image}: {why}")

    def _alive(self, entry: dict[str, Any]) -> bool:
        if entry.get("kind") == "pid":
            return _start_time(int(entry["pid"])) == entry.get("start_time")
        if entry.get("kind") == "container":
            from .. import runc

            try:
                return runc.state(self.config.runc, entry.get("root"), entry["container"]).get("status") in (
                    "running", "paused")
            except SnapguardError:
                return False
        return False

    # -- containers annotated through containerd -----------------------------------------------
    def sync_containers(self) -> None:
        """Bring the registry in line with containerd: every running container annotated
        `snapguard.io/job` protected, the ones this sync added and whose task is gone dropped.
        Entries `snapguard protect` made are never touched."""
        if self.containerd is None:
            return
        try:
            entries, skipped = self.containerd.annotated()
        except SnapguardError as err:
            self._note_source("containerd", err.failure.message)
            return
        self._note_source("containerd", None)
        for line in skipped:
            if line not in self._skipped_said:
                self._skipped_said.add(line)
                self.log(f"containerd: not protected: {line}")
        added, dropped = [], []
        with self.registry._locked() as w:
            listed = set()
            for e in entries:
                key = f"container:{e['container']}"
                listed.add(key)
                cur = w.get(key)
                fields = {k: e[k] for k in ("root", "job", "file_checkpoint", "epoch", "namespace")}
                if cur is None:
                    w[key] = {"kind": "container", "container": e["container"], **fields, "state": "protected",
                              "added": time.time(), "source": "containerd", "key": key}
                    added.append(key)
                elif cur.get("source") == "containerd" and cur.get("state") == "protected":
                    cur.update(fields)
            for key, cur in list(w.items()):
                if cur.get("source") == "containerd" and cur.get("state") == "protected" and key not in listed:
                    del w[key]
                    dropped.append(key)
        for key in added:
            self.journal("protected", key=key, source="containerd")
            self.log(f"{key} protected: annotated snapguard.io/job in containerd")
        for key in dropped:
            self.journal("unprotected", key=key, source="containerd", why="its task no longer runs")

    # -- acting on a notice ----------------------------------------------------------------------
    def handle(self, notice: Notice) -> bool:
        """Act on a notice once: False when its id was seen before and its handling finished."""
        seen = self._notices()
        rec = seen.get(notice.id)
        self._consume_inbox(notice)
        if rec is not None and rec.get("status") == "done":
            self.log(f"notice {notice.id} seen before: nothing to do")
            return False
        if rec is None:
            seen[notice.id] = {"notice": notice.to_dict(), "status": "acting", "first_seen": time.time()}
            self._save_notices(seen)  # before acting: a restart must not act on it as new
            self.journal("noticed", notice=notice.id, source=notice.source, kind=notice.kind, detail=notice.detail,
                         deadline=notice.deadline, lead_s=notice.lead_s)
            lead = f", {notice.lead_s:.0f} s left" if notice.lead_s is not None else ""
            self.log(f"notice {notice.id} from {notice.source}: {notice.detail}{lead}")
        with self.warm.acting() if self.warm is not None else contextlib.nullcontext():
            self._act(notice)
        seen = self._notices()
        seen[notice.id]["status"] = "done"
        seen[notice.id]["done"] = time.time()
        self._save_notices(seen)
        self.journal("notice_done", notice=notice.id)
        return True

    def _act(self, notice: Notice) -> None:
        self.sync_containers()  # what runs now, not what ran at the last sync
        for key, w in sorted(self.registry.load().items()):
            if w.get("state") != "protected":
                continue
            if not self._alive(w):
                self.journal("workload_gone", key=key, notice=notice.id)
                self.registry.update(key, state="gone")
                self.log(f"{key} (job {w.get('job')}) no longer runs: not snapshotted")
                continue
            image = self._snapshot(key, w, notice)
            if image and self.store_url and not self.registry.load().get(key, {}).get("uploaded"):
                self._upload(key, {**w, "image": image, "notice": notice.id})  # not streamed, or it failed: whole

    def _consume_inbox(self, notice: Notice) -> None:
        path = (notice.raw or {}).get("path") if notice.source == "local" and isinstance(notice.raw, dict) else None
        if path and os.path.dirname(path) == self.inbox:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _runner(self, w: dict[str, Any], image: str) -> Any:
        from .. import pipeline

        if w["kind"] == "pid":
            return pipeline.CriuRunner(self.config.criu, int(w["pid"]))
        from .. import runc

        root = w.get("root")
        args = [*(["--root", root] if root else []), "checkpoint", "--image-path", image, "--work-path", image,
                w["container"]]
        if runc.version(self.config.runc, self.config.state_dir) < runc.CRIU_BY_PATH:
            args = ["--criu", self.config.criu, *args]
        return pipeline.RuncRunner(self.config.runc, args, root=root, container_id=w["container"])

    def _snapshot(self, key: str, w: dict[str, Any], notice: Notice) -> str | None:
        from .. import pipeline

        digest = hashlib.sha256(notice.id.encode()).hexdigest()[:12]
        name = f"{_safe(w['job'])}-{_safe(key.replace(':', '-'))}-{digest}"
        image = os.path.join(self.images, name)
        if os.path.lexists(image):
            if _marked(image):
                self.registry.update(key, state="snapshotted", image=image, uploaded=False)
                return image
            self._discard(image, "an unmarked image of an earlier attempt")
        self.journal("snapshot_started", key=key, image=image, notice=notice.id, job=w["job"])
        self.log(f"snapshotting {key} (job {w['job']}) into {image}, stopping it")
        start = time.monotonic()
        stream = None
        try:
            files.ensure_private_dir(image)
            stream = self._start_stream(key, w, image, notice.id) if self.store_url else None
            req = pipeline.Request(image, leave_running=False, timeouts=pipeline.Timeouts.from_config(self.config))
            warm = self.warm.latest() if self.warm is not None else None  # never waits for a run
            result = pipeline.checkpoint(self._runner(w, image), req, self.config, host_checks=warm)
        except Exception as e:
            if stream is not None:
                stream.abort()
                self.journal("upload_aborted", key=key, image=image, notice=notice.id)
            failure = failure_from(e)
            if os.path.isdir(image) and not _marked(image):
                self._discard(image, f"snapshot failed: {failure.reason.name}")
            intact = self._alive(w)
            self.journal("snapshot_failed", key=key, image=image, notice=notice.id,
                         record={**failure.to_dict(), "workload_intact": intact})
            self.log(f"{key} not snapshotted ({'still running' if intact else 'gone'}): {failure.message}")
            if not intact:
                self.registry.update(key, state="lost", reason=failure.reason.name)
            return None
        took = time.monotonic() - start
        self.journal("snapshot_sealed", key=key, image=image, notice=notice.id, seconds=round(took, 3),
                     image_bytes=result.get("image_bytes"), timings=result.get("timings"),
                     criu_marks=result.get("criu_marks"))
        self.registry.update(key, state="snapshotted", image=image, uploaded=False, notice=notice.id)
        age = (result.get("timings") or {}).get("host_checks_age_s")
        self.log(f"image sealed at {image} ({result.get('image_bytes', 0) / 1e6:.1f} MB, {took:.2f} s"
                 + (f", host checks of {age:.0f} s ago reused)" if age is not None else ")"))
        if stream is not None:
            self._finish_stream(key, w, image, stream, start, notice.id)
        return image

    def _start_stream(self, key: str, w: dict[str, Any], image: str, notice: str) -> Any:
        """Start sending the image to the store while CRIU writes it (snapguard.store's
        StreamingPush); None when the store refuses or cannot be reached: the sealed image is then
        pushed after the seal, as a restarted agent does."""
        name = os.path.basename(image)
        try:
            from .. import store as store_mod

            store = store_mod.open_store(str(self.store_url))
            epoch = _push_epoch(store, w)
            stream = store.stream(image, w["job"], name=name, epoch=epoch,
                                  progress=store_mod.Progress(callback=self._progress_logger(name)))
        except Exception as e:
            f = failure_from(e)
            self.journal("stream_refused", key=key, image=image, notice=notice, record=f.to_dict())
            self.log(f"{name}: not streamed to {self.store_url} ({f.message}); pushing after the seal")
            return None
        self.journal("upload_started", key=key, image=image, notice=notice, store=self.store_url, streaming=True,
                     epoch=epoch)
        return stream

    def _finish_stream(self, key: str, w: dict[str, Any], image: str, stream: Any, start: float, notice: str) -> None:
        name = os.path.basename(image)
        try:
            ref = stream.finish()
        except Exception as e:
            self._upload_failed(key, image, e, notice)
            return
        self.journal("uploaded", key=key, image=image, notice=notice, store=self.store_url, streaming=True,
                     seconds=round(time.monotonic() - start, 3), streamed_bytes=stream.streamed_bytes,
                     resent=stream.resent, result={"job": ref.job, "name": ref.name, "epoch": ref.epoch})
        self.registry.update(key, uploaded=True)
        self.log(f"uploaded {name} to {self.store_url}, whole {time.monotonic() - start:.2f} s after the snapshot "
                 f"began ({stream.streamed_bytes >> 20} MiB of it sent while CRIU wrote)")
        self._prune(w["job"])

    def _upload_failed(self, key: str, image: str, e: Exception, notice: str | None) -> None:
        f = failure_from(e)
        failure = Failure(Reason.AGENT_UPLOAD_FAILED, f"{os.path.basename(image)} to {self.store_url}: {f.message}",
                          evidence={"image": image, "cause": f.reason.name})
        self.journal("upload_failed", key=key, image=image, notice=notice, record=failure.to_dict())
        self.log(failure.message)

    def _prune(self, job: str) -> None:
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

    def _upload(self, key: str, w: dict[str, Any]) -> None:
        image = w["image"]
        name = os.path.basename(image)
        if not _marked(image):  # never upload what is not whole
            self._discard(image, "no completion marker at upload")
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
        self.journal("upload_started", key=key, image=image, notice=notice, store=self.store_url)
        last = [0.0]

        def progress(*args: Any, **kw: Any) -> None:
            if time.monotonic() - last[0] >= 1.0:
                last[0] = time.monotonic()
                self.log(f"uploading {name}: {' '.join(map(str, args))} {kw or ''}".rstrip())

        start = time.monotonic()
        try:
            store = store_mod.open_store(self.store_url)
            out = _put(store_mod, store, image, w, name, progress)
        except Exception as e:
            self._upload_failed(key, image, e, notice)
            return
        self.journal("uploaded", key=key, image=image, notice=notice, store=self.store_url,
                     seconds=round(time.monotonic() - start, 3),
                     result=out if isinstance(out, (str, int, float, dict, list, type(None))) else str(out))
        self.registry.update(key, uploaded=True)
        self.log(f"uploaded {name} to {self.store_url} in {time.monotonic() - start:.2f} s")
        self._prune(w["job"])

    # -- polling ---------------------------------------------------------------------------------
    def _note_source(self, name: str, error: str | None) -> None:
        if self._source_state.get(name, "") != error:
            self._source_state[name] = error
            self.log(error if error else f"source {name} answers")
            self.journal("source", source=name, error=error)

    def poll_once(self) -> list[Notice]:
        """Each source once (each bounded by the interval): the notices read. Errors are logged."""
        notices = []
        for src in self.sources:
            try:
                n = src.poll(time.monotonic() + max(self.interval_s, 1.0))
            except Exception as e:
                self._note_source(src.name, failure_from(e).message)
                continue
            self._note_source(src.name, None)
            if n is not None:
                notices.append(n)
        return notices

    def _watch(self, src: Source) -> None:
        last_id = None  # a source answers the same notice on every poll: queued once (handle dedupes too)
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                n = src.poll(start + max(self.interval_s, 1.0))
            except Exception as e:
                self._note_source(src.name, failure_from(e).message)
                n = None
            else:
                self._note_source(src.name, None)
            if n is not None and (n.id != last_id or src.name == "local"):  # the inbox file goes once handled
                last_id = n.id
                self._queue.put(n)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - start)))

    def run(self, once: bool = False) -> int:
        self.lock()
        self.journal("agent_started", pid=os.getpid(), sources=[s.name for s in self.sources], store=self.store_url)
        self.log(f"started (pid {os.getpid()}), sources {', '.join(s.name for s in self.sources) or 'none'}, "
                 f"store {self.store_url or 'none: images stay in ' + self.images}")
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


def local_source(config: Config) -> Local:
    return Local(os.path.join(agent_dir(config), INBOX))
