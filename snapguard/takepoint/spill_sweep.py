"""The sweeps of spills left behind. Each spill handed over is recorded in the state directory
(root's alone) until its name is gone: an executor killed after a stop snapshot's dump, before it
could remove the names of its trainers' spills, leaves them (each as large as an optimizer's
state, in memory) to the next snapshot or restore on the node, which sweeps them (`sweep`). A
spill that never reached an executor (its trainer killed while it filled it) has no record: the
same sweep finds it by its name in the default spill directories (`sweep_orphans`)."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from typing import Any

from .. import procfs
from .protocol import SHM_DIR, SPILL_TMPFS, TAKE_SPILL_SOURCE
from .spill_paths import open_dir, remove_spill_name, tmpfs_dir

__all__ = ["DEFAULT_SPILL_DIRS", "ORPHAN_AGE_S", "forget_spill", "record_spill", "sweep", "sweep_orphans"]

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RECORD = re.compile(r"[0-9]+-[0-9]+-[0-9]+\.json")  # _record_name's
_RECORD_MAX = 4096


def _record_name(pid: int, start: int, ino: int) -> str:
    return f"{pid}-{start}-{ino}.json"


def record_spill(journal_dir: str, pid: int, fd: int, path: str, uid: int | None) -> str | None:
    """A record in `journal_dir` of the spill `fd` named `path` of trainer `pid`: the trainer (pid
    and start), the spill's name and file, and its owner `uid`; the record's name, or None when
    the trainer is gone or its owner unknown already.
    Not synced: it is written while the trainer is held, and serves against an executor that
    dies, not a node that does (whose tmpfs goes with it)."""
    start = procfs.start_ticks(pid)
    if uid is None or start is None or fd < 0:
        return None
    st = os.fstat(fd)
    name = _record_name(pid, start, st.st_ino)
    data = json.dumps({"pid": pid, "start": start, "path": path, "dev": st.st_dev, "ino": st.st_ino,
                       "uid": uid}).encode()
    dir_fd = os.open(journal_dir, O_DIR)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            os.write(fd, data)  # a record cut short by a kill is not one `_read_record` takes: dropped
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return name


def forget_spill(journal_dir: str, name: str) -> None:
    try:
        os.unlink(os.path.join(journal_dir, name))
    except FileNotFoundError:
        pass


def _read_record(dir_fd: int, name: str) -> dict[str, Any] | None:
    """A record as `record_spill` writes it; None for anything else (never acted on)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, _RECORD_MAX + 1)
        record = json.loads(data) if len(data) <= _RECORD_MAX else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    ints = ("pid", "start", "dev", "ino", "uid")
    if not isinstance(record, dict) or set(record) != {*ints, "path"} or \
            not all(type(record[k]) is int and record[k] >= 0 for k in ints) or \
            not isinstance(record["path"], str) or \
            not TAKE_SPILL_SOURCE.fullmatch(os.path.basename(record["path"])) or \
            name != _record_name(record["pid"], record["start"], record["ino"]):
        return None
    return record


def sweep(journal_dir: str) -> list[str]:
    """Remove the name of every recorded spill whose trainer is gone (no process of its pid and
    start) and that still names the file recorded, owned by the trainer's user; drop the records
    of those and of every spill whose name is already gone (the trainer reloaded). A record of a
    trainer that lives, whose name is still its file, stays. The names removed."""
    removed: list[str] = []
    dir_fd = os.open(journal_dir, O_DIR)
    try:
        for entry in os.scandir(dir_fd):
            if not _RECORD.fullmatch(entry.name):
                continue
            record = _read_record(dir_fd, entry.name)
            keep = False
            if record is not None:
                spill = (record["path"], record["dev"], record["ino"], record["uid"])
                # looked up only in a tmpfs directory (remove_spill_name): a lookup cannot hang
                if procfs.alive(record["pid"]) and procfs.start_ticks(record["pid"]) == record["start"]:
                    keep = remove_spill_name(*spill, dry_run=True)  # it removes its own name at its reload
                elif remove_spill_name(*spill):
                    removed.append(record["path"])
            if not keep:
                try:
                    os.unlink(entry.name, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
    finally:
        os.close(dir_fd)
    return removed


# Where a trainer spills unless protocol.SPILL_DIR_ENV says elsewhere (workload.env.spill_dir)
DEFAULT_SPILL_DIRS = (SPILL_TMPFS, SHM_DIR)
ORPHAN_AGE_S = 600.0  # younger spills are left alone, whatever their name's pid says


def sweep_orphans(dirs: tuple[str, ...] = DEFAULT_SPILL_DIRS, *, min_age_s: float = ORPHAN_AGE_S) -> list[str]:
    """Remove spills no executor heard of, whose trainer is gone: one killed while it filled its
    spill (the kernel's OOM killer, in the middle of a large take) or before its answer reached
    the executor leaves a name no journal record covers, as large as its optimizer's state, in
    memory, for as long as the node runs.

    In each of `dirs` that is a tmpfs directory (`tmpfs_dir`: looked up without a chance
    to hang), a name of the take point's form (`protocol.TAKE_SPILL_SOURCE`, which holds its
    trainer's pid) is removed when it is a regular file (no link followed) last changed more than
    `min_age_s` ago, and its pid is no process, or one that started after the file was last
    changed (the pid was given again), or one of another user than the file's owner. A trainer
    that lives started before its spill was written, and as its owner. A trainer in another pid
    namespace that spills here names a pid of its own namespace: the age keeps a spill under way
    safe from such a mix-up. The names removed."""
    removed: list[str] = []
    now = time.time()
    boot = now - time.clock_gettime(time.CLOCK_BOOTTIME)  # wall time of the boot, sub-second
    hz = os.sysconf("SC_CLK_TCK")
    for directory in dirs:
        if not tmpfs_dir(directory):
            continue
        path_fd = open_dir(directory)  # no link followed on the way: a container writes below some
        if path_fd is None:
            continue
        try:
            dir_fd = os.open(".", O_DIR, dir_fd=path_fd)
        except OSError:
            continue
        finally:
            os.close(path_fd)
        try:
            entries = [entry.name for entry in os.scandir(dir_fd)]
        except OSError:
            entries = []
        try:
            for name in entries:
                match = TAKE_SPILL_SOURCE.fullmatch(name)
                if match is None:
                    continue
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or now - st.st_ctime < min_age_s:
                    continue
                pid = int(match.group(1))
                start, uid = procfs.start_ticks(pid), procfs.euid(pid)
                if start is not None and uid == st.st_uid and boot + start / hz < st.st_ctime:
                    continue  # its trainer, most likely, alive
                path = os.path.join(directory, name)
                if remove_spill_name(path, st.st_dev, st.st_ino, st.st_uid):  # still that file
                    removed.append(path)
        finally:
            os.close(dir_fd)
    return removed

