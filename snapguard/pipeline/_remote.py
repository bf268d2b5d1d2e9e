"""Images off the node: push a sealed image to a store, pull one, and restore from a store on
another node, fenced.

A restore from a store fetches the image into a private directory, every span checked against
the manifest as it arrives, and restores it through the one sequence without reading the image a
second time. The job's next fencing epoch is taken as the last step before CRIU's restore, once
verification, preflight, host checks and the device map have passed (`_Fenced` wraps the runner),
and rolled back when the restore then fails, so a failed restore leaves the live job unfenced;
an image pushed under an older epoch than the job's current one is refused ALREADY_RESTORED
before anything is fetched or started, unless forced (snapguard.store._fencing states the rule).
Of two restores racing for an epoch one wins, the other is FENCED and starts nothing. The
digests computed while the image was written: the digests computed while it was written are handed to verification,
bound to the files' inodes. The restore's host checks (privileges, CRIU, the CUDA plugin, NVML),
which do not depend on the image, run in a thread while the image is fetched; the restore's
preflight reuses them (`Fetched.host_checks`) and checks the fetched manifest against them. A
refusal names the job's file checkpoint, when one is known, so the caller can fall back knowing
why.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, TextIO

from .. import preflight
from ..config import Config
from ..devicemap import DeviceMap
from ..reasons import Reason, SnapguardError
from ._request import Request, Timeouts
from ._runners import CriuRunner
from .restore import restore

__all__ = ["Fetched", "fetch_fenced", "mark_fallback", "node_epoch", "pull_image", "push_image", "restore_from",
           "run_fenced"]


def _store_job(store: Any, job: str | None) -> str:
    if job:
        return job
    jobs = store.jobs()
    if len(jobs) != 1:
        raise SnapguardError(Reason.USAGE_ERROR, f"--job is needed: the store holds {len(jobs)} jobs"
                             + (f" ({', '.join(jobs[:5])})" if jobs else ""))
    return str(jobs[0])


def _store_image(store: Any, job: str, name: str | None) -> Any:
    from ..store import ImageRef

    if name:
        return ImageRef(store.url, job, name, True)
    ref = store.newest(job)
    if ref is None:
        partial = store.images(job, whole_only=False)
        if partial:
            raise SnapguardError(Reason.UPLOAD_INCOMPLETE, f"job {job} has {len(partial)} image(s) in {store.url}, "
                                 "none with its completion marker: every upload was interrupted",
                                 evidence={"store": store.url, "images": [r.name for r in partial]})
        raise SnapguardError(Reason.IMAGE_INCOMPLETE, f"job {job} has no image in {store.url}",
                             evidence={"store": store.url})
    return ref


def _epoch_file(config: Config, job: str) -> str:
    return os.path.join(config.state_dir, "store-epochs", f"{job}.json")


def node_epoch(config: Config | None, job: str, images: str) -> int:
    """This node's fencing epoch of a job: the one its last `restore --from` took, else the
    image manifest's `fence_epoch`, else 0."""
    sources = ([(_epoch_file(config, job), "epoch")] if config is not None else []) + \
        [(os.path.join(images, "snapguard-manifest.json"), "fence_epoch")]
    for path, key in sources:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, encoding="utf-8") as f:
                value = json.loads(f.read(1 << 20)).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


def push_image(images: str, url: str, *, job: str | None = None, name: str | None = None,
               epoch: int | None = None, config: Config | None = None,
               progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Upload a sealed image; refused with FENCED, writing nothing, when the job was restored
    elsewhere under a newer epoch than this node's."""
    from ..store import Progress, open_store

    images = os.path.abspath(images)
    job = job or os.path.basename(images)
    epoch = node_epoch(config, job, images) if epoch is None else epoch
    ref = open_store(url).push(images, job, name=name, epoch=epoch, progress=Progress(stream=progress_stream))
    return {"ok": True, "operation": "push", "job": ref.job, "image": ref.name, "url": ref.url, "epoch": epoch}


def pull_image(url: str, images: str, *, job: str | None = None, image: str | None = None,
               progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Fetch a whole image, every byte checked against the manifest as it arrives."""
    from ..store import Progress, open_store

    store = open_store(url)
    job = _store_job(store, job)
    pulled = store.pull(_store_image(store, job, image), images, progress=Progress(stream=progress_stream))
    return {"ok": True, "operation": "pull", "job": job, "image": pulled.ref.name, "images": pulled.image_dir,
            "bytes": pulled.bytes, "seconds": pulled.seconds, "epoch": pulled.ref.epoch}


@dataclass
class Fetched:
    """An image fetched for a restore on this node: `epoch` is the job's epoch taken for it, or,
    while `image_epoch` is not None (the epoch is taken later, by `run_fenced`), 0."""

    image_dir: str
    job: str
    store_url: str
    image: str
    epoch: int
    bytes: int
    seconds: float
    verified: tuple[tuple[str, str, int, int], ...]  # digests bound to the written files' inodes
    fallback: str | None  # the job's file checkpoint, named by a refusal of the restore that follows
    # the restore's host checks, run while the image was fetched (None: they could not run ahead,
    # and the restore's preflight runs them itself)
    host_checks: preflight.HostChecks | None = None
    image_epoch: int | None = None  # the epoch the image was pushed under, while no epoch is taken yet
    force: bool = False

    def summary(self) -> dict[str, Any]:
        """What a restore's result record says of the fetch."""
        return {"fence_epoch": self.epoch, "store": self.store_url, "job": self.job, "store_image": self.image,
                "fetch": {"bytes": self.bytes, "seconds": self.seconds}}


class _HostChecksAhead:
    """The restore's host checks (`preflight.host_checks_ahead`) in a thread of their own, started
    at once; `result()` waits for them. Every child they start runs under its own deadline and
    NVML under its own, so the wait ends. A check that raises is a result; anything else that
    escapes gives None, and the restore's preflight then runs the checks itself, as before."""

    def __init__(self, config: Config) -> None:
        self._value: preflight.HostChecks | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), name="snapguard host-checks", daemon=True)
        self._thread.start()

    def _run(self, config: Config) -> None:
        try:
            self._value = preflight.host_checks_ahead(config)
        except Exception:  # noqa: BLE001 - run again, in the preflight, where it is typed as before
            self._value = None

    def result(self) -> preflight.HostChecks | None:
        t = time.monotonic()
        self._thread.join()
        return None if self._value is None else replace(self._value, waited_s=time.monotonic() - t)


