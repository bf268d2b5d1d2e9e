"""The restore: verify the image -> compare with this host -> CRIU (through the runner) -> the
restored processes run, CUDA ones `running` -> release the take point -> result.

What the restore holds while it runs (the claim on the image, the digests' check, CRIU's run
directory and broker) is entered in one ExitStack (`scopes`). Every step runs under `Steps.step`.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from .. import criu, files, image, prefetch, preflight, procfs, tally
from ..config import Config, resolve_cuda_checkpoint
from ..devicemap import DeviceMap
from ..takepoint import client as take
from ..takepoint import spill as _spill
from ..reasons import Finding, Reason, SnapguardError
from . import scopes
from ._devices import device_map as _device_map
from ._request import Request
from ._runners import Runner, log_path
from ._steps import Steps, criu_errors

__all__ = ["restore"]


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

    def image(self, inspected: image.Inspected, steps: Steps) -> None:
        """The tools' thread awaited (a second at most), the image's small files read."""
        if self._thread is None:
            return
        with steps.timed("read_ahead"):
            self._thread.join(1.0)
            files, size = inspected.read_ahead(self.SMALL_FILE_BYTES)
        steps.counts["read_ahead_files"] = self.files + files
        steps.counts["read_ahead_bytes"] = self.bytes + size


def _pid_conflicts(manifest: image.Manifest, grace_s: float = 5.0) -> list[Finding]:
    """Pids of the image in use here. The processes a stop snapshot killed may still be zombies
    waiting for their new parent to reap them: those are given a few seconds to go."""
    wanted = [p.pid for p in manifest.processes]
    deadline = time.monotonic() + grace_s
    while any(procfs.process_state(p) == "Z" for p in wanted) and time.monotonic() < deadline:
        time.sleep(0.02)
    taken = [p for p in wanted if procfs.process_state(p) != "gone"]
    if not taken:
        return []
    return [Finding(Reason.PID_CONFLICT, f"pid(s) {', '.join(map(str, taken))} of the image are in use here",
                    evidence={"pids": taken})]


def _check_restored(manifest: image.Manifest, pid: int) -> dict[int, str]:
    """The restored root runs, and every process the image had a CUDA context in is `running`.
    A container's processes keep their pids inside its namespace: they are found by those."""
    if not procfs.alive(pid):
        raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"the restored process {pid} is gone",
                             workload_intact=False, evidence={"pid": pid})
    wanted = [p.nspid for p in manifest.processes if p.gpu]
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


def recorded_nspids(manifest: image.Manifest) -> dict[int, int]:
    """{pid at the dump: pid in its own namespace} of the image's processes."""
    return {p.pid: p.nspid for p in manifest.processes}


def _by_restored_pid(wanted: dict[int, tuple[str, int]], recorded: dict[int, int],
                     root_pid: int) -> dict[int, tuple[str, int]]:
    """`wanted` (keyed by the host pids the trainers had when dumped) keyed by the restored
    trainers' host pids: each found by the pid it has in its own namespace, which the executor
    recorded at the dump (`recorded`, the manifest's `processes[].nspid`) and CRIU restores. A
    trainer that cannot be found, or not told apart (two restored processes with that pid, in
    nested namespaces), is CRIU_RESTORE_FAILED: its spill must not go to another."""
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


def _release(runner: Runner, req: Request, pid: int, manifest: image.Manifest,
             wanted: dict[int, tuple[str, int]], restored: dict[int, dict[str, Any]]) -> None:
    if not runner.uses_host_pids:
        # a container's host pids are new; the pids its trainers see are CRIU's to restore
        wanted = _by_restored_pid(wanted, recorded_nspids(manifest), pid)
    missing = sorted(set(wanted) - set(restored))
    if missing:
        raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"restored trainer(s) {missing} do not answer at "
                             "their take point: their moved bytes cannot be passed back",
                             evidence={"image": req.image_dir, "missing": missing})
    spills = _spill.open_image_spills(req.image_dir, wanted)
    try:
        unreleased = take.release_all(restored, spills, rendezvous=req.rendezvous)
    finally:
        for spill in spills.values():
            spill.close()
    failed = {pid: why for pid, why in unreleased.items() if pid in wanted}
    if failed:
        raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"restored trainer(s) {sorted(failed)} did not take "
                             f"the release with their moved bytes' file: {'; '.join(failed.values())}",
                             evidence={"image": req.image_dir, "failed": {str(p): w for p, w in failed.items()}})


