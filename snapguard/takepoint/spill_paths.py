"""Where the executor may look for a trainer's spill, and how it removes one's name: directories on
a tmpfs reached through no file system whose lookups may hang (`tmpfs_dir`), each trainer's spill
directory as it names it and as the executor reaches it (`spill_dirs`), directories opened one
component at a time following no link (`open_dir`), a name removed only while it is still the
file (`remove_spill_name`). Everything the executor looks up here is a path a trainer chose."""

from __future__ import annotations

import os
import stat
from typing import Any

from .. import procfs
from .protocol import SPILL, SPILL_DIR

__all__ = ["in_tmpfs_dir", "open_dir", "remove_spill_name", "spill_dirs", "tmpfs_dir"]

# file systems whose lookups can wait on a process or the network (a FUSE daemon, a server, an
# automounter): a trainer's path through one could hold root's lookup for ever
_MAY_HANG = ("fuse", "autofs", "nfs", "cifs", "smb", "9p", "ceph", "glusterfs", "lustre", "gpfs", "afs", "davfs",
             "sshfs", "virtiofs")


def tmpfs_dir(directory: str) -> bool:
    """Whether `directory` (absolute and canonical) is on a tmpfs reached through no file system
    whose lookups may wait on something outside the kernel (`_MAY_HANG`): told from mountinfo
    alone, before root looks anything up along it."""
    if not directory.startswith("/") or os.path.normpath(directory) != directory:
        return False
    chain = procfs.mounts_on_path(directory)
    if not chain:
        return False
    return chain[-1]["fstype"] == "tmpfs" and not any(str(m["fstype"]).startswith(_MAY_HANG) for m in chain)


def in_tmpfs_dir(path: str) -> bool:
    """Whether `path` (absolute and canonical, as a trainer reports its spill) is a name in a
    `tmpfs_dir`: a path a trainer chose, looked up by root only there."""
    return path.startswith("/") and os.path.normpath(path) == path and tmpfs_dir(os.path.dirname(path))


def spill_dirs(found: dict[int, dict[str, Any]], containers: bool,
               proc: str | None = None) -> dict[int, tuple[str, str] | None]:
    """{pid: (its spill directory as it names it, that directory's path here)} of the trainers
    (as `trainers` found them) whose spill the executor may take: their status offers one, in a
    directory that is a tmpfs here, reached without following a link. A trainer in this mount
    namespace names its directory as the executor does (None: a hook older than `spill_dir`, whose
    answer's own path is checked instead). One in another (`containers`: a runc container's)
    spills only into a directory that is itself the mount point of a bind of a host directory
    (`procfs.mount_here`; runc hands CRIU the spec's binds as external mounts, so the files in it
    are not dumped), and only where the directory the trainer sees (looked up through its root,
    without following a link, past no mount whose lookups may hang) is the very one found here. A
    trainer in another mount namespace of a bare snapshot does not spill (CRIU would dump what its
    mounts hold)."""
    out: dict[int, tuple[str, str] | None] = {}
    for pid, st in found.items():
        there = st.get(SPILL_DIR)
        if st.get(SPILL) is not True:
            continue
        own = not procfs.own_mntns(pid, proc)
        if there is None and own:
            out[pid] = None
            continue
        if not isinstance(there, str) or not there.startswith("/") or os.path.normpath(there) != there:
            continue
        here = there if own else procfs.mount_here(pid, there, proc) if containers else None
        # judged from mountinfo before root looks anything up along it
        if here is None or not tmpfs_dir(here) or (here_id := _dir_id(here)) is None:
            continue
        if not own:
            chain = procfs.mounts_on_path(there, proc, pid=pid)
            if not chain or any(str(m["fstype"]).startswith(_MAY_HANG) for m in chain) or \
                    _dir_id(there, f"{proc or procfs.procfs_path()}/{pid}/root") != here_id:
                continue  # not the directory it sees: something over it, or a source gone
        out[pid] = (there, here)
    return out


def open_dir(directory: str, root: str = "/") -> int | None:
    """An O_PATH descriptor of `directory` (absolute) looked up from `root` one component at a time,
    following no link on the way (not even one a process swaps in meanwhile); None when that
    cannot be done. The caller closes it. `root` is itself opened following links: "/" or a
    process's /proc/PID/root."""
    try:
        dir_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for part in [p for p in directory.split("/") if p]:
            next_fd = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
    except OSError:
        os.close(dir_fd)
        return None
    return dir_fd


def _dir_id(directory: str, root: str = "/") -> tuple[int, int] | None:
    fd = open_dir(directory, root)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def remove_spill_name(path: str, dev: int, ino: int, uid: int | None, *, dry_run: bool = False) -> bool:
    """Remove the name `path` of a spill whose trainer is gone, when it still names that file
    (`dev`, `ino`), a regular one owned by `uid` (the trainer's): never any other file the path
    may name by now. Only a name in a tmpfs directory (`in_tmpfs_dir`) is looked up at all. The
    directories on the way are opened one by one without following a link (the trainer could
    swap one for a link elsewhere between a check and the unlink); the name is then checked and
    removed through that directory. Whether it was removed (`dry_run`: whether the name still is
    that file, left as it is)."""
    if uid is None or not in_tmpfs_dir(path):
        return False
    dir_fd = open_dir(os.path.dirname(path))
    if dir_fd is None:
        return False
    try:
        name = os.path.basename(path)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino) or st.st_uid != uid:
            return False
        if not dry_run:
            os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(dir_fd)

