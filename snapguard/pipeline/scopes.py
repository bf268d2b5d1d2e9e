"""What a checkpoint or restore holds while it runs, each a context manager that lets go of it
on the way out, whatever the way: the claim on the processes and the image, the trainers held at
their take point (and the copies of their spills), the CUDA processes suspended, the page files'
hasher, the CUDA broker of a CRIU run. Each verb enters them in one `contextlib.ExitStack`, so
every failure releases through the same exits, in the reverse order of the entries.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .. import criu, files, gpu_suspend, image
from ..config import Config
from ..takepoint import client as take
from ..takepoint import spill as _spill
from ..reasons import Finding, Reason, Severity, SnapguardError
from ..trust import UntrustedPathError
from ._steps import Steps

__all__ = ["CudaSuspended", "Hold", "claimed", "cuda_broker", "held", "page_file_hasher", "suspended",
           "sweep_spills"]


@contextmanager
def claimed(config: Config, pids: list[int], image_dir: str) -> Iterator[None]:
    """One snapguard run per process and per image at a time: a second checkpoint of a tree being
    checkpointed (or any run on the same image) is refused, not raced. flock: a run that dies
    lets go by itself."""
    lock_dir = files.ensure_private_dir(os.path.join(config.state_dir, "locks"))
    held_fds: list[int] = []
    try:
        keys = sorted({f"pid-{p}" for p in pids} | {"image-" + image_dir.strip("/").replace("/", "%")[-200:]})
        for key in keys:
            fd = os.open(os.path.join(lock_dir, key), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            held_fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                what = f"process {key[4:]}" if key.startswith("pid-") else f"image {image_dir}"
                raise SnapguardError(Reason.SNAPSHOT_IN_PROGRESS, f"another snapguard run holds {what}",
                                     evidence={"lock": key}) from None
        yield
    finally:
        for fd in held_fds:
            os.close(fd)


class Hold:
    """The trainers held at their take point for one snapshot: their figures, the hold's warnings,
    and the copies of their spills into the image. `release()` lets them go on (once); `ended()`
    says CRIU's dump ended them, so that nothing is released."""

    def __init__(self, found: dict[int, dict[str, Any]], figures: dict[int, dict[str, Any]],
                 warnings: list[Finding], spills: dict[int, _spill.Spill], copies: _spill.SpillCopies) -> None:
        self.found, self.figures, self.warnings, self.spills, self.copies = found, figures, warnings, spills, copies
        self._done = False

    def release(self) -> dict[int, str]:
        """Let the trainers go on, each with its spill to reload from; {pid: why} of those the
        release did not reach (each goes on by itself after its hold limit)."""
        if self._done:
            return {}
        self._done = True
        return take.release_all(self.found, self.spills)

    def ended(self) -> None:
        """A stop snapshot's dump succeeded: its trainers are gone with it, their spills' names go."""
        self._done = True
        self.copies.trainers_ended = True


@contextmanager
def held(found: dict[int, dict[str, Any]], cuda_pids: list[int], wait_s: float,
         spill: dict[int, tuple[str, str] | None], image_dir: str, journal: str | None,
         at_step: int | None = None) -> Iterator[Hold]:
    """The trainers held at their take point (`take.hold`), their spills' copies set up; on the
    way out released unless released or ended already, then the copies closed."""
    taken = take.hold(found, cuda_pids, wait_s, spill=spill, at_step=at_step)
    figures, warnings, spills = taken.held, taken.warnings, taken.spills
    try:
        copies = _spill.SpillCopies(image_dir, spills, figures, journal)
    except BaseException:
        take.release_all(found, spills)
        _spill.close(spills)
        raise
    hold = Hold(found, figures, warnings, spills, copies)
    try:
        yield hold
    finally:
        try:
            hold.release()
        finally:
            copies.close()


