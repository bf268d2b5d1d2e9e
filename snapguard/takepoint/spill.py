"""The executor's side of the spill, in one place: a held trainer's moved bytes in a file of its
own on a tmpfs, handed over with the take's answer (`Spill`), written into the image beside CRIU's
run (stop snapshot) or after the release (leave-running), each by a thread of its own, so that
CRIU writes only what stays in the process (`SpillCopies`); the manifest's take_point names the
file (`offload.spill.file`), which `image_spills` reads back for a restore, which passes each
trainer its image file with the release (`open_image_spills`).

Where the executor may look for a spill and how it removes one's name are `spill_paths`'s; the
records and sweeps of spills left behind are `spill_sweep`'s; both are part of this face.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any

from .. import files, names, procfs
from ..reasons import Reason, SnapguardError
from .protocol import (MOVED_BYTES, MOVED_STORAGES, OFFLOAD, SPILL, SPILL_BYTES, SPILL_FILE, SPILL_PATH,
                       TAKE_SPILL_SOURCE, TMPFS_MAGIC, fs_type)
from .spill_paths import in_tmpfs_dir, open_dir, remove_spill_name, spill_dirs, tmpfs_dir
from .spill_sweep import DEFAULT_SPILL_DIRS, ORPHAN_AGE_S, forget_spill, record_spill, sweep, sweep_orphans

__all__ = ["DEFAULT_SPILL_DIRS", "ORPHAN_AGE_S", "Spill", "SpillCopies", "close", "image_spills", "in_tmpfs_dir",
           "open_dir", "open_image_spills", "remove_spill_name", "spill_dirs", "sweep", "sweep_orphans", "tmpfs_dir"]

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _count(value: Any) -> int:
    """An answer's count as it is, or -1 when it is none (a bool, a float, text)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


class Spill:
    """A held trainer's moved bytes in a file of its own, handed over with the take's answer: the
    executor copies it into the image, passes it back with the release, and, when the trainer is
    gone with a stop snapshot, removes its name. `fd` is the executor's own descriptor of it."""

    def __init__(self, pid: int, fd: int, path: str, size: int) -> None:
        self.pid, self.fd, self.path, self.size = pid, fd, path, size

    @classmethod
    def received(cls, pid: int, figures: dict[str, Any], fds: list[int], asked: bool = True,
                 where: tuple[str, str] | None = None) -> Spill | None:
        """The spill a take's answer reports, checked against the descriptor that came with it;
        None when it reports none. `where`: (the trainer's spill directory as it names it, the
        same directory's path here), from `spill_dirs`; the trainer's own path when None. The
        spill's path here must name the descriptor's file. Raises ValueError (the descriptors
        closed) when the two do not agree, or when a spill comes that was not `asked` for: the
        bytes the trainer moved are then in no file the executor may take."""
        try:
            offload = figures.get(OFFLOAD) if isinstance(figures, dict) else None
            spill = offload.get(SPILL) if isinstance(offload, dict) else None
            if spill is None and not fds:
                return None
            if not asked:
                raise ValueError("a spill came that was not asked for")
            if not isinstance(spill, dict) or len(fds) != 1:
                raise ValueError(f"the answer reports {str(spill)[:200]} with {len(fds)} descriptor(s)")
            assert isinstance(offload, dict)
            path = spill.get(SPILL_PATH)
            named = TAKE_SPILL_SOURCE.fullmatch(os.path.basename(path)) if isinstance(path, str) else None
            size, moved, storages = (_count(spill.get(SPILL_BYTES)), _count(offload.get(MOVED_BYTES)),
                                     _count(offload.get(MOVED_STORAGES)))
            if isinstance(path, str) and where is not None:
                there, here = where
                path = os.path.join(here, os.path.basename(path)) if os.path.dirname(path) == there else None
            if not isinstance(path, str) or not in_tmpfs_dir(path) or \
                    named is None or named.group(1) != str(pid) or \
                    not 0 < moved <= size <= moved + storages * 4096:  # each storage starts on a page
                raise ValueError(f"the answer's spill {str(spill)[:200]} is not one the take point makes"
                                 + (f" in {where[0]}" if where is not None else ""))
            st = os.fstat(fds[0])
            if not stat.S_ISREG(st.st_mode) or st.st_size != size or st.st_blocks * 512 < moved:
                raise ValueError(f"the descriptor is no regular file of {size} bytes holding them")
            # what root writes into the image is bound by what the take reported and by what the
            # file holds: a storage holds a byte at least, and only its padding to a page may be a hole
            if storages > moved or size - st.st_blocks * 512 > storages * 4096:
                raise ValueError(f"the file of {size} bytes holds {st.st_blocks * 512} bytes, the take reports "
                                 f"{moved} bytes moved in {storages} storages: more than the take moved "
                                 "would be written")
            if fs_type(fds[0]) != TMPFS_MAGIC:  # memory: its reads cannot hang (a FUSE file's could)
                raise ValueError("the descriptor's file is not on a tmpfs")
            if not remove_spill_name(path, st.st_dev, st.st_ino, st.st_uid, dry_run=True):
                # what the executor later removes by this name, and journals, must be this file
                raise ValueError(f"{path} does not name the descriptor's file")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(pid, fds[0], path, size)

    def remove_source(self, uid: int | None) -> bool:
        """Remove the trainer's name of the file (its trainer is gone), when that name still is
        this file, owned by `uid` (the trainer's); whether it was removed (`remove_spill_name`)."""
        if self.fd < 0:
            return False
        mine = os.fstat(self.fd)
        return remove_spill_name(self.path, mine.st_dev, mine.st_ino, uid)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1



