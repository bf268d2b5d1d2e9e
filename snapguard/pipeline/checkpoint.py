"""The snapshot: target -> process tree -> preflight (host and workload) -> claim the tree ->
image directory -> take point -> CUDA lock + checkpoint -> CRIU (through the runner) -> CUDA
restore + unlock and release (leave-running or failure) -> seal -> result.

What the snapshot holds while it runs (the claim, the hold, the suspended CUDA processes, the
hasher, CRIU's run directory and broker) is entered in one ExitStack (`scopes`): a failure
anywhere lets go of all of it through their exits. Every step runs under `Steps.step`.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from .. import criu, files, gpu_suspend, image, preflight, procfs, tally
from ..config import Config, resolve_cuda_checkpoint
from ..takepoint import client as take
from ..takepoint import spill as _spill
from ..reasons import Finding, Reason, SnapguardError
from . import scopes
from ._request import Request
from ._runners import Runner, RuncRunner, log_path
from ._steps import Steps, criu_errors

__all__ = ["FRESH_HOST_CHECKS", "checkpoint"]

# Host checks a snapshot never takes from an earlier run: NVML's inventory names the CUDA pids (and
# their GPU memory) of the moment, which the snapshot suspends and records
FRESH_HOST_CHECKS = ("nvidia-driver",)


@dataclass
class _Target:
    """What the preflight found: the tree, its processes, its trainers and its network."""

    pid: int
    tree: list[int]
    inv: procfs.Inventory
    report: preflight.Report
    own_netns: bool
    conns: list[dict[str, Any]]
    network_lock: str | None
    trainers: dict[int, dict[str, Any]]
    spill: dict[int, tuple[str, str] | None]
    cuda_pids: list[int]
    checks_s: dict[str, float]  # where preflight_s went: each check run now (not those reused), seconds


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


def _preflight(runner: Runner, req: Request, config: Config, steps: Steps,
               host_checks: preflight.HostChecks | None) -> _Target:
    ahead = None
    if host_checks is not None and host_checks.made_under(config):  # another config's: none reused
        steps.timings["host_checks_age_s"] = host_checks.age_s()
        ahead = host_checks.passed(leave=FRESH_HOST_CHECKS)
    with steps.step("preflight", Reason.PREFLIGHT_FAILED):
        report = preflight.Report(runner.describe())
        # what a killed executor left, first: a freezer it left as it was not, before this run reads it
        report.run("children", lambda: scopes.sweep_children(config, steps))
        pid = runner.target_pid()
        tree = procfs.process_tree(pid)
        inv = procfs.inventory(tree)
        # a paused container (containerd's CRI pauses it before its checkpoint) is resumed when the
        # take point or the CUDA lock must reach it; `runner.settle` pauses it again at the end
        hooked = [p for p in tree if take.socket_for(p)]
        if (inv.uses_gpu or hooked) and runner.thaw():
            steps.counts["container_thawed"] = 1
        # one still stopped or frozen would leave the take point's question unanswered in its
        # socket (CRIU refuses the dump for it) and cannot be held: refused, nothing frozen
        stuck = {p: why for p in hooked if (why := gpu_suspend.frozen(p))}
        if stuck:
            raise SnapguardError(Reason.WORKLOAD_FROZEN, f"the take point cannot reach a process that does not run: "
                                 f"{'; '.join(stuck.values())}; nothing was frozen", evidence={"pids": sorted(stuck)})
        own_netns = procfs.own_netns(pid)
        conns = procfs.tree_tcp(inv) if req.tcp_established else []
        network_lock, needs_iptables = _network_lock(req, own_netns, conns)
        preflight.host_checks(report, config, gpu_required=inv.uses_gpu, network_lock=needs_iptables, ahead=ahead)
        inv.attach_gpu(report.host.gpu)
        found = take.trainers(tree)
        # the moved bytes leave the process (_spill.Spill) only through a directory the executor
        # reaches and CRIU does not dump: the host's own, or a container's bind of a host directory
        spill = _spill.spill_dirs(found, containers=not runner.uses_host_pids)
        preflight.workload_checks(report, inv, req.tcp_established, trainers=found)
        if isinstance(runner, RuncRunner):  # a mount CRIU cannot dump, refused before the dump
            report.run("container-mounts", lambda: preflight.check_container_mounts(
                pid, runner.runc, runner.root, runner.container_id))
        report.raise_blockers()
        return _Target(pid, tree, inv, report, own_netns, conns, network_lock, found, spill,
                       [p.pid for p in inv.cuda_processes()],
                       report.check_seconds(ahead.check_results if ahead is not None else ()))


def _image_dir(req: Request, steps: Steps) -> None:
    with steps.step("image_dir", Reason.IMAGE_WRITE_FAILED, image=req.image_dir):
        if os.path.islink(req.image_dir):  # seal refuses it, but only after CRIU dumped through it
            raise SnapguardError(Reason.UNTRUSTED_PATH, f"image directory {req.image_dir} is a symlink: snapguard "
                                 "never follows one into an image; name the directory itself",
                                 evidence={"image": req.image_dir})
        files.ensure_private_dir(req.image_dir)
        files.ensure_private_dir(req.work_dir)


def _hold(stack: ExitStack, req: Request, config: Config, steps: Steps, t: _Target) -> scopes.Hold:
    with steps.step("take", Reason.PREFLIGHT_FAILED):
        # the node's spill directories, and the host directories containers spill into here
        mapped = tuple(where[1] for where in t.spill.values() if where is not None)
        swept: list[Finding] = []  # Report.warnings is computed: a finding goes in as a check's
        journal = scopes.sweep_spills(config, steps, swept, mapped) if t.spill else None
        if swept:
            t.report.checks.append(preflight.CheckResult("spill-journal", swept))
        return stack.enter_context(scopes.held(t.trainers, t.cuda_pids, req.timeouts.take_wait_s, t.spill,
                                               req.image_dir, journal, at_step=req.at_step))


def _nothing_left_connected(req: Request, t: _Target) -> None:
    """With process groups released at the hold, a connection still open is not theirs (a group
    made over the trainer's own store, one the take point does not wrap): CRIU would refuse it
    only after the freeze. Refused here, before the dump, the hold released by its scope. Read
    only for trainers whose groups were released: a single process pays nothing in its stall."""
    if req.tcp_established or not any(preflight.groups_released(s) for s in t.trainers.values()):
        return
    left = procfs.tree_tcp(procfs.inventory(t.tree))
    if left:
        pids = sorted({c["pid"] for c in left})
        raise SnapguardError(Reason.PROCESS_GROUP_UNREACHED,
                             f"after the take point released its process groups, pid(s) {pids} still hold "
                             f"{len(left)} established TCP connection(s): a group or store it does not reach",
                             evidence={"connections": left})


def _dump(runner: Runner, req: Request, config: Config, steps: Steps, t: _Target,
          options: criu.CriuOptions) -> tuple[int | None, SnapguardError | None]:
    """CRIU's dump through the runner: (its exit status, or the error that kept it from one)."""
    try:
        with steps.step("dump", Reason.CRIU_DUMP_FAILED), \
                criu.RunDir(config.state_dir, config.criu, resolve_cuda_checkpoint(config)) as run_dir, \
                scopes.cuda_broker(run_dir, bool(t.cuda_pids), config, steps) as broker_env:
            with steps.timed("criu"):
                return runner.dump(req, options, {**run_dir.environment(options), **broker_env}), None
    except SnapguardError as e:  # a deadline passed, or runc or CRIU did not start
        runner.after_failed_dump()
        return None, e


def _after_dump(runner: Runner, req: Request, steps: Steps, t: _Target, hold: scopes.Hold,
                cuda: scopes.CudaSuspended, rc: int | None, failure: SnapguardError | None,
                warnings: list[Finding], log: str) -> None:
    """The workload back (leave-running, or a failed dump), and the dump's failure typed."""
    dumped = failure is None and rc == 0
    if not dumped or req.leave_running:  # the image is on disk, or there is none
        with steps.step("cuda_resume", Reason.CUDA_STATE_WEDGED):
            outcomes = cuda.resume()
        unreleased = hold.release()
        if unreleased:  # each goes on by itself after its hold limit
            steps.counts["trainers_not_released"] = len(unreleased)
        if dumped:
            hold.copies.start()  # a leave-running snapshot's: after the stall
    else:
        outcomes = {}
        cuda.ended()
        hold.ended()  # CRIU ended them: their spills' names go
    wedged = gpu_suspend.wedged(outcomes)
    evidence = {**runner.identity(), "cuda_recovery": outcomes, "log": log}
    if failure is not None:
        failure.failure.workload_intact = procfs.alive(t.pid) and not wedged
        failure.failure.evidence.update(evidence)
        failure.failure.warnings = warnings
        raise failure
    if rc != 0:
        quoted, errors = criu_errors(log)
        raise SnapguardError(Reason.CRIU_DUMP_FAILED,
                             quoted or runner.failure_detail() or f"exit {rc}, no CRIU error in {log}",
                             workload_intact=procfs.alive(t.pid) and not wedged,
                             evidence={**evidence, "exit": rc, "errors": errors}, warnings=warnings)
    if wedged:
        raise SnapguardError(Reason.CUDA_STATE_WEDGED, f"after the dump: {wedged}", workload_intact=False,
                             evidence=evidence, warnings=warnings)


def _seal(req: Request, runner: Runner, steps: Steps, t: _Target, hold: scopes.Hold,
          hasher: image.PageFileHasher | None, warnings: list[Finding]) -> dict[str, Any]:
    """The manifest's fields, hashed files and, last, the completion marker; the manifest."""
    report, inv = t.report, t.inv
    gpu_facts = report.host.gpu
    try:
        with steps.step("seal", Reason.IMAGE_WRITE_FAILED, image=req.image_dir):
            if hold.copies.copies:
                with steps.timed("spill_wait"):
                    steps.timings["spill_write_s"] = hold.copies.wait(req.timeouts.run_s)
            known = scopes.spans_hashed(hasher, steps)
            return image.seal(req.image_dir, {
                **runner.identity(),
                **({"fence_epoch": req.fence_epoch} if req.fence_epoch is not None else {}),
                "leave_running": req.leave_running,
                "own_netns": t.own_netns,
                "network_lock": t.network_lock,
                "tcp_connections": len(t.conns),
                "criu_version": report.host.criu_version,
                "host": report.host.host,
                "processes": inv.summary(),
                "take_point": {str(p): f for p, f in hold.figures.items()},
                "gpu": preflight.gpu.image_gpu_facts(gpu_facts, inv.pids) if gpu_facts and t.cuda_pids else None,
            }, known)
    except SnapguardError as e:
        # a stop snapshot's workload is gone with CRIU's dump: its unmarked image is all there is
        e.failure.workload_intact = req.leave_running and procfs.alive(t.pid)
        e.failure.evidence.setdefault("image", req.image_dir)
        e.failure.evidence["image_marked"] = False
        e.failure.warnings = warnings
        raise


@tally.counted("snapshot")  # snapguard_snapshots_total, its seconds and bytes
def checkpoint(runner: Runner, req: Request, config: Config, *,
               host_checks: preflight.HostChecks | None = None) -> dict[str, Any]:
    """Snapshot the runner's target into req.image_dir; a result record, or SnapguardError.
    `host_checks`: host checks run earlier (`preflight.host_checks_ahead`, kept warm by the agent):
    the preflight reuses those that passed and whose inputs match (CRIU path, whether the GPU is
    needed, the config) and runs the rest, NVML's inventory always; the timings then carry
    `host_checks_age_s`, how old they were."""
    steps = Steps()
    try:
        t = _preflight(runner, req, config, steps, host_checks)
    except BaseException:
        runner.settle()
        raise
    log = log_path(req, restore=False)
    with ExitStack() as stack:
        stack.callback(runner.settle)  # last: after the trainers' release and the CUDA resume
        stack.enter_context(scopes.claimed(config, t.tree, req.image_dir))
        _image_dir(req, steps)
        hold = _hold(stack, req, config, steps, t)
        _nothing_left_connected(req, t)
        if not req.leave_running:
            hold.copies.start()  # beside CRIU's run: the trainer is gone with it
        warnings = t.report.warnings + hold.warnings
        options = criu.CriuOptions(images_dir=req.image_dir, work_dir=req.work_dir, libdir=config.criu_libdir,
                                   timeout_s=req.timeouts.criu_s, leave_running=req.leave_running,
                                   tcp_established=req.tcp_established, network_lock=t.network_lock)
        cuda = stack.enter_context(scopes.suspended(t.cuda_pids, req.timeouts.criu_s, steps))
        # A stop snapshot's page files (and its spill copies) are hashed while written. Not a leave-running
        # one's: its seal comes after the stall, and the hashing takes cores and memory bandwidth
        # from CRIU (on two cores CRIU's run took 4.56 s against 3.95,
        # bench/results/hash-while-dumping-*) and from the CUDA resume, both inside the stall.
        hasher = stack.enter_context(scopes.page_file_hasher(
            req.image_dir, config, steps, on=not req.leave_running,
            fresh=hold.copies.names))
        rc, failure = _dump(runner, req, config, steps, t, options)
        _after_dump(runner, req, steps, t, hold, cuda, rc, failure, warnings, log)
        manifest = _seal(req, runner, steps, t, hold, hasher, warnings)
    return steps.record({
        "operation": "checkpoint", **runner.identity(), "pid": t.pid, "image": req.image_dir,
        "leave_running": req.leave_running, "network_lock": t.network_lock, "cuda_pids": t.cuda_pids,
        "image_bytes": manifest["image_bytes"], "files": len(manifest["files"]), "take_point": hold.figures,
        "preflight_checks_s": t.checks_s,
        "warnings": [w.to_dict() for w in warnings],
    }, log)