class CudaSuspended:
    """CUDA processes locked and checkpointed for a dump. `resume()` brings them back (once) and
    says how each came back; `ended()` says CRIU's dump ended them."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._done = False

    def resume(self) -> dict[int, str]:
        if self._done:
            return {}
        self._done = True
        return gpu_suspend.resume(self.pids)

    def ended(self) -> None:
        self._done = True


@contextmanager
def suspended(pids: list[int], lock_timeout_s: float, steps: Steps) -> Iterator[CudaSuspended]:
    """The CUDA processes suspended (gpu_suspend.suspend, step `cuda_suspend`); on the way out
    brought back unless resumed or ended already."""
    with steps.step("cuda_suspend", Reason.CUDA_CHECKPOINT_FAILED):
        gpu_suspend.suspend(pids, lock_timeout_s)
    scope = CudaSuspended(pids)
    try:
        yield scope
    finally:
        scope.resume()


@contextmanager
def page_file_hasher(image_dir: str, config: Config, steps: Steps, on: bool = True,
                     fresh: frozenset[str] = frozenset()) -> Iterator[image.PageFileHasher | None]:
    """The page files' hasher for a stop snapshot's dump (config `hash_while_dumping`), with a
    thread of its own for every four cores, at most three (on the H200 CRIU writes 2-3 GB/s and
    the seal hashed 0.7-0.9 GB/s a thread: three keep most of the pace and leave CRIU its cores;
    spans still queued at the seal go to its own pool). None when it is off or cannot start (the
    seal hashes all). `fresh`: the spill copies' names, hashed as they are written too. On the way
    out it is finished: its threads end and its files close."""
    hasher = None
    if on and config.hash_while_dumping:
        try:
            hasher = image.PageFileHasher(image_dir, threads=min(3, max(1, (os.cpu_count() or 1) // 4)), fresh=fresh)
        except (OSError, RuntimeError):  # RuntimeError: no thread could start
            steps.counts["span_hasher_unavailable"] = 1
    try:
        yield hasher
    finally:
        if hasher is not None:
            hasher.finish()


def spans_hashed(hasher: image.PageFileHasher | None, steps: Steps) -> image.SpanDigests | None:
    """What the hasher did while CRIU wrote (its count in the record); None without one."""
    if hasher is None:
        return None
    known = hasher.finish()
    steps.counts["spans_hashed_while_dumping"] = sum(len(spans) for _, spans in known.values())
    if hasher.error is not None:
        steps.counts["span_hasher_stopped"] = 1
    return known


@contextmanager
def cuda_broker(run_dir: criu.RunDir, gpu: bool, config: Config, steps: Steps) -> Iterator[dict[str, str]]:
    """For one CRIU run with CUDA processes: the executor answers its plugin's cuda-checkpoint runs
    (snapguard.cuda.Broker); the environment entry that names it, or none when it cannot start
    (the tool then answers itself, as before). How many runs it answered goes into the record's
    `counts`. On unless the config says `cuda_broker = false` (or SNAPGUARD_CUDA_BROKER_ON=0): on
    the H200, five interleaved pairs with and without it gave a median stall of 3.97 against 4.69 s
    and a warm restore of 3.14 against 3.74 s, and the GPU fault matrix passed with it
    (bench/results/h200x2/README.md)."""
    if not gpu or not config.cuda_broker:
        yield {}
        return
    from .. import cuda

    try:
        with steps.timed("cuda_broker_start"):
            broker = cuda.Broker(os.path.join(run_dir.path, "cuda.sock"))
    except OSError:  # a state directory too deep for a socket's name, say
        steps.counts["cuda_broker_unavailable"] = 1
        yield {}
        return
    try:
        yield {cuda.BROKER_ENV: broker.path}
    finally:
        broker.close()
        steps.counts["cuda_broker_answers"] = broker.served
        if broker.abandoned:
            steps.counts["cuda_broker_abandoned"] = 1


def sweep_children(config: Config, steps: Steps) -> list[Finding]:
    """A preflight check (`report.run("children", ...)`): the children an executor that died
    with its watchdog left (runc, CRIU), recorded in the state directory's `children`, ended now
    (a CHILDREN_LEFT_BEHIND warning naming their groups); and this run's children recorded there
    while they run. A record directory that cannot be kept is a warning (a later run then cannot
    clear what this one leaves), never a refusal."""
    from .. import children

    from .. import runc

    try:
        with steps.timed("children_sweep"):
            directory = files.ensure_private_dir(os.path.join(config.state_dir, "children"))
            ended = children.sweep(directory)
            thawed = runc.sweep_freezers(directory)  # after the groups: no CRIU of theirs is left
    except (OSError, UntrustedPathError) as e:
        children.keep_records(None)
        return [Finding(Reason.PREFLIGHT_FAILED, f"the children's records in {config.state_dir} cannot be kept: {e}",
                        Severity.WARNING, {"state_dir": config.state_dir})]
    children.keep_records(directory)
    found = []
    if ended:
        steps.counts["children_ended"] = len(ended)
        found.append(Finding(Reason.CHILDREN_LEFT_BEHIND, f"{len(ended)} process group(s) an earlier executor left "
                             "running were ended", Severity.WARNING,
                             {"groups": [{"pgid": r["pgid"], "executor": r["executor"]} for r in ended]}))
    if thawed:
        steps.counts["freezers_thawed"] = len(thawed)
        found.append(Finding(Reason.CHILDREN_LEFT_BEHIND, f"{len(thawed)} container(s) an earlier executor left "
                             "frozen were thawed", Severity.WARNING,
                             {"freezers": [{"container": r.get("container"), "freezer": r["freezer"],
                                            "executor": r["executor"]} for r in thawed]}))
    return found


def sweep_spills(config: Config, steps: Steps, warnings: list[Finding], dirs: tuple[str, ...] = ()) -> str | None:
    """The spill journal's directory in the state directory, swept first: the names of spills
    whose trainers are gone, left by an executor that died before it could remove them
    (`_spill.sweep`), removed now, and those no executor heard of whose trainers are gone
    (`_spill.sweep_orphans`), in the node's spill directories and `dirs` (the host directories the
    snapshot's containers spill into). A journal that cannot be kept is a warning (spills of
    trainers that die with their executor may then stay), not a refused snapshot: None."""
    try:
        with steps.timed("spill_sweep"):
            # no journal needed: found by their names
            orphans = _spill.sweep_orphans(tuple(dict.fromkeys(_spill.DEFAULT_SPILL_DIRS + dirs)))
            journal = files.ensure_private_dir(os.path.join(config.state_dir, "spills"))
            removed = _spill.sweep(journal)
    except (OSError, UntrustedPathError) as e:
        warnings.append(Finding(Reason.PREFLIGHT_FAILED, f"the spill journal in {config.state_dir} cannot be kept: "
                                f"{e}; spills whose trainer and executor both die may stay", Severity.WARNING,
                                {"state_dir": config.state_dir}))
        return None
    if removed:
        steps.counts["spills_removed"] = len(removed)
    if orphans:
        steps.counts["orphan_spills_removed"] = len(orphans)
    return journal
