"""Preflight: every snapshot blocker seen before the workload is touched.

Public API: `node_report`, `pid_report`, `container_report`, `manifest_report`, each returning a
`Report` whose `exit_code` is 0 (ready), 1 (blocked) or 2 (could not check); and the building
blocks the snapshot pipeline runs itself, `host_checks` and `workload_checks`.

`host_checks_ahead` runs the host checks before the image they are for is known (a restore from
a store runs them while the image is fetched) into a `HostChecks`; `manifest_report(...,
ahead=)` then reuses each result whose inputs match what the manifest needs and runs the rest.

A node report is scoped by capability (`CAPABILITIES`: host-netns-containers, own-netns-containers,
bare-processes, gpu, tcp-carry): each is ready or blocked by the checks it needs, and the exit
status follows the capabilities in `require` (default: `default_requirements()`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .. import image, procfs, runc
from ..config import Config
from ..reasons import Finding, Reason, SnapguardError
from . import gpu, host
from ._report import CAPABILITIES as CAPABILITIES
from ._report import CAPABILITY_NAMES as CAPABILITY_NAMES
from ._report import EXIT_BLOCKED as EXIT_BLOCKED
from ._report import EXIT_READY as EXIT_READY
from ._report import EXIT_UNCHECKED as EXIT_UNCHECKED
from ._report import CheckResult as CheckResult
from ._report import Report as Report
from ._report import check_error_message as check_error_message
from .facts import HostFacts as HostFacts
from .mounts import check_container_mounts as check_container_mounts
from .workload import groups_released as groups_released
from .workload import run_checks as workload_checks

T = TypeVar("T")

__all__ = ["CAPABILITIES", "CAPABILITY_NAMES", "EXIT_BLOCKED", "EXIT_READY", "EXIT_UNCHECKED", "CheckResult",
           "HostChecks", "HostFacts", "Report", "check_container_mounts", "check_error_message", "container_report", "default_requirements", "groups_released", "host_checks",
           "host_checks_ahead", "manifest_report", "node_report", "pid_report", "workload_checks"]


def _host_plan(report: Report, config: Config, gpu_required: bool, criu: str,
               network_lock: bool) -> list[tuple[str, tuple[Any, ...], Callable[[], list[Finding]]]]:
    """The host checks in the order they run: (name, what its outcome depends on beyond the host
    and the config, the check)."""
    return [
        ("privileges", (), host.check_privileges),
        ("criu", (criu,), report.host.noting(lambda facts: host.check_criu(criu, config.state_dir, facts))),
        *([("network-lock", (), host.check_network_lock)] if network_lock else []),
        ("cuda-plugin", (gpu_required,), lambda: host.check_cuda_plugin(config, gpu_required)),
        ("nvidia-driver", (), lambda: _driver_checks(report, config.state_dir)),
    ]


@dataclass(frozen=True)
class HostChecks:
    """Host checks run ahead of the image they are for (`host_checks_ahead`): each check's result
    and the facts it left, keyed by what its outcome depended on. `seconds`: how long they took;
    `waited_s`: how long the caller then waited for them (set by whoever ran them in a thread)."""

    config: dict[str, object]  # Config.as_dict() of the run: results of another config are not reused
    host: dict[str, Any]  # procfs.host_facts()
    results: tuple[tuple[str, tuple[Any, ...], CheckResult, dict[str, Any]], ...]
    seconds: float
    waited_s: float = 0.0
    started: float = 0.0  # time.monotonic() when they began: their age is measured from it

    @property
    def check_results(self) -> tuple[CheckResult, ...]:
        """The results these checks gave, each as a report that reuses it holds it."""
        return tuple(r for _, _, r, _ in self.results)

    def made_under(self, config: Config) -> bool:
        """Whether they ran under this config (results of another are never reused)."""
        return self.config == config.as_dict()

    def result(self, name: str, key: tuple[Any, ...]) -> tuple[CheckResult, dict[str, Any]] | None:
        return next(((r, facts) for n, k, r, facts in self.results if n == name and k == key), None)

    def age_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.started

    def passed(self, leave: tuple[str, ...] = ()) -> HostChecks:
        """Only the checks that passed (ran, no blocker), less those named in `leave`: what a later
        run (a snapshot on a notice) may reuse. A check that failed or could not run then runs
        anew, so a transient failure minutes ago does not refuse it, and its reason is today's."""
        return replace(self, results=tuple(r for r in self.results
                                           if r[0] not in leave and not r[2].error
                                           and r[2].status != "blocked"))


def host_checks_ahead(config: Config, criu: str | None = None, gpu_required: bool | None = None,
                      network_lock: bool = True, leave: tuple[str, ...] = ()) -> HostChecks:
    """The host checks before the image is known. Assumed unless given: the image uses the GPU
    where this node has an NVIDIA driver, and the network lock is checked (cheap; a manifest that
    needs none drops it). `host_checks(..., ahead=)` runs anew whatever the manifest turns out to
    need otherwise. `leave`: checks not run (the caller would not reuse them)."""
    t = time.monotonic()
    report = Report("--host")
    report.host.update({"host": procfs.host_facts()})
    gpu_required = os.path.exists(gpu.NVIDIA_DRIVER) if gpu_required is None else gpu_required
    results = _run_host_plan(report, config, gpu_required, criu or config.criu, network_lock, leave=leave)
    assert report.host.host is not None
    return HostChecks(config.as_dict(), report.host.host, tuple(results), time.monotonic() - t, started=t)


