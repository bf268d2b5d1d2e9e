"""The executor's typed reason behind a failed CRI CheckpointContainer.

What containerd 2.1.9 answers when the runtime's checkpoint fails (observed on this machine; its
runc shim, process.Init.checkpoint, and the CRI plugin's CheckpointContainer):

    checkpointing container "<id>" failed: <runtime> did not terminate successfully: exit status 1:
    <the FIRST line of the runtime's stdout and stderr> path= <bundle>/criu-dump.log

The shim keeps one line of what snapguard-runc printed, and when runc ran CRIU that line is runc's
own (`criu failed: type DUMP errno 0`, `CRIU version check failed: ...`), printed before
snapguard-runc's `snapguard REASON: ...` line. The whole typed line is in the runtime's `--log`
file, `<bundle>/log.json` (JSON lines, one per error; snapguard-runc appends its reason last), and
the bundle is the directory of the `path=` containerd names.

`executor_failure` reads it in that order: the typed line in containerd's message itself (a
refusal before runc ran: the first line is snapguard-runc's); else the last error of `log.json`
written since the call began whose message is `snapguard NAME: ...`; a NAME that is not one of
snapguard's Reasons is never taken. The bundle must be `.../io.containerd.runtime.v2.task/<ns>/<id>`
of the container checkpointed, the file root's and read through snapguard.trust, at most
`MAX_LOG_BYTES` from its end. None when neither says: the caller types containerd's message as
CRI_CHECKPOINT_FAILED.
"""

from __future__ import annotations

import datetime
import json
import os
import re

from ..reasons import Reason
from ..trust import UntrustedPathError, open_trusted

__all__ = ["MAX_LOG_BYTES", "ExecutorFailure", "executor_failure"]

MAX_LOG_BYTES = 256 << 10
_TYPED = re.compile(r"snapguard ([A-Z][A-Z0-9_]{1,63}): ")
_DUMP_LOG = re.compile(r" path= (/\S+)/criu-dump\.log\s*$")
_TASK_DIR = "io.containerd.runtime.v2.task"
_SLACK_S = 2.0  # log.json's times are whole seconds


class ExecutorFailure:
    """The reason snapguard-runc gave and its one-line message (`snapguard NAME: ...` stripped)."""

    __slots__ = ("message", "reason", "source")

    def __init__(self, reason: Reason, message: str, source: str) -> None:
        self.reason = reason
        self.message = message
        self.source = source  # "message" (containerd's) or the log.json path

    def __repr__(self) -> str:
        return f"ExecutorFailure({self.reason.name}, {self.message!r}, {self.source!r})"


def _typed(text: str) -> tuple[Reason, str] | None:
    m = _TYPED.search(text)
    if m is None or m.group(1) not in Reason.__members__:
        return None
    return Reason[m.group(1)], " ".join(text[m.end():].split())[:400]


def _bundle(details: str, container_id: str) -> str | None:
    m = _DUMP_LOG.search(details)
    if m is None:
        return None
    bundle = os.path.normpath(m.group(1))
    parts = bundle.split(os.sep)
    if len(parts) < 4 or parts[-1] != container_id or parts[-3] != _TASK_DIR or not re.fullmatch(
            r"[A-Za-z0-9][A-Za-z0-9._-]{0,75}", parts[-2]):
        return None
    return bundle


def _since(entry: dict[str, object], since: float) -> bool:
    when = entry.get("time")
    if not isinstance(when, str):
        return False
    try:
        t = datetime.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return False
    return t >= since - _SLACK_S


def _from_log(path: str, since: float) -> tuple[Reason, str] | None:
    try:
        fd = open_trusted(path, "file")
    except (UntrustedPathError, OSError):
        return None
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - MAX_LOG_BYTES), os.SEEK_SET)
        data = os.read(fd, MAX_LOG_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    for line in reversed(data.decode("utf-8", "replace").splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("level") != "error" or not _since(entry, since):
            continue
        msg = entry.get("msg")
        if isinstance(msg, str) and msg.startswith("snapguard "):
            return _typed(msg)
    return None


def executor_failure(details: str, container_id: str, since: float) -> ExecutorFailure | None:
    """snapguard-runc's reason for the failed checkpoint of `container_id` whose call began at
    `since` (wall clock), from containerd's message `details` (see the module's docstring)."""
    first = _typed(_DUMP_LOG.sub("", details))
    if first is not None:
        return ExecutorFailure(first[0], first[1], "message")
    bundle = _bundle(details, container_id)
    if bundle is None:
        return None
    path = os.path.join(bundle, "log.json")
    logged = _from_log(path, since)
    return ExecutorFailure(logged[0], logged[1], path) if logged else None