def close(spills: dict[int, Spill]) -> None:
    """Every spill's descriptor closed (after `client.release_all` with them)."""
    for spill in spills.values():
        spill.close()


class SpillCopies:
    """The copies of `spills` into the image directory, named in each trainer's figures; each
    spill recorded in `journal_dir` (see `sweep`) until its name is gone."""

    def __init__(self, image_dir: str, spills: dict[int, Spill], figures: dict[int, dict[str, Any]],
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
                    record = record_spill(journal_dir, spill.pid, spill.fd, spill.path, self.uids[pid])
                    if record is not None:
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
                self.copies[pid] = files.FileCopy(spill.fd, self._dir_fd, name, spill.size,
                                                  max_allocated=os.fstat(spill.fd).st_blocks * 512)
                figures[pid][OFFLOAD][SPILL][SPILL_FILE] = name
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> frozenset[str]:
        """The image files the copies write."""
        return frozenset(copy.name for copy in self.copies.values())

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
                forget_spill(self.journal_dir, self.records.pop(pid))
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
        spill = ((figures or {}).get(OFFLOAD) or {}).get(SPILL) if isinstance(figures, dict) else None
        if spill is None:
            continue
        name = spill.get(SPILL_FILE) if isinstance(spill, dict) else None
        size = spill.get(SPILL_BYTES) if isinstance(spill, dict) else None
        pid = int(key) if isinstance(key, str) and key.isdigit() else None
        entry = listed.get(name) if isinstance(name, str) else None
        if pid is None or name != names.take_spill_name(pid) or not isinstance(entry, dict) or \
                not isinstance(size, int) or isinstance(size, bool) or entry.get("size") != size:
            raise SnapguardError(Reason.MANIFEST_INVALID, f"take_point of pid {key} names a spill {spill!r} that "
                                 "is not one of the image's files as snapguard writes them",
                                 evidence={"image": image_dir, "pid": key})
        out[pid] = (name, size)
    return out


def open_image_spills(image_dir: str, wanted: dict[int, tuple[str, int]]) -> dict[int, Spill]:
    """The image's spill files opened read-only (never through a link), each checked to be the
    regular file of the size the manifest gives, for the release to pass on."""
    out: dict[int, Spill] = {}
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
            out[pid] = Spill(pid, fd, "", size)
    except BaseException:
        for spill in out.values():
            spill.close()
        raise
    finally:
        os.close(dir_fd)
    return out
