"""The snapshot and restore sequences, once, for both entry points.

checkpoint: target -> process tree -> preflight (host and workload) -> claim the tree -> image
directory -> take point -> CUDA lock + checkpoint -> CRIU (through the runner) -> CUDA restore +
unlock and release (leave-running or failure) -> seal -> result.
restore: verify the image -> compare with this host -> CRIU (through the runner) -> the restored
processes run, CUDA ones `running` -> release the take point -> result.

Every step runs under `_Steps.step`, which times it and turns an OSError or ValueError escaping it
into that step's typed reason, so nothing below the entry points reaches a user untyped.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from .. import criu, files, gpu_suspend, image, prefetch, preflight, procfs
from ..config import Config, resolve_cuda_checkpoint
from ..hooks import take
from ..reasons import Finding, Reason, Severity, SnapguardError
from ..trust import UntrustedPathError
from . import _spill
from ._request import Request
from ._runners import Runner, log_path

__all__ = ["checkpoint", "restore"]


class _Steps:
    """Timings of the steps of one run, and the step's reason for any OS error inside it."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextmanager
    def step(self, name: str, reason: Reason, **evidence: Any) -> Iterator[None]:
        """A step: timed, and any OS error inside it typed with `reason`."""
        with self.timed(name):
            try:
                yield
            except UntrustedPathError as e:
                if e.unusable:  # missing, not a directory, name too long: not a matter of who controls it
                    raise SnapguardError(reason, f"{name}: {e}",
                                         evidence={**evidence, "step": name, "path": e.path}) from None
                raise SnapguardError(Reason.UNTRUSTED_PATH, str(e), evidence={**evidence, "path": e.path}) from None
            except (OSError, ValueError) as e:
                detail = f"{e.strerror or e}: {e.filename}" if isinstance(e, OSError) and e.filename else \
                    (e.strerror if isinstance(e, OSError) and e.strerror else str(e))
                raise SnapguardError(reason, f"{name}: {detail}", evidence={**evidence, "step": name}) from None

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time what runs inside under `<name>_s` (added to it if it ran before). Also a part of a
        step on its own: `criu_s`, the runner's CRIU (or runc) run within `dump_s` or `restore_s`,
        whose rest is the run directory and the broker; CRIU's own log marks then split `criu_s`
        into CRIU's work and its start and exit."""
        t = time.monotonic()
        try:
            yield
        finally:
            self.timings[f"{name}_s"] = self.timings.get(f"{name}_s", 0.0) + time.monotonic() - t

    def done(self) -> dict[str, float]:
        return {**self.timings, "total_s": time.monotonic() - self.t0}