def _run_host_plan(report: Report, config: Config, gpu_required: bool, criu: str, network_lock: bool,
                   ahead: HostChecks | None = None,
                   leave: tuple[str, ...] = ()) -> list[tuple[str, tuple[Any, ...], CheckResult, dict[str, Any]]]:
    """The host checks of `_host_plan` into `report`, in the plan's order: those `ahead` has a
    matching result for taken from it, the rest run all at once (`host.run_concurrently`), each
    against a Report of its own, so the facts each leaves are its own; `leave`: not run. (name,
    key, result, facts it left) of each."""
    plan = _host_plan(report, config, gpu_required, criu, network_lock)
    base = report.host.to_dict()
    jobs = []
    for i, (name, key, _) in enumerate(plan):
        if name in leave or (ahead is not None and ahead.result(name, key) is not None):
            continue
        own = Report(report.target)
        own.host.update(base)
        jobs.append((name, _one_check(own, name, _host_plan(own, config, gpu_required, criu, network_lock)[i][2])))
    ran = dict(zip((name for name, _ in jobs), host.run_concurrently(jobs, host.HOST_CHECKS_DEADLINE_S)))
    out = []
    for name, key, _ in plan:
        if name in leave:
            continue
        done = ahead.result(name, key) if ahead is not None else None
        value = ran[name] if done is None else done
        if isinstance(value, SnapguardError):  # it did not answer in time
            value = (CheckResult(name, error=value.failure.detail, duration_s=host.HOST_CHECKS_DEADLINE_S), {})
        report.checks.append(value[0])
        report.host.update(value[1])
        out.append((name, key, value[0], value[1]))
    return out


def _one_check(own: Report, name: str,
               check: Callable[[], list[Finding]]) -> Callable[[], tuple[CheckResult, dict[str, Any]]]:
    """A host check run in `own`: its result and the facts it left there."""
    def run() -> tuple[CheckResult, dict[str, Any]]:
        before = own.host.to_dict()
        own.run(name, check)
        return own.checks[-1], {k: v for k, v in own.host.to_dict().items() if k not in before or before[k] is not v}
    return run


def host_checks(report: Report, config: Config, gpu_required: bool, criu: str | None = None,
                network_lock: bool = True, ahead: HostChecks | None = None) -> None:
    """The checks every snapshot and restore needs from the host; `criu` overrides the pinned one.
    `network_lock`: CRIU will lock the network with iptables (a namespace of the tree's own, or
    connections to the outside). Leaves the GPU inventory in `report.host.gpu` (NVML is read
    once per run; the process model takes the CUDA pids from it). `ahead`: results of
    `host_checks_ahead` under the same config, taken where a check's inputs match, in the same
    order; the checks it has no matching result for run now."""
    if ahead is not None and not ahead.made_under(config):
        ahead = None
    report.host.update({"host": dict(ahead.host) if ahead is not None else procfs.host_facts()})
    _run_host_plan(report, config, gpu_required, criu or config.criu, network_lock, ahead=ahead)


NVML_DEADLINE_S = 30.0


def _within(deadline_s: float, what: str, fn: Callable[[], T]) -> T:
    """fn() in a daemon thread under a deadline: a wedged driver can block NVML calls forever,
    and the executor must answer containerd (a thread left blocked dies with the process)."""
    import threading

    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=call, name=f"snapguard {what}", daemon=True)
    t.start()
    t.join(deadline_s)
    if t.is_alive():
        raise SnapguardError(Reason.PREFLIGHT_FAILED, f"{what} did not answer within {deadline_s:g} s",
                             evidence={"deadline_s": deadline_s})
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def _driver_checks(report: Report, state_dir: str | None = None) -> list[Finding]:
    facts = _within(NVML_DEADLINE_S, "NVML (the GPU inventory)", gpu.gpu_facts)
    report.host.update({"gpu": facts})
    if facts is None:
        return []  # no NVIDIA driver: nothing to check, and nothing of the driver API to load
    from ..cuda import find_libcuda

    return gpu.check_driver(facts, find_libcuda(), symbols=lambda lib: host.checkpoint_api(lib, state_dir))


def default_requirements() -> tuple[str, ...]:
    """What containerd's snapshots of GPU training containers need: containers in the host's
    network namespace, and the GPU where the node has an NVIDIA driver."""
    if os.path.exists(gpu.NVIDIA_DRIVER):
        return ("host-netns-containers", "gpu")
    return ("host-netns-containers",)