def _release_restored(runner: Runner, req: Request, pid: int, manifest: image.Manifest,
                      wanted: dict[int, tuple[str, int]], steps: Steps, report: preflight.Report) -> None:
    """Release the restored trainers. One whose spill cannot be passed to it (it does not answer,
    or the file is not as listed) would wake without its optimizer's bytes: the restored tree is
    ended instead, the image left whole for another restore."""
    try:
        with steps.step("release", Reason.CRIU_RESTORE_FAILED, image=req.image_dir):
            restored = take.trainers(procfs.process_tree(pid))  # one that does not answer: ended
            _release(runner, req, pid, manifest, wanted, restored)
    except SnapguardError as e:
        e.failure.evidence["restored_tree_ended"] = runner.discard(pid)
        e.failure.workload_intact = False
        e.failure.warnings = report.warnings
        raise


@dataclass
class _Checked:
    """What the restore's preflight found: its report, the image (digests pending or checked),
    the spills the release passes back ({pid: (file, bytes)}) and the GPU device map."""

    report: preflight.Report
    inspected: image.Inspected
    digests: _Digests
    wanted: dict[int, tuple[str, int]]
    devices: DeviceMap | None


def _preflight(runner: Runner, req: Request, config: Config, steps: Steps,
               host_checks: preflight.HostChecks | None) -> _Checked:
    with steps.step("preflight", Reason.PREFLIGHT_FAILED, image=req.image_dir):
        report = preflight.manifest_report(req.image_dir, config, criu=config.criu, exact=True,
                                           verified={name: (digest, (dev, ino))
                                                     for name, digest, dev, ino in req.verified_digests},
                                           defer_digests=True, ahead=host_checks)
        report.run("children", lambda: scopes.sweep_children(config, steps))  # what a killed executor left
        inspected = report.image
        digests = _Digests(inspected, held=inspected.manifest.held) if inspected is not None else None
        if digests is not None and not digests.held:
            with steps.step("verify", Reason.IMAGE_CORRUPT, image=req.image_dir):
                digests.check()  # nothing would hold the restored tree: the whole image first, as always
        if inspected is not None and runner.uses_host_pids:
            manifest = inspected.manifest
            report.run("pid-conflicts", lambda: _pid_conflicts(manifest))
        report.raise_blockers()
        assert inspected is not None and digests is not None
        wanted = _spill.image_spills(inspected.manifest.to_json(), req.image_dir)  # what the release passes back
        return _Checked(report, inspected, digests, wanted, _device_map(req, report, config))


def _run_criu(runner: Runner, req: Request, config: Config, steps: Steps, manifest: image.Manifest,
              options: criu.CriuOptions, devices: DeviceMap | None,
              digests: _Digests) -> tuple[int | None, SnapguardError | None]:
    """CRIU's restore through the runner, the held workload's digests checked beside it:
    (its exit status, the digests' refusal)."""
    rc: int | None = None
    digests.start()  # a held workload's image is hashed while CRIU reads it
    try:
        with steps.step("restore", Reason.CRIU_RESTORE_FAILED), \
                criu.RunDir(config.state_dir, config.criu, resolve_cuda_checkpoint(config)) as run_dir, \
                scopes.cuda_broker(run_dir, bool(manifest.gpu), config, steps) as broker_env:
            with steps.timed("criu"):
                rc = runner.restore(req, options, {**run_dir.environment(options, devices), **broker_env})
    finally:
        with steps.step("verify_wait", Reason.IMAGE_CORRUPT, image=req.image_dir):
            corrupt = digests.result()
    return rc, corrupt


def _refuse_failed(runner: Runner, req: Request, rc: int | None, corrupt: SnapguardError | None,
                   report: preflight.Report, log: str) -> None:
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
        quoted, errors = criu_errors(log)
        raise SnapguardError(Reason.CRIU_RESTORE_FAILED,
                             quoted or runner.failure_detail() or f"exit {rc}, no CRIU error in {log}",
                             evidence={"image": req.image_dir, "exit": rc, "log": log, "errors": errors},
                             warnings=report.warnings)


