"""A held trainer's spilled bytes (snapguard.hooks.take.Spill) into the image, and back out of it.

The take point of a trainer in the executor's own mount namespace moves its tensors' bytes into a
file of its own on a tmpfs and hands it over: `SpillCopies` writes each such file into the image
(`names.take_spill_name(pid)`), each by a thread of its own, beside CRIU's run (stop snapshot) or after the release
(leave-running), so that CRIU writes only what stays in the process. The manifest's take_point
names the file (`offload.spill.file`); `image_spills` reads those names back for a restore, which
passes each trainer its image file with the release (`open_image_spills`).

Each spill handed over is also recorded in the state directory (root's alone) until its name is
gone: an executor killed after a stop snapshot's dump, before it could remove the names of its
trainers' spills, leaves them (each as large as an optimizer's state, in memory) to the next
snapshot or restore on the node, which sweeps them (`sweep`). A spill that never reached an
executor (its trainer killed while it filled it) has no record: the same sweep finds it by its
name in the default spill directories (`sweep_orphans`).
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from typing import Any

from .. import files, names, procfs
from ..hooks import take
from ..reasons import Reason, SnapguardError

__all__ = ["DEFAULT_SPILL_DIRS", "ORPHAN_AGE_S", "SpillCopies", "image_spills", "open_image_spills", "sweep",
           "sweep_orphans"]

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RECORD = re.compile(r"[0-9]+-[0-9]+-[0-9]+\.json")  # _record_name's
_RECORD_MAX = 4096


def _record_name(pid: int, start: int, ino: int) -> str:
    return f"{pid}-{start}-{ino}.json"


def _record(journal_dir: str, spill: take.Spill, uid: int | None) -> str | None:
    """A record of `spill` in `journal_dir`: its trainer (pid and start), its name and file, and
    its owner; the record's name, or None when the trainer is gone or its owner unknown already.
    Not synced: it is written while the trainer is held, and serves against an executor that
    dies, not a node that does (whose tmpfs goes with it)."""
    start = procfs.start_ticks(spill.pid)
    if uid is None or start is None or spill.fd < 0:
        return None
    st = os.fstat(spill.fd)
    name = _record_name(spill.pid, start, st.st_ino)
    data = json.dumps({"pid": spill.pid, "start": start, "path": spill.path, "dev": st.st_dev, "ino": st.st_ino,
                       "uid": uid}).encode()
    dir_fd = os.open(journal_dir, _O_DIR)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            os.write(fd, data)  # a record cut short by a kill is not one `_read_record` takes: dropped
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return name


def _forget(journal_dir: str, name: str) -> None:
    try:
        os.unlink(os.path.join(journal_dir, name))
    except FileNotFoundError:
        pass


def _read_record(dir_fd: int, name: str) -> dict[str, Any] | None:
    """A record as `_record` writes it; None for anything else (never acted on)."""
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
            not names.TAKE_SPILL_SOURCE.fullmatch(os.path.basename(record["path"])) or \
            name != _record_name(record["pid"], record["start"], record["ino"]):
        return None
    return record


def sweep(journal_dir: str) -> list[str]:
    """Remove the name of every recorded spill whose trainer is gone (no process of its pid and
    start) and that still names the file recorded, owned by the trainer's user; drop the records
    of those and of every spill whose name is already gone (the trainer reloaded). A record of a
    trainer that lives, whose name is still its file, stays. The names removed."""
    removed: list[str] = []
    dir_fd = os.open(journal_dir, _O_DIR)
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
                    keep = take.remove_spill_name(*spill, dry_run=True)  # it removes its own name at its reload
                elif take.remove_spill_name(*spill):
                    removed.append(record["path"])
            if not keep:
                try:
                    os.unlink(entry.name, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
    finally:
        os.close(dir_fd)
    return removed


# Where a trainer spills unless SNAPGUARD_TAKE_SPILL_DIR says elsewhere (snapguard.hooks._workload)
DEFAULT_SPILL_DIRS = (names.SPILL_TMPFS, "/dev/shm")
ORPHAN_AGE_S = 600.0  # younger spills are left alone, whatever their name's pid says


def sweep_orphans(dirs: tuple[str, ...] = DEFAULT_SPILL_DIRS, *, min_age_s: float = ORPHAN_AGE_S) -> list[str]:
    """Remove spills no executor heard of, whose trainer is gone: one killed while it filled its
    spill (the kernel's OOM killer, in the middle of a large take) or before its answer reached
    the executor leaves a name no journal record covers, as large as its optimizer's state, in
    memory, for as long as the node runs.

    In each of `dirs` that is a tmpfs directory (`take.tmpfs_dir`: looked up without a chance
    to hang), a name of the take point's form (`names.TAKE_SPILL_SOURCE`, which holds its
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
        if not take.tmpfs_dir(directory):
            continue
        path_fd = take.open_dir(directory)  # no link followed on the way: a container writes below some
        if path_fd is None:
            continue
        try:
            dir_fd = os.open(".", _O_DIR, dir_fd=path_fd)
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
                match = names.TAKE_SPILL_SOURCE.fullmatch(name)
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
                if take.remove_spill_name(path, st.st_dev, st.st_ino, st.st_uid):  # still that file
                    removed.append(path)
        finally:
            os.close(dir_fd)
    return removed


class SpillCopies:
    """The copies of `spills` into the image directory, named in each trainer's figures; each
    spill recorded in `journal_dir` (see `sweep`) until its name is gone."""

    def __init__(self, image_dir: str, spills: dict[int, take.Spill], figures: dict[int, dict[str, Any]],
                 journal_dir: str | None = None) -> None:
        self.spills = spills
        self.copies: dict[int, files.FileCopy] = {}
        self.started = False
        self.trainers_ended = False  # a stop snapshot's dump succeeded: its trainers are on their way out
        self._dir_fd = os.open(image_dir, _O_DIR) if spills else -1
        # the trainers' owners, read while they run: a stop snapshot's trainer is gone when its
        # spill's name is removed, and only a file of its owner's is
        self.uids = {pid: procfs.euid(pid) for pid in spills}
        self.journal_dir = journal_dir
        self.records: dict[int, str] = {}
        try:
            if journal_dir is not None:
                for pid, spill in spills.items():
                    if (record := _record(journal_dir, spill, self.uids[pid])) is not None:
                        self.records[pid] = record
            if spills:
                st = os.fstatvfs(self._dir_fd)
                needed = sum(spill.size for spill in spills.values())
                if st.f_bavail * st.f_frsize < needed:  # found before anything is frozen
                    raise SnapguardError(Reason.IMAGE_WRITE_FAILED, f"the image's filesystem has "
                                         f"{st.f_bavail * st.f_frsize} bytes free, the trainers' moved bytes "
                                         f"need {needed}; nothing was frozen, the trainers go on",
                                         evidence={"image": image_dir, "free": st.f_bavail * st.f_frsize,
                                                   "needed": needed})
            for pid, spill in spills.items():
                name = names.take_spill_name(pid)
                self.copies[pid] = files.FileCopy(spill.fd, self._dir_fd, name, spill.size)
                figures[pid]["offload"]["spill"]["file"] = name
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        if not self.started:
            self.started = True
            for copy in self.copies.values():
                try:
                    copy.start()
                except RuntimeError:  # no thread to be had: wait() says that its file is not whole
                    pass

    def wait(self, timeout_s: float) -> float:
        """Every file whole in the image within `timeout_s` (OSError otherwise); the longest
        copy's seconds."""
        self.start()
        deadline = time.monotonic() + timeout_s
        for copy in self.copies.values():
            copy.wait(max(0.0, deadline - time.monotonic()))
        return max((c.seconds or 0.0 for c in self.copies.values()), default=0.0)

    def close(self) -> None:
        """Copies stopped, descriptors closed; and the name of every spill whose trainer is gone
        (a stop snapshot ended it, or it died) removed: nothing else would, and each is as large
        as the optimizer's state, in memory. A trainer that lives removes its own at its reload."""
        for copy in self.copies.values():
            copy.close()
        # CRIU kills a stop snapshot's trainers and does not wait: one with a large memory may
        # take a while to become a zombie, given that while (10 s at most)
        deadline = time.monotonic() + (10.0 if self.trainers_ended else 0.0)
        for pid, spill in self.spills.items():
            while (running := procfs.alive(pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not running and spill.remove_source(self.uids.get(pid)) and pid in self.records:
                assert self.journal_dir is not None
                _forget(self.journal_dir, self.records.pop(pid))
            spill.close()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1


def image_spills(manifest: dict[str, Any], image_dir: str) -> dict[int, tuple[str, int]]:
    """{pid: (file, bytes)} of the spills the manifest's take_point names, each a file the
    manifest lists with that size and the name snapguard gives it; MANIFEST_INVALID otherwise."""
    out: dict[int, tuple[str, int]] = {}
    listed = manifest.get("files") or {}
    for key, figures in (manifest.get("take_point") or {}).items():
        spill = ((figures or {}).get("offload") or {}).get("spill") if isinstance(figures, dict) else None
        if spill is None:
            continue
        name = spill.get("file") if isinstance(spill, dict) else None
        size = spill.get("bytes") if isinstance(spill, dict) else None
        pid = int(key) if isinstance(key, str) and key.isdigit() else None
        entry = listed.get(name) if isinstance(name, str) else None
        if pid is None or name != names.take_spill_name(pid) or not isinstance(entry, dict) or \
                not isinstance(size, int) or isinstance(size, bool) or entry.get("size") != size:
            raise SnapguardError(Reason.MANIFEST_INVALID, f"take_point of pid {key} names a spill {spill!r} that "
                                 "is not one of the image's files as snapguard writes them",
                                 evidence={"image": image_dir, "pid": key})
        out[pid] = (name, size)
    return out


def open_image_spills(image_dir: str, wanted: dict[int, tuple[str, int]]) -> dict[int, take.Spill]:
    """The image's spill files opened read-only (never through a link), each checked to be the
    regular file of the size the manifest gives, for the release to pass on."""
    out: dict[int, take.Spill] = {}
    dir_fd = os.open(image_dir, _O_DIR)
    try:
        for pid, (name, size) in wanted.items():
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError as e:  # gone, or a link put in its place
                raise SnapguardError(Reason.IMAGE_CORRUPT, f"{name} in {image_dir} cannot be opened as the file the "
                                     f"manifest lists: {e.strerror or e}", evidence={"image": image_dir, "file": name})
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                os.close(fd)
                raise SnapguardError(Reason.IMAGE_CORRUPT, f"{name} in {image_dir} is not the file of {size} bytes "
                                     "the manifest lists", evidence={"image": image_dir, "file": name})
            out[pid] = take.Spill(pid, fd, "", size)
    except BaseException:
        for spill in out.values():
            spill.close()
        raise
    finally:
        os.close(dir_fd)
    return out