def fetch_fenced(url: str, config: Config, *, job: str | None = None, image: str | None = None,
                 images: str | None = None, file_checkpoint: str | None = None,
                 progress_stream: TextIO | None = None, defer_epoch: bool = False,
                 force: bool = False) -> Fetched:
    """Fetch the job's image (verified while written) and take the job's next fencing epoch: of
    two restores racing, one wins and the other is FENCED, its fetched copy removed. An image
    pushed under an older epoch than the job's current one is ALREADY_RESTORED, checked before
    the fetch and again when the epoch is taken (`force`: taken anyway). With `defer_epoch` no
    epoch is taken here: `run_fenced` takes it right before CRIU. On any
    refusal the SnapguardError's evidence names the job and its file checkpoint (`file_checkpoint`,
    else the newest registered in the store) when known.

    The restore's host checks run meanwhile, in a thread that is always waited for before this
    returns or raises; their results come back in `Fetched.host_checks`, for `restore(...,
    host_checks=)`. A host that fails them is refused by that restore's preflight, after the
    fetch, with the reason it always had."""
    ahead = _HostChecksAhead(config)
    try:
        got = _fetch_fenced(url, config, job=job, image=image, images=images, file_checkpoint=file_checkpoint,
                            progress_stream=progress_stream, defer_epoch=defer_epoch, force=force)
    finally:
        host_checks = ahead.result()
    return replace(got, host_checks=host_checks)


def _fetch_fenced(url: str, config: Config, *, job: str | None, image: str | None, images: str | None,
                  file_checkpoint: str | None, progress_stream: TextIO | None, defer_epoch: bool,
                  force: bool) -> Fetched:
    fallback = file_checkpoint
    try:
        from .. import trust
        from ..store import Progress, open_store

        store = open_store(url)
        job = _store_job(store, job)
        if fallback is None:
            try:
                fallback = store.newest_file_checkpoint(job)
            except SnapguardError:
                fallback = None
        ref = _store_image(store, job, image)
        image_epoch = _pushed_under(store, ref)
        if not force:  # refused before anything is fetched
            _already_restored(store, job, image_epoch)
        dest = os.path.abspath(images) if images else \
            trust.private_tempdir(os.path.join(config.state_dir, "pulled"), f"{job}-{ref.name}-")
        # not fsynced: restored from at once (a crash after it leaves a copy the next restore
        # verifies whole); on a disk-backed state dir the fsync was most of the fetch
        pulled = store.pull(ref, dest, progress=Progress(stream=progress_stream), durable=False)
        got = Fetched(pulled.image_dir, job, store.url, ref.name, 0, pulled.bytes, pulled.seconds,
                      _bound(pulled.image_dir, pulled.digests), fallback, image_epoch=image_epoch, force=force)
        if not defer_epoch:
            try:
                got = replace(got, epoch=_take(store, got), image_epoch=None)
            except SnapguardError:
                import shutil

                shutil.rmtree(pulled.image_dir, ignore_errors=True)  # the loser changes nothing
                raise
            _record_epoch(config, got)
    except SnapguardError as e:
        mark_fallback(e, job, fallback)
        raise
    return got