def _confirm(runner: Runner, req: Request, steps: Steps, manifest: image.Manifest,
             report: preflight.Report) -> tuple[int, dict[int, str]]:
    with steps.step("confirm", Reason.CRIU_RESTORE_FAILED):
        pid = runner.restored_pid(req)
        root_pid = manifest.root_pid
        if runner.uses_host_pids and isinstance(root_pid, int) and pid != root_pid:
            raise SnapguardError(Reason.CRIU_RESTORE_FAILED, f"CRIU exited 0 naming pid {pid}, but a bare "
                                 f"restore brings the image's root back as pid {root_pid}",
                                 workload_intact=False, evidence={"pid": pid, "root_pid": root_pid})
        try:
            return pid, _check_restored(manifest, pid)
        except SnapguardError as e:
            # CRIU said it restored, but what runs is not the workload (a CUDA process left
            # checkpointed, a root gone): it is ended, so that the whole image can be restored
            # again or the caller falls back, instead of a broken copy holding the pids and GPU
            e.failure.evidence["restored_tree_ended"] = runner.discard(pid)
            e.failure.evidence["image"] = req.image_dir
            e.failure.warnings = report.warnings
            raise


@tally.counted("restore")  # snapguard_restores_total, its seconds and bytes
def restore(runner: Runner, req: Request, config: Config, *,
            host_checks: preflight.HostChecks | None = None) -> dict[str, Any]:
    """Restore req.image_dir through the runner; a result record, or SnapguardError.
    `host_checks`: the host checks already run for this restore (while its image was fetched):
    the preflight reuses those that match the manifest's needs and runs the rest; the timings
    then say how long they took (`host_checks_s`, not part of `total_s`) and how long the
    restore waited for them after the fetch (`host_checks_wait_s`)."""
    steps = Steps()
    ahead = _ReadAhead(config)
    if host_checks is not None:
        steps.timings["host_checks_s"] = host_checks.seconds
        steps.timings["host_checks_wait_s"] = host_checks.waited_s
    checked = _preflight(runner, req, config, steps, host_checks)
    report, manifest, devices = checked.report, checked.inspected.manifest, checked.devices
    options = criu.CriuOptions(images_dir=req.image_dir, work_dir=req.work_dir, libdir=config.criu_libdir,
                               timeout_s=req.timeouts.criu_s, tcp_established=req.tcp_established,
                               network_lock="skip" if manifest.network_lock == "skip" else None,
                               log_file=os.path.basename(log_path(req, restore=True)))
    log = log_path(req, restore=True)
    with ExitStack() as stack:
        stack.enter_context(scopes.claimed(config, [], req.image_dir))
        with steps.step("work_dir", Reason.CRIU_RESTORE_FAILED):
            files.ensure_private_dir(req.work_dir)
            if checked.wanted:
                swept: list[Finding] = []  # Report.warnings is computed: a finding goes in as a check's
                scopes.sweep_spills(config, steps, swept)
                if swept:
                    report.checks.append(preflight.CheckResult("spill-journal", swept))
        ahead.image(checked.inspected, steps)
        rc, corrupt = _run_criu(runner, req, config, steps, manifest, options, devices, checked.digests)
        _refuse_failed(runner, req, rc, corrupt, report, log)
        pid, states = _confirm(runner, req, steps, manifest, report)
        if manifest.take_point:
            # the workload was held at its take point when dumped: let it go on, each trainer whose
            # bytes the image holds apart (its spill) with that file to reload from
            _release_restored(runner, req, pid, manifest, checked.wanted, steps, report)
    return steps.record({
        "operation": "restore", **runner.identity(), "pid": pid, "image": req.image_dir, "cuda_states": states,
        "device_map": list(devices.pairs) if devices else None, "image_epoch": manifest.epoch,
        "image_bytes": manifest.image_bytes,
        # where preflight_s went: each check run now (those reused from `host_checks` left out)
        "preflight_checks_s": report.check_seconds(host_checks.check_results if host_checks is not None else ()),
        "warnings": [w.to_dict() for w in report.warnings],
    }, log)
