"""The snapshot pipeline: one checkpoint and one restore sequence for every entry point.

Entry points map their flags onto a `Request` and pick a runner: `RuncRunner` when the real runc
runs CRIU for a container (snapguard-runc), `CriuRunner` when snapguard runs CRIU on a bare
process tree (`snapguard checkpoint/restore`). `checkpoint_pid` and `restore_images` are the bare
path in one call, for programs (the lab's drills) that snapshot processes they started.

The two verbs are `checkpoint` and `restore`, each in a module of its own; `scopes` holds what
they hold while they run (each a context manager, entered in one ExitStack), `_steps` times each
step and types its errors, `_devices` resolves a restore's GPU device map, `_remote` fetches and
fences an image from a store before the restore.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import Config
from ..files import write_private_json
from ..names import RESULT_NAME
from ..preflight import HostChecks
from ._request import NETWORK_LOCKS as NETWORK_LOCKS
from ._request import Request as Request
from ._request import Timeouts as Timeouts
from ._runners import CriuRunner as CriuRunner
from ._runners import Runner as Runner
from ._runners import RuncRunner as RuncRunner
from .checkpoint import FRESH_HOST_CHECKS as FRESH_HOST_CHECKS
from .checkpoint import checkpoint as checkpoint
from .restore import restore as restore
from ._remote import Fetched as Fetched
from ._remote import fetch_fenced as fetch_fenced
from ._remote import mark_fallback as mark_fallback
from ._remote import node_epoch as node_epoch
from ._remote import pull_image as pull_image
from ._remote import push_image as push_image
from ._remote import restore_from as restore_from
from ._remote import run_fenced as run_fenced
from ._podfence import STORE_ENV as STORE_ENV
from ._podfence import PodFence as PodFence
from ._podfence import pod_fence as pod_fence
from ._podfence import run_pod_fenced as run_pod_fenced

__all__ = ["FRESH_HOST_CHECKS", "NETWORK_LOCKS", "STORE_ENV", "CriuRunner", "Fetched", "PodFence", "Request", "Runner", "RuncRunner", "Timeouts", "checkpoint",
           "checkpoint_pid", "fetch_fenced", "mark_fallback", "node_epoch", "pod_fence", "pull_image", "push_image", "restore", "restore_from", "restore_images", "run_fenced", "run_pod_fenced",
           "write_record"]


def checkpoint_pid(pid: int, images: str, config: Config, *, leave_running: bool = False,
                   tcp_established: bool = False, take_wait_s: float | None = None,
                   host_checks: HostChecks | None = None, at_step: int | None = None) -> dict[str, Any]:
    """Snapshot the bare process tree rooted at pid into `images` (`host_checks`: see checkpoint;
    `at_step`: its trainers held at the end of that optimizer step, as every node of a job is)."""
    req = Request(images, leave_running=leave_running, tcp_established=tcp_established,
                  timeouts=Timeouts.from_config(config, take_wait_s), at_step=at_step)
    return checkpoint(CriuRunner(config.criu, pid), req, config, host_checks=host_checks)


def restore_images(images: str, config: Config, *, tcp_established: bool = False,
                   rendezvous: str | None = None) -> dict[str, Any]:
    """Restore a bare process tree from `images`, detached (`rendezvous`: HOST:PORT its trainers'
    process groups rebuild their store at)."""
    req = Request(images, tcp_established=tcp_established, timeouts=Timeouts.from_config(config),
                  rendezvous=rendezvous)
    return restore(CriuRunner(config.criu), req, config)


def write_record(work_dir: str, record: dict[str, Any], *, create: bool = False,
                 follow_link: bool = False) -> str | None:
    """Write a run's result or failure record into the work directory (0600, atomic). A missing
    one is made (0700) only with `create` (runc's contract: the work path holds its logs and
    snapguard's record); else a refused run changes nothing. A link is followed only with
    `follow_link` (runc's work path from containerd's shim), and only when root's alone. Returns
    the path, or None."""
    import stat

    from ..files import ensure_private_dir

    if os.path.islink(work_dir):
        if not follow_link:
            return None  # an image directory given as a link was refused: nothing is written through it
        # containerd's shim passes <bundle>/work, a symlink into its root-only state: followed only
        # when it and every hop are root's alone, as ensure_private_dir does
        from ..trust import UntrustedPathError, resolve_trusted

        try:
            work_dir = resolve_trusted(work_dir, "dir")
        except UntrustedPathError:
            return None
    path = os.path.join(work_dir, RESULT_NAME)
    if create and not os.path.lexists(work_dir):
        from ..trust import UntrustedPathError

        try:
            ensure_private_dir(work_dir)
        except UntrustedPathError:
            return None  # under a directory others control, or unusable: no record there
    try:
        st = os.lstat(work_dir)
    except OSError:
        return None

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return None  # not a directory snapguard may write in as root
    write_private_json(path, record)
    return path
