"""The agent's state on disk, all in `<state_dir>/agent` (0700, root's): the registry of protected
workloads, the journal, the notices seen, and the inbox `snapguard notice` writes into."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from typing import Any

from .. import files, procfs
from ..config import Config
from ..names import MARKER_NAME
from ..reasons import Reason, SnapguardError
from ._sources import Local

__all__ = ["ENTRY", "IMAGES", "INBOX", "JOURNAL", "NOTICES", "REGISTRY", "Registry", "agent_dir", "append_journal",
           "check_job",
           "local_source", "marked", "post_notice", "read_journal", "read_private_json", "safe_name"]

JOURNAL = "journal.jsonl"
REGISTRY = "registry.json"
NOTICES = "notices.json"
INBOX = "inbox"
IMAGES = "images"


def agent_dir(config: Config) -> str:
    return files.ensure_private_dir(os.path.join(config.state_dir, "agent"))


MAX_STATE_BYTES = 4 << 20  # the registry and the notices file: far more than a node's workloads need

_NAME = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"}
_PATHISH = {"type": ["string", "null"], "maxLength": 4096}
_DOCUMENT: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "the agent's registry or notices file",
    "type": "object",
}
ENTRY: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "a registry entry",
    "type": "object",
    "required": ["kind", "job", "state"],
    "properties": {
        "kind": {"enum": ["pid", "container", "pod"]},
        "job": _NAME,
        "state": {"type": "string", "maxLength": 64},
        "pid": {"type": "integer", "minimum": 1},
        "start_time": {"type": ["integer", "null"], "minimum": 0},
        "container": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._+-]{0,1023}$"},
        "root": _PATHISH, "file_checkpoint": _PATHISH, "image": _PATHISH,
        "epoch": {"type": ["integer", "null"], "minimum": 0},
        "gpu_bytes": {"type": "integer", "minimum": 0},
    },
    "allOf": [{"if": {"properties": {"kind": {"const": "pid"}}},
               "then": {"required": ["pid", "start_time"]}, "else": {"required": ["container"]}}],
    "maxProperties": 64,
}


def _checked(data: bytes, schema: dict[str, Any], what: str, path: str) -> Any:
    """`data` parsed with bounds (size, depth, no NaN) and checked against `schema`, the store's
    record parser (snapguard.store._json) retyped as AGENT_STATE_INVALID."""
    from ..store import load_record

    try:
        return load_record(data, schema, what, cap=MAX_STATE_BYTES, evidence={"path": path})
    except SnapguardError as e:
        raise SnapguardError(Reason.AGENT_STATE_INVALID, e.failure.message, evidence={"path": path}) from None


def read_private_json(path: str, default: Any) -> Any:
    """The JSON object at `path` (`default` when there is none); refused, typed, when the file is
    not this user's alone (UNTRUSTED_PATH) or not a bounded JSON object (AGENT_STATE_INVALID)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return default
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"{path} is not private to this user: refusing to read it",
                                 evidence={"path": path})
        if not stat.S_ISREG(st.st_mode):
            raise SnapguardError(Reason.AGENT_STATE_INVALID, f"{path} is not a regular file", evidence={"path": path})
        return _checked(f.read(MAX_STATE_BYTES + 1), _DOCUMENT, path, path)


def check_job(job: str) -> str:
    """`job` when the image store accepts it as a job's name (snapguard.store's own check), else
    USAGE_ERROR: refused when it is given, not after the workload was stopped."""
    from ..store import check_name

    try:
        return check_name("job", job)
    except SnapguardError as e:
        raise SnapguardError(Reason.USAGE_ERROR, f"--job: {e.failure.message}") from None


def safe_name(text: str, n: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:n]


def marked(image: str) -> bool:
    """Whether the image directory holds its completion marker (written last: the image is whole)."""
    return os.path.isfile(os.path.join(image, MARKER_NAME)) and not os.path.islink(os.path.join(image, MARKER_NAME))


class Registry:
    """The protected workloads: {key: entry}; keys `pid:P`, `container:ID`, `pod:ID`. Each entry
    is checked against `ENTRY` on every read: a bad one is left out of `load()` (and kept, as it
    is, by a write), listed in `refused` with its typed line; the others act as if it were not
    there."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, REGISTRY)
        self.refused: dict[str, str] = {}

    def _read(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        doc = read_private_json(self.path, {"workloads": {}})
        workloads = doc.get("workloads", {})
        if not isinstance(workloads, dict):
            raise SnapguardError(Reason.AGENT_STATE_INVALID, f"{self.path}: field workloads is not an object",
                                 evidence={"path": self.path})
        good, bad, refused = {}, {}, {}
        for key, entry in workloads.items():
            try:
                if not isinstance(key, str) or len(key) > 300:
                    raise SnapguardError(Reason.AGENT_STATE_INVALID, f"{self.path}: a key of {len(key)} characters")
                _checked(json.dumps(entry).encode(), ENTRY, f"{self.path} entry {key[:80]}", self.path)
            except SnapguardError as e:
                bad[key] = entry
                refused[key] = f"snapguard {e.reason.name}: {e.failure.message}"
                continue
            good[key] = entry
        self.refused = refused
        return good, bad

    def load(self) -> dict[str, dict[str, Any]]:
        return self._read()[0]

    def save(self, workloads: dict[str, dict[str, Any]]) -> None:
        files.write_private_json(self.path, {"workloads": workloads})

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, dict[str, Any]]]:
        """Read-modify-write under a flock: `snapguard protect` and the agent edit it concurrently.
        A registry that cannot be read as a whole is refused (AGENT_STATE_INVALID), never written
        over; entries refused one by one are written back as they were."""
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            w, bad = self._read()
            yield w
            self.save({**bad, **w})
        finally:
            os.close(fd)

    def update(self, key: str, **changes: Any) -> None:
        with self.locked() as w:
            if key in w:
                w[key].update(changes)

    def add_pid(self, pid: int, job: str, file_checkpoint: str | None, epoch: int | None = None) -> dict[str, Any]:
        start = procfs.running_start_ticks(pid)
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
        check_job(entry["job"])
        if entry.get("epoch") is not None and (isinstance(entry["epoch"], bool) or entry["epoch"] < 0):
            raise SnapguardError(Reason.USAGE_ERROR, f"--epoch {entry['epoch']}: an epoch is an integer >= 0")
        with self.locked() as w:
            w[key] = {**entry, "key": key}
            return w[key]

    def remove(self, key: str) -> bool:
        with self.locked() as w:
            return w.pop(key, None) is not None


def append_journal(directory: str, event: str, **fields: Any) -> None:
    """One fsynced JSON line `{"t", "event", **fields}` at the end of the journal in `directory`."""
    line = (json.dumps({"t": round(time.time(), 3), "event": event, **fields}, sort_keys=True, default=str)
            + "\n").encode()
    fd = os.open(os.path.join(directory, JOURNAL), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


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
    path = os.path.join(inbox, f"{safe_name(nid, 128)}.json")
    files.write_private_json(path, doc)
    return path


def local_source(config: Config) -> Local:
    """The inbox as a notice source."""
    return Local(os.path.join(agent_dir(config), INBOX))
