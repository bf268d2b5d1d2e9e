"""The agent's state on disk, all in `<state_dir>/agent` (0700, root's): the registry of protected
workloads, the journal, the notices seen, and the inbox `snapguard notice` writes into."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

from .. import files, procfs
from ..config import Config
from ..names import MARKER_NAME
from ..reasons import Reason, SnapguardError
from ._sources import Local

__all__ = ["IMAGES", "INBOX", "JOURNAL", "NOTICES", "REGISTRY", "Registry", "agent_dir", "append_journal",
           "local_source", "marked", "post_notice", "read_journal", "read_private_json", "safe_name"]

JOURNAL = "journal.jsonl"
REGISTRY = "registry.json"
NOTICES = "notices.json"
INBOX = "inbox"
IMAGES = "images"


def agent_dir(config: Config) -> str:
    return files.ensure_private_dir(os.path.join(config.state_dir, "agent"))


def read_private_json(path: str, default: Any) -> Any:
    """The JSON document at `path` (`default` when there is none); refused, typed, when the file
    is not this user's alone or not JSON."""
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


def safe_name(text: str, n: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:n]


def marked(image: str) -> bool:
    """Whether the image directory holds its completion marker (written last: the image is whole)."""
    return os.path.isfile(os.path.join(image, MARKER_NAME)) and not os.path.islink(os.path.join(image, MARKER_NAME))


class Registry:
    """The protected workloads: {key: entry}; keys `pid:P` and `container:ID`."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, REGISTRY)

    def load(self) -> dict[str, dict[str, Any]]:
        doc = read_private_json(self.path, {"workloads": {}})
        return dict(doc.get("workloads") or {})

    def save(self, workloads: dict[str, dict[str, Any]]) -> None:
        files.write_private_json(self.path, {"workloads": workloads})

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, dict[str, Any]]]:
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
        if not entry["job"] or "/" in entry["job"] or entry["job"].startswith("."):
            raise SnapguardError(Reason.USAGE_ERROR,
                                 f"--job {entry['job']!r}: a name without '/', not starting with '.'")
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