@contextmanager
def _claimed(config: Config, pids: list[int], image_dir: str) -> Iterator[None]:
    """One snapguard run per process and per image at a time: a second checkpoint of a tree being
    checkpointed (or any run on the same image) is refused, not raced. flock: a run that dies
    lets go by itself."""
    lock_dir = files.ensure_private_dir(os.path.join(config.state_dir, "locks"))
    held: list[int] = []
    try:
        keys = sorted({f"pid-{p}" for p in pids} | {"image-" + image_dir.strip("/").replace("/", "%")[-200:]})
        for key in keys:
            fd = os.open(os.path.join(lock_dir, key), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            held.append(fd)
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
        for fd in held:
            os.close(fd)


def _network_lock(req: Request, own_netns: bool, conns: list[dict[str, Any]]) -> tuple[str | None, bool]:
    """(CRIU's --network-lock, whether iptables must exist). CRIU locks a namespace of the tree's
    own, or each established connection in the host's, with iptables; connections between
    processes of the tree are frozen with it and need no lock, and a tree in the host's namespace
    with none needs none either (GPU nodes often have no iptables)."""
    if req.network_lock == "skip" or (req.network_lock == "auto" and procfs.internal_only(conns) and not own_netns):
        return "skip", False
    if req.network_lock == "nftables":
        return "nftables", False
    return None, own_netns or bool(conns)


def _criu_errors(log: str) -> tuple[str, list[dict[str, Any]]]:
    errors = criu.read_log_errors(log)
    return "; ".join(str(e) for e in errors), [{"where": e.where, "message": e.message, "context": e.context}
                                               for e in errors]


def _record(result: dict[str, Any], steps: _Steps, log: str) -> dict[str, Any]:
    return {**result, "ok": True, "timings": steps.done(), "criu_marks": criu.log_marks(log),
            **({"counts": steps.counts} if steps.counts else {})}


# Host checks a snapshot never takes from an earlier run: NVML's inventory names the CUDA pids (and
# their GPU memory) of the moment, which the snapshot suspends and records
FRESH_HOST_CHECKS = ("nvidia-driver",)


def checkpoint(runner: Runner, req: Request, config: Config, *,
               host_checks: preflight.HostChecks | None = None) -> dict[str, Any]:
    """Snapshot the runner's target into req.image_dir; a result record, or SnapguardError.
    `host_checks`: host checks run earlier (`preflight.host_checks_ahead`, kept warm by the agent):
    the preflight reuses those that passed and whose inputs match (CRIU path, whether the GPU is
    needed, the config) and runs the rest, NVML's inventory always; the timings then carry
    `host_checks_age_s`, how old they were."""
    steps = _Steps()
    ahead = None
    if host_checks is not None and host_checks.made_under(config):  # another config's: none reused
        steps.timings["host_checks_age_s"] = host_checks.age_s()
        ahead = host_checks.passed(leave=FRESH_HOST_CHECKS)
    with steps.step("preflight", Reason.PREFLIGHT_FAILED):
        pid = runner.target_pid()
        tree = procfs.process_tree(pid)
        inv = procfs.inventory(tree)
        report = preflight.Report(runner.describe())
        own_netns = procfs.own_netns(pid)
        conns = procfs.tree_tcp(inv) if req.tcp_established else []
        network_lock, needs_iptables = _network_lock(req, own_netns, conns)
        preflight.host_checks(report, config, gpu_required=inv.uses_gpu, network_lock=needs_iptables, ahead=ahead)
        inv.attach_gpu(report.facts.get("gpu"))
        found = take.trainers(tree)
        # the moved bytes leave the process (take.Spill) only through a directory the executor
        # reaches and CRIU does not dump: the host's own, or a container's bind of a host directory
        spill = take.spill_dirs(found, containers=not runner.uses_host_pids)
        preflight.workload_checks(report, inv, req.tcp_established, trainers=found)
        report.raise_blockers()
        cuda_pids = [p.pid for p in inv.cuda_processes()]
    with _claimed(config, tree, req.image_dir), ExitStack() as cleanup:
        with steps.step("image_dir", Reason.IMAGE_WRITE_FAILED, image=req.image_dir):
            if os.path.islink(req.image_dir):  # seal refuses it, but only after CRIU dumped through it
                raise SnapguardError(Reason.UNTRUSTED_PATH, f"image directory {req.image_dir} is a symlink: "
                                     "snapguard never follows one into an image; name the directory itself",
                                     evidence={"image": req.image_dir})
            files.ensure_private_dir(req.image_dir)
            files.ensure_private_dir(req.work_dir)
        with steps.step("take", Reason.PREFLIGHT_FAILED):
            # the node's spill directories, and the host directories containers spill into here
            mapped = tuple(where[1] for where in spill.values() if where is not None)
            journal = _sweep_spills(config, steps, report.warnings, mapped) if spill else None
            figures, take_warnings, _, spills = take.hold(found, cuda_pids, req.timeouts.take_wait_s, spill=spill)
            try:
                copies = _spill.SpillCopies(req.image_dir, spills, figures, journal)
            except BaseException:
                take.release_all(found, spills)
                for held_spill in spills.values():
                    held_spill.close()
                raise
            cleanup.callback(copies.close)
        if not req.leave_running:
            copies.start()  # beside CRIU's run: the trainer is gone with it
        warnings = report.warnings + take_warnings
        options = criu.CriuOptions(images_dir=req.image_dir, work_dir=req.work_dir, libdir=config.criu_libdir,
                                   timeout_s=req.timeouts.criu_s, leave_running=req.leave_running,
                                   tcp_established=req.tcp_established, network_lock=network_lock)
        log = log_path(req, restore=False)
        try:
            with steps.step("cuda_suspend", Reason.CUDA_CHECKPOINT_FAILED):
                gpu_suspend.suspend(cuda_pids, req.timeouts.criu_s)
        except SnapguardError:
            take.release_all(found, spills)
            raise
        # A stop snapshot's page files are hashed while CRIU writes them. Not a leave-running
        # one's: its seal comes after the stall, and the hashing takes cores and memory bandwidth
        # from CRIU (on two cores CRIU's run took 4.56 s against 3.95,
        # bench/results/hash-while-dumping-*) and from the CUDA resume, both inside the stall.
        hasher = None if req.leave_running else _page_file_hasher(req.image_dir, config, steps)
        try:
            rc: int | None = None
            failure: SnapguardError | None = None
            try:
                with steps.step("dump", Reason.CRIU_DUMP_FAILED), \
                        criu.RunDir(config.state_dir, config.criu, resolve_cuda_checkpoint(config)) as run_dir, \
                        _cuda_broker(run_dir, bool(cuda_pids), config, steps) as broker_env:
                    with steps.timed("criu"):
                        rc = runner.dump(req, options, {**run_dir.environment(options), **broker_env})
            except SnapguardError as e:  # a deadline passed, or runc or CRIU did not start
                failure = e
                runner.after_failed_dump()
            goes_on = failure is not None or rc != 0 or req.leave_running  # the image is on disk, or there is none
            outcomes: dict[int, str] = {}
            if goes_on:
                with steps.step("cuda_resume", Reason.CUDA_STATE_WEDGED):
                    outcomes = gpu_suspend.resume(cuda_pids)
                unreleased = take.release_all(found, spills)
                if unreleased:  # each goes on by itself after its hold limit
                    steps.counts["trainers_not_released"] = len(unreleased)
                if failure is None and rc == 0:
                    copies.start()  # a leave-running snapshot's: after the stall
            wedged = gpu_suspend.wedged(outcomes)
            evidence = {**runner.identity(), "cuda_recovery": outcomes, "log": log}
            if failure is not None:
                failure.failure.workload_intact = procfs.alive(pid) and not wedged
                failure.failure.evidence.update(evidence)
                failure.failure.warnings = warnings
                raise failure
            if rc != 0:
                quoted, errors = _criu_errors(log)
                raise SnapguardError(Reason.CRIU_DUMP_FAILED,
                                     quoted or runner.failure_detail() or f"exit {rc}, no CRIU error in {log}",
                                     workload_intact=procfs.alive(pid) and not wedged,
                                     evidence={**evidence, "exit": rc, "errors": errors}, warnings=warnings)
            if wedged:
                raise SnapguardError(Reason.CUDA_STATE_WEDGED, f"after the dump: {wedged}", workload_intact=False,
                                     evidence=evidence, warnings=warnings)
            copies.trainers_ended = not req.leave_running  # CRIU ended them: their spills' names go
            gpu_facts = report.facts.get("gpu")
            try:
                with steps.step("seal", Reason.IMAGE_WRITE_FAILED, image=req.image_dir):
                    if copies.copies:
                        with steps.timed("spill_wait"):
                            steps.timings["spill_write_s"] = copies.wait(req.timeouts.run_s)
                    known = _spans_hashed(hasher, steps)
                    manifest = _seal(req, runner, report, inv, figures, own_netns, network_lock, conns, cuda_pids,
                                     gpu_facts, known)
            except SnapguardError as e:
                # a stop snapshot's workload is gone with CRIU's dump: its unmarked image is all there is
                e.failure.workload_intact = req.leave_running and procfs.alive(pid)
                e.failure.evidence.setdefault("image", req.image_dir)
                e.failure.evidence["image_marked"] = False
                e.failure.warnings = warnings
                raise
        finally:
            if hasher is not None:
                hasher.finish()  # after a failure: its threads end and its files close
    return _record({
        "operation": "checkpoint", **runner.identity(), "pid": pid, "image": req.image_dir,
        "leave_running": req.leave_running, "network_lock": network_lock, "cuda_pids": cuda_pids,
        "image_bytes": manifest["image_bytes"], "files": len(manifest["files"]), "take_point": figures,
        "warnings": [w.to_dict() for w in warnings],
    }, steps, log)


def _seal(req: Request, runner: Runner, report: preflight.Report, inv: procfs.Inventory,
          figures: dict[int, Any], own_netns: bool, network_lock: str | None, conns: list[dict[str, Any]],
          cuda_pids: list[int], gpu_facts: dict[str, Any] | None,
          known: image.SpanDigests | None) -> dict[str, Any]:
    """The manifest's fields, hashed files and, last, the completion marker."""
    return image.seal(req.image_dir, {
        **runner.identity(),
        **({"fence_epoch": req.fence_epoch} if req.fence_epoch is not None else {}),
        "leave_running": req.leave_running,
        "own_netns": own_netns,
        "network_lock": network_lock,
        "tcp_connections": len(conns),
        "criu_version": report.facts["criu_version"],
        "host": report.facts["host"],
        "processes": inv.summary(),
        "take_point": {str(p): f for p, f in figures.items()},
        "gpu": preflight.gpu.image_gpu_facts(gpu_facts, inv.pids) if gpu_facts and cuda_pids else None,
    }, known)


def _page_file_hasher(image_dir: str, config: Config, steps: _Steps) -> image.PageFileHasher | None:
    """The page files' hasher for a stop snapshot's dump (config `hash_while_dumping`), with a
    thread of its own for every four cores, at most three (on the H200 CRIU writes 2-3 GB/s and
    the seal hashed 0.7-0.9 GB/s a thread: three keep most of the pace and leave CRIU its cores;
    spans still queued at the seal go to its own pool). None when it is off or cannot start (the
    seal hashes all)."""
    if not config.hash_while_dumping:
        return None
    try:
        return image.PageFileHasher(image_dir, threads=min(3, max(1, (os.cpu_count() or 1) // 4)))
    except (OSError, RuntimeError):  # RuntimeError: no thread could start
        steps.counts["span_hasher_unavailable"] = 1
        return None


def _spans_hashed(hasher: image.PageFileHasher | None, steps: _Steps) -> image.SpanDigests | None:
    """What the hasher did while CRIU wrote (its count in the record); None without one."""
    if hasher is None:
        return None
    known = hasher.finish()
    steps.counts["spans_hashed_while_dumping"] = sum(len(spans) for _, spans in known.values())
    if hasher.error is not None:
        steps.counts["span_hasher_stopped"] = 1
    return known


def _held(manifest: dict[str, Any]) -> bool:
    """Every process of the image the take point knew was held at a step boundary when it was
    dumped: restored, it waits there until released."""
    points = manifest.get("take_point") or {}
    return bool(points) and all(isinstance(f, dict) and f.get("ok") for f in points.values())


class _Digests:
    """The image's checksums: checked before CRIU, or, for a held workload, in a thread while
    CRIU restores it, the result awaited before anything releases the restored workload."""

    def __init__(self, inspected: image.Inspected, held: bool) -> None:
        self.inspected, self.held = inspected, held
        self._error: SnapguardError | None = None
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        self.inspected.check_digests()

    def start(self) -> None:
        if self.held:
            self._thread = threading.Thread(target=self._run, name="verify", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self.inspected.check_digests()
        except SnapguardError as e:
            self._error = e
        except OSError as e:
            self._error = SnapguardError(Reason.IMAGE_CORRUPT, f"verify: {e.strerror or e}",
                                         evidence={"image": self.inspected.image_dir})

    def result(self) -> SnapguardError | None:
        if self._thread is not None:
            self._thread.join()
        return self._error


def _pid_conflicts(manifest: dict[str, Any], grace_s: float = 5.0) -> list[Finding]:
    """Pids of the image in use here. The processes a stop snapshot killed may still be zombies
    waiting for their new parent to reap them: those are given a few seconds to go."""
    wanted = [p["pid"] for p in manifest.get("processes") or [] if isinstance(p, dict) and isinstance(p.get("pid"), int)]
    deadline = time.monotonic() + grace_s
    while any(procfs.process_state(p) == "Z" for p in wanted) and time.monotonic() < deadline:
        time.sleep(0.02)
    taken = [p for p in wanted if procfs.process_state(p) != "gone"]
    if not taken:
        return []
    return [Finding(Reason.PID_CONFLICT, f"pid(s) {', '.join(map(str, taken))} of the image are in use here",
                    evidence={"pids": taken})]


def _device_map(req: Request, report: preflight.Report, config: Config) -> list[tuple[str, str]] | None:
    """The GPU remapping a restore needs, checked to be one the cuda-checkpoint in use applies."""
    if req.device_map is not None:
        pairs: list[tuple[str, str]] | None = _resolve_device_map(req.device_map, report)
    else:
        pairs = next(([(old, new) for old, new in f.evidence["device_map"]] for f in report.findings
                      if f.reason is Reason.GPU_IDENTITY_MISMATCH and "device_map" in f.evidence), None)
    if not pairs:
        return None
    tool = resolve_cuda_checkpoint(config)
    from .. import children

    helps = children.run_captured([tool, "-h"], timeout_s=30, what="cuda-checkpoint -h",
                                  reason=Reason.CUDA_PLUGIN_UNAVAILABLE).stdout if tool else ""
    if "SNAPGUARD_DEVICE_MAP" not in helps:
        raise SnapguardError(Reason.GPU_IDENTITY_MISMATCH,
                             f"the image's GPUs are not here and {tool} cannot take a device map from CRIU's "
                             "plugin; install snapguard-cuda-checkpoint at the pinned path",
                             evidence={"device_map": pairs, "cuda_checkpoint": tool})
    return pairs


def _resolve_device_map(given: tuple[tuple[str, str], ...], report: preflight.Report) -> list[tuple[str, str]]:
    """An operator's map, OLD=NEW pairs: a GPU UUID as is, an index on the OLD side naming the
    image's GPU of that index (its manifest), on the NEW side this host's (NVML). Every NEW GPU
    must be here and of the image GPU's model: the driver refuses anything else, later and less
    clearly. The map is completed into one naming every GPU of the image's node, the ones left
    out onto this host's unused GPUs in index order: r580's cuCheckpointProcessRestore refuses a
    map that leaves any out (CUDA_ERROR_INVALID_VALUE, even for a process that saw one GPU
    through CUDA_VISIBLE_DEVICES; bench/results/h200x2/remap-probe-*.json)."""
    image_gpus = ((report.facts.get("manifest") or {}).get("gpu") or {}).get("gpus") or []
    host_gpus = (report.facts.get("gpu") or {}).get("gpus") or []

    def pick(gpus: list[dict[str, Any]], key: str, side: str) -> dict[str, Any]:
        found = [g for g in gpus if (str(g.get("index")) == key if key.isdigit() else g.get("uuid") == key)]
        if not found:
            where = "the image" if side == "old" else "this host"
            raise SnapguardError(Reason.GPU_IDENTITY_MISMATCH, f"device map: {where} has no GPU {key}",
                                 evidence={"device_map": [list(p) for p in given], "gpu": key})
        return found[0]

    pairs = []
    for old_key, new_key in given:
        old = pick(image_gpus, old_key, "old") if image_gpus or old_key.isdigit() else {"uuid": old_key}
        new = pick(host_gpus, new_key, "new")
        if old.get("name") not in (None, new.get("name")):
            raise SnapguardError(Reason.GPU_MODEL_MISMATCH, f"device map {old_key}={new_key}: the image's GPU is "
                                 f"a {old['name']}, this host's is a {new.get('name')}",
                                 evidence={"device_map": [list(p) for p in given]})
        pairs.append((str(old["uuid"]), str(new["uuid"])))
    if len({o for o, _ in pairs}) != len(pairs) or len({n for _, n in pairs}) != len(pairs):
        raise SnapguardError(Reason.USAGE_ERROR, "device map: each GPU may appear once on each side",
                             evidence={"device_map": pairs})
    left_old = [str(g["uuid"]) for g in image_gpus if str(g["uuid"]) not in {o for o, _ in pairs}]
    left_new = [str(g["uuid"]) for g in host_gpus if str(g["uuid"]) not in {n for _, n in pairs}]
    if len(left_new) < len(left_old):
        raise SnapguardError(Reason.GPU_COUNT_MISMATCH, f"device map: the image's node had {len(image_gpus)} GPU(s), "
                             f"this host has {len(host_gpus)}; the driver needs every one of them mapped",
                             evidence={"device_map": pairs})
    return pairs + list(zip(left_old, left_new))


@contextmanager
def _cuda_broker(run_dir: criu.RunDir, gpu: bool, config: Config, steps: _Steps) -> Iterator[dict[str, str]]:
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


def _check_restored(manifest: dict[str, Any], pid: int) -> dict[int, str]:
    """The restored root runs, and every process the image had a CUDA context in is `running`.
    A container's processes keep their pids inside its namespace: they are found by those."""
    if not procfs.alive(pid):
        raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"the restored process {pid} is gone",
                             workload_intact=False, evidence={"pid": pid})
    wanted = [p.get("nspid", p["pid"]) for p in manifest.get("processes") or [] if p.get("gpu")]
    if not wanted:
        return {}
    by_nspid = procfs.pid_map(pid)
    missing = [n for n in wanted if n not in by_nspid]
    if missing:
        raise SnapguardError(Reason.CUDA_RESTORE_FAILED, f"restored CUDA process(es) {missing} are gone",
                             workload_intact=False, evidence={"missing": missing})
    from .. import cuda

    driver = cuda.load()
    states = {by_nspid[n]: driver.state(by_nspid[n]) for n in wanted}
    if any(s != "running" for s in states.values()):
        raise SnapguardError(Reason.CUDA_RESTORE_FAILED, f"restored CUDA processes are not running: {states}",
                             workload_intact=False, evidence={"states": states})
    return states


def _sweep_spills(config: Config, steps: _Steps, warnings: list[Finding], dirs: tuple[str, ...] = ()) -> str | None:
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


def _by_restored_pid(wanted: dict[int, tuple[str, int]], manifest: dict[str, Any],
                     root_pid: int) -> dict[int, tuple[str, int]]:
    """`wanted` (keyed by the host pids the trainers had when dumped) keyed by the restored
    trainers' host pids: each found by the pid it has in its own namespace, which the executor
    recorded at the dump (the manifest's `processes[].nspid`) and CRIU restores. A trainer that
    cannot be found, or not told apart (two restored processes with that pid, in nested
    namespaces), is CRIU_RESTORE_FAILED: its spill must not go to another."""
    recorded = {p["pid"]: p.get("nspid", p["pid"]) for p in manifest.get("processes") or []}
    now: dict[int, list[int]] = {}
    for host in procfs.process_tree(root_pid):
        now.setdefault(procfs.nspid(host), []).append(host)
    out: dict[int, tuple[str, int]] = {}
    for key, spill in wanted.items():
        found = now.get(recorded.get(key, -1), [])
        if len(found) != 1 or found[0] in out:
            raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"the restored trainer that was pid {key} (pid "
                                 f"{recorded.get(key)} in its namespace) cannot be told apart in the restored tree: "
                                 "its moved bytes cannot be passed back", evidence={"pid": key, "found": found})
        out[found[0]] = spill
    return out


def _release_restored(runner: Runner, req: Request, pid: int, manifest: dict[str, Any],
                      wanted: dict[int, tuple[str, int]], steps: _Steps, report: preflight.Report) -> None:
    """Release the restored trainers. One whose spill cannot be passed to it (it does not answer,
    or the file is not as listed) would wake without its optimizer's bytes: the restored tree is
    ended instead, the image left whole for another restore."""
    restored = take.trainers(procfs.process_tree(pid))
    try:
        with steps.step("release", Reason.CRIU_RESTORE_FAILED, image=req.image_dir):
            if not runner.uses_host_pids:
                # a container's host pids are new; the pids its trainers see are CRIU's to restore
                wanted = _by_restored_pid(wanted, manifest, pid)
            missing = sorted(set(wanted) - set(restored))
            if missing:
                raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"restored trainer(s) {missing} do not answer at "
                                     "their take point: their moved bytes cannot be passed back",
                                     evidence={"image": req.image_dir, "missing": missing})
            spills = _spill.open_image_spills(req.image_dir, wanted)
            try:
                unreleased = take.release_all(restored, spills)
            finally:
                for spill in spills.values():
                    spill.close()
            failed = {pid: why for pid, why in unreleased.items() if pid in wanted}
            if failed:
                raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"restored trainer(s) {sorted(failed)} did not take "
                                     f"the release with their moved bytes' file: {'; '.join(failed.values())}",
                                     evidence={"image": req.image_dir, "failed": {str(p): w for p, w in failed.items()}})
    except SnapguardError as e:
        e.failure.evidence["restored_tree_ended"] = runner.discard(pid)
        e.failure.workload_intact = False
        e.failure.warnings = report.warnings
        raise


class _ReadAhead:
    """A restore's read-ahead (config `restore_prefetch`, snapguard.prefetch): CRIU, its
    libraries, its plugins and cuda-checkpoint read into memory by a thread from the restore's
    start, beside the preflight; then the image's small files; both before the digest check's
    large reads begin, which CRIU's start otherwise queues behind on a cold page cache (on the
    H200, `criu --version` from a cold cache takes 34 ms on an idle disk, 8 ms with its files read
    ahead; a cold restore's CRIU logged its first line 0.97-1.52 s after the call without the
    read-ahead, 0.63-0.73 s with the files only asked for, 0.14-0.19 s, as warm, with them read
    through: bench/results/h200/offload-2026-12-01/run13b-d)."""

    SMALL_FILE_BYTES = 4 << 20  # CRIU's own images but its pages: KBs each

    def __init__(self, config: Config) -> None:
        self.files, self.bytes = 0, 0
        self._thread: threading.Thread | None = None
        if config.restore_prefetch:
            self._thread = threading.Thread(target=self._tools, args=(config,), name="read-ahead", daemon=True)
            self._thread.start()

    def _tools(self, config: Config) -> None:
        try:
            plugins = prefetch.criu_plugins(config.criu_libdir)
            tool = resolve_cuda_checkpoint(config)
            self.files, self.bytes = prefetch.read_ahead([config.criu, *plugins, *([tool] if tool else [])],
                                                         wait=True)
        except Exception:  # a hint, in a thread of its own: what it could not read, its program reads as before
            pass

    def image(self, inspected: image.Inspected, steps: _Steps) -> None:
        """The tools' thread awaited (a second at most), the image's small files read."""
        if self._thread is None:
            return
        with steps.timed("read_ahead"):
            self._thread.join(1.0)
            files, size = inspected.read_ahead(self.SMALL_FILE_BYTES)
        steps.counts["read_ahead_files"] = self.files + files
        steps.counts["read_ahead_bytes"] = self.bytes + size


def restore(runner: Runner, req: Request, config: Config, *,
            host_checks: preflight.HostChecks | None = None) -> dict[str, Any]:
    """Restore req.image_dir through the runner; a result record, or SnapguardError.
    `host_checks`: the host checks already run for this restore (while its image was fetched):
    the preflight reuses those that match the manifest's needs and runs the rest; the timings
    then say how long they took (`host_checks_s`, not part of `total_s`) and how long the
    restore waited for them after the fetch (`host_checks_wait_s`)."""
    steps = _Steps()
    ahead = _ReadAhead(config)
    if host_checks is not None:
        steps.timings["host_checks_s"] = host_checks.seconds
        steps.timings["host_checks_wait_s"] = host_checks.waited_s
    with steps.step("preflight", Reason.PREFLIGHT_FAILED, image=req.image_dir):
        report = preflight.manifest_report(req.image_dir, config, criu=config.criu, exact=True,
                                           verified={name: (digest, (dev, ino))
                                                     for name, digest, dev, ino in req.verified_digests},
                                           defer_digests=True, ahead=host_checks)
        manifest = report.facts.get("manifest")
        digests = _Digests(report.facts["inspected"], held=_held(manifest)) if manifest is not None else None
        if digests is not None and not digests.held:
            with steps.step("verify", Reason.IMAGE_CORRUPT, image=req.image_dir):
                digests.check()  # nothing would hold the restored tree: the whole image first, as always
        if manifest is not None and runner.uses_host_pids:
            report.run("pid-conflicts", lambda: _pid_conflicts(manifest))
        report.raise_blockers()
        assert manifest is not None and digests is not None
        wanted = _spill.image_spills(manifest, req.image_dir)  # the files the release passes back
        device_map = _device_map(req, report, config)
    options = criu.CriuOptions(images_dir=req.image_dir, work_dir=req.work_dir, libdir=config.criu_libdir,
                               timeout_s=req.timeouts.criu_s, tcp_established=req.tcp_established,
                               network_lock="skip" if manifest.get("network_lock") == "skip" else None,
                               log_file=os.path.basename(log_path(req, restore=True)))
    log = log_path(req, restore=True)
    with _claimed(config, [], req.image_dir):
        with steps.step("work_dir", Reason.CRIU_RESTORE_FAILED):
            files.ensure_private_dir(req.work_dir)
            if wanted:
                _sweep_spills(config, steps, report.warnings)
        ahead.image(report.facts["inspected"], steps)
        digests.start()  # a held workload's image is hashed while CRIU reads it
        try:
            with steps.step("restore", Reason.CRIU_RESTORE_FAILED), \
                    criu.RunDir(config.state_dir, config.criu, resolve_cuda_checkpoint(config)) as run_dir, \
                    _cuda_broker(run_dir, bool(manifest.get("gpu")), config, steps) as broker_env:
                with steps.timed("criu"):
                    rc = runner.restore(req, options, {**run_dir.environment(options, device_map), **broker_env})
        finally:
            with steps.step("verify_wait", Reason.IMAGE_CORRUPT, image=req.image_dir):
                corrupt = digests.result()
        if corrupt is not None:
            # the copy CRIU made from an image that is not the one sealed never runs past its take
            # point: ended before anything releases it
            if rc == 0:
                try:
                    corrupt.failure.evidence["restored_tree_ended"] = runner.discard(runner.restored_pid(req))
                except SnapguardError:
                    corrupt.failure.evidence["restored_tree_ended"] = None
            corrupt.failure.workload_intact = False
            corrupt.failure.warnings = report.warnings
            raise corrupt
        if rc != 0:
            quoted, errors = _criu_errors(log)
            raise SnapguardError(Reason.CRIU_RESTORE_FAILED,
                                 quoted or runner.failure_detail() or f"exit {rc}, no CRIU error in {log}",
                                 evidence={"image": req.image_dir, "exit": rc, "log": log, "errors": errors},
                                 warnings=report.warnings)
        with steps.step("confirm", Reason.CRIU_RESTORE_FAILED):
            pid = runner.restored_pid(req)
            root_pid = manifest.get("root_pid")
            if runner.uses_host_pids and isinstance(root_pid, int) and pid != root_pid:
                raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"CRIU exited 0 naming pid {pid}, but a bare "
                                     f"restore brings the image's root back as pid {root_pid}",
                                     workload_intact=False, evidence={"pid": pid, "root_pid": root_pid})
            try:
                states = _check_restored(manifest, pid)
            except SnapguardError as e:
                # CRIU said it restored, but what runs is not the workload (a CUDA process left
                # checkpointed, a root gone): it is ended, so that the whole image can be restored
                # again or the caller falls back, instead of a broken copy holding the pids and GPU
                e.failure.evidence["restored_tree_ended"] = runner.discard(pid)
                e.failure.evidence["image"] = req.image_dir
                e.failure.warnings = report.warnings
                raise
        if manifest.get("take_point"):
            # the workload was held at its take point when dumped: let it go on, each trainer whose
            # bytes the image holds apart (its spill) with that file to reload from
            _release_restored(runner, req, pid, manifest, wanted, steps, report)
    return _record({
        "operation": "restore", **runner.identity(), "pid": pid, "image": req.image_dir, "cuda_states": states,
        "device_map": device_map, "image_epoch": manifest["epoch"],
        "warnings": [w.to_dict() for w in report.warnings],
    }, steps, log)