def node_report(config: Config, require: tuple[str, ...] | list[str] | None = None) -> Report:
    """This host, per capability; the exit status follows `require` (names of CAPABILITIES;
    None: `default_requirements()`). Every node check runs whatever is required, so the report
    says what the node can do besides."""
    required = default_requirements() if require is None else tuple(dict.fromkeys(require))
    unknown = [r for r in required if r not in CAPABILITY_NAMES]
    if unknown:
        raise SnapguardError(Reason.USAGE_ERROR, f"unknown capability {', '.join(unknown)}; "
                             f"known: {', '.join(CAPABILITY_NAMES)}")
    report = Report("--node", required=required)
    host_checks(report, config, gpu_required=os.path.exists(gpu.NVIDIA_DRIVER))
    report.run("runc", report.host.noting(lambda facts: host.check_runc(config.runc, facts)))
    report.run("runtime-versions", report.host.noting(
        lambda facts: host.check_runtime_versions(config.runc, config.state_dir, facts)))
    report.run("gpu-handles", lambda: gpu.check_gpu_handles(report.host.gpu))
    report.host.update({"spill": host.spill_tmpfs()})
    driver = next(c for c in report.checks if c.name == "nvidia-driver")
    if not driver.error and report.host.gpu is None:
        report.capability_blockers["gpu"] = [Finding(
            Reason.GPU_DRIVER_MISSING, f"no NVIDIA driver is loaded on this node ({gpu.NVIDIA_DRIVER} is absent)",
            evidence={"path": gpu.NVIDIA_DRIVER})]
    return report


def _tree_report(report: Report, pid: int, config: Config, tcp_established: bool) -> Report:
    from ..takepoint import client as take

    try:
        tree = procfs.process_tree(pid)
    except SnapguardError as e:
        report.checks.append(_unchecked_or_blocked("process-tree", e))
        return report
    inv = procfs.inventory(tree)
    host_checks(report, config, gpu_required=inv.uses_gpu, network_lock=procfs.own_netns(pid))
    inv.attach_gpu(report.host.gpu)
    workload_checks(report, inv, tcp_established, trainers=take.trainers(tree))
    return report


def _unchecked_or_blocked(name: str, e: SnapguardError) -> CheckResult:
    """A target that is not there could not be checked (exit 2); one CRIU cannot take (a kernel
    thread, a zombie, a thread id) is a typed blocker (exit 1)."""
    if e.reason in (Reason.PROCESS_NOT_FOUND, Reason.CONTAINER_NOT_FOUND):
        return CheckResult(name, error=e.failure.detail, error_reason=e.reason)
    return CheckResult(name, findings=[Finding(e.reason, e.failure.detail, evidence=e.failure.evidence)])


def pid_report(pid: int, config: Config, tcp_established: bool = False) -> Report:
    return _tree_report(Report(f"--pid {pid}"), pid, config, tcp_established)


def container_report(container_id: str, runc_root: str | None, config: Config) -> Report:
    report = Report(f"--container {container_id}")
    try:
        state = runc.state(config.runc, runc_root, container_id)
    except SnapguardError as e:
        report.checks.append(_unchecked_or_blocked("runc-state", e))
        return report
    _tree_report(report, state["pid"], config, False)
    report.run("container-mounts", lambda: check_container_mounts(state["pid"], config.runc, runc_root, container_id))
    return report


def manifest_report(path: str, config: Config, criu: str | None = None, exact: bool = False,
                    verified: dict[str, tuple[str, tuple[int, int]]] | None = None,
                    defer_digests: bool = False, ahead: HostChecks | None = None) -> Report:
    """Can this host restore the image whose manifest (or image directory) is at `path`?
    `verified`: digests computed while the files were written (see image.verify). `ahead`: the
    host checks already run (`host_checks_ahead`), reused where they match the manifest's needs.

    The image is verified first (marker, manifest, checksums) into `report.image` (an
    image.Inspected; its manifest: `report.manifest`). With `defer_digests` the checksums are
    left to the caller: `report.image.check_digests()`.
    """
    # `exact`: a restore verifies the very directory CRIU will read, never its parent
    image_dir = path if exact or os.path.isdir(path) else os.path.dirname(path) or "."
    report = Report(f"--manifest {path}")
    try:
        inspected = image.inspect(image_dir, verified)
        if not defer_digests:
            inspected.check_digests()
    except SnapguardError as e:
        report.checks.append(CheckResult("image", findings=[
            Finding(e.reason, e.failure.detail, evidence=e.failure.evidence)]))
        return report
    report.checks.append(CheckResult("image"))
    report.image = inspected
    manifest = inspected.manifest
    host_checks(report, config, gpu_required=manifest.uses_gpu, criu=criu,
                network_lock=manifest.needs_network_lock, ahead=ahead)
    report.run("image-vs-host", lambda: image.compare_with_host(
        manifest, {**(report.host.host or {}), "mem_available": procfs.mem_available_bytes()},
        str(report.host.criu_version if report.host.knows("criu_version") else "unknown")))
    report.run("gpu-vs-host", lambda: gpu.compare_gpu(manifest.gpu, report.host.gpu))
    return report