def _pushed_under(store: Any, ref: Any) -> int:
    """The epoch an image was pushed under (its store record; 0 when it names none)."""
    if isinstance(ref.epoch, int):
        return int(ref.epoch)
    value = store._record(ref.job, ref.name).get("epoch")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _already_restored(store: Any, job: str, image_epoch: int) -> None:
    current = store.current_epoch(job)
    if current > image_epoch:
        raise SnapguardError(Reason.ALREADY_RESTORED, f"job {job} was restored under epoch {current} since this "
                             f"image's epoch {image_epoch}: a copy of it may be running; nothing was started "
                             "(restore --force starts one anyway, fencing that copy)",
                             evidence={"job": job, "image_epoch": image_epoch, "current": current,
                                       "store": store.url})


def _take(store: Any, got: Fetched) -> int:
    return int(store.attempt_epoch(got.job, got.image_epoch or 0, force=got.force, note={"image": got.image}))


def _record_epoch(config: Config, got: Fetched) -> None:
    """This node's epoch of the job, for its later pushes."""
    from ..files import ensure_private_dir, write_private_json

    epoch_file = _epoch_file(config, got.job)
    ensure_private_dir(os.path.dirname(epoch_file))
    write_private_json(epoch_file, {"job": got.job, "epoch": got.epoch, "store": got.store_url, "image": got.image,
                                    "images": got.image_dir})


class _Fenced:
    """A runner whose CRIU restore first takes the job's epoch (`attempt_epoch`): called by the
    restore sequence after every check passed, the last step before CRIU runs."""

    def __init__(self, inner: Any, store: Any, got: Fetched) -> None:
        self._inner, self._store, self._got = inner, store, got
        self.taken: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def restore(self, req: Any, options: Any, env: dict[str, str]) -> int:
        self.taken = _take(self._store, self._got)
        return int(self._inner.restore(req, options, env))


def run_fenced(got: Fetched, runner: Any, req: Request, config: Config) -> dict[str, Any]:
    """The restore sequence for a fetched image, its epoch taken right before CRIU and rolled
    back (an abort record, create-only) when the restore fails after taking it: the live job's
    epoch is then current again, unless a restored tree could not be ended (it may run: the
    epoch stays). A restore that fails before it took nothing."""
    from ..store import open_store

    if got.image_epoch is None:  # the epoch was taken with the fetch
        return restore(runner, req, config, host_checks=got.host_checks)
    fenced = _Fenced(runner, open_store(got.store_url), got)
    try:
        result = restore(fenced, req, config, host_checks=got.host_checks)
    except BaseException as e:
        # a restored tree that could not be ended may run: its epoch then stays (the old copy fenced)
        lingers = isinstance(e, SnapguardError) and e.failure.evidence.get("restored_tree_ended") is False
        if fenced.taken is not None and not lingers:
            rolled = fenced._store.abort_epoch(got.job, fenced.taken, why=str(e)[:500])
            if isinstance(e, SnapguardError):
                e.failure.evidence["epoch_rolled_back"] = {"epoch": fenced.taken, "written": rolled}
        raise
    got.epoch = int(fenced.taken or 0)
    _record_epoch(config, got)
    return result


def mark_fallback(e: SnapguardError, job: str | None, fallback: str | None) -> None:
    """Name the job and its file checkpoint in a refusal's evidence, for the caller's fallback."""
    if fallback:
        e.failure.evidence["file_checkpoint"] = fallback
    if job:
        e.failure.evidence.setdefault("job", job)


def restore_from(url: str, config: Config, *, job: str | None = None, image: str | None = None,
                 images: str | None = None, tcp_established: bool = False, file_checkpoint: str | None = None,
                 device_map: DeviceMap | None = None, force: bool = False,
                 progress_stream: TextIO | None = None, rendezvous: str | None = None) -> dict[str, Any]:
    """Fetch and restore a bare process tree, fenced (`fetch_fenced`, the host checks running
    meanwhile, then `run_fenced`: the one restore sequence, which reads the image once more only
    for what was not verified as it was written, the epoch taken right before CRIU). `force`:
    restore an image the job was restored from since (ALREADY_RESTORED otherwise)."""
    got = fetch_fenced(url, config, job=job, image=image, images=images, file_checkpoint=file_checkpoint,
                       progress_stream=progress_stream, defer_epoch=True, force=force)
    try:
        req = Request(got.image_dir, tcp_established=tcp_established, timeouts=Timeouts.from_config(config),
                      device_map=device_map, verified_digests=got.verified, rendezvous=rendezvous)
        result = run_fenced(got, CriuRunner(config.criu), req, config)
    except SnapguardError as e:
        mark_fallback(e, got.job, got.fallback)
        raise
    result.update(got.summary())
    return result


def _bound(image_dir: str, digests: dict[str, str]) -> tuple[tuple[str, str, int, int], ...]:
    """The digests computed while the files were written, bound to their inodes: verification may
    skip a file only while it is that very file (in a directory made root-only for the pull)."""
    out = []
    for name, digest in digests.items():
        try:
            st = os.lstat(os.path.join(image_dir, name))
        except OSError:
            continue
        out.append((name, digest, st.st_dev, st.st_ino))
    return tuple(out)
