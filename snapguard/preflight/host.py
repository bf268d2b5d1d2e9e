"""Host checks: can this machine run CRIU snapshots at all."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .. import criu, procfs
from . import gpu
from ..children import probe
from ..config import Config, check_pinned_binary, resolve_cuda_checkpoint
from ..files import ensure_private_dir, write_private_json
from ..reasons import Finding, Reason, Severity, SnapguardError
from ..takepoint import SPILL_TMPFS, node_spill_dir
from ..trust import UntrustedPathError

__all__ = ["spill_tmpfs", "check_criu", "check_network_lock", "check_privileges", "check_cuda_plugin", "check_runc",
           "check_runtime_versions", "runtime_pairing", "run_concurrently", "CONTAINERD_PATHS", "HOST_CHECKS_DEADLINE_S",
           "IPTABLES_RESTORE"]

T = TypeVar("T")
CAP_SYS_PTRACE, CAP_SYS_ADMIN = 19, 21
IPTABLES_RESTORE = ("/usr/sbin/iptables-restore", "/sbin/iptables-restore")


# How long the host checks run together may take: past every probe's own deadline (`criu check`'s
# 60 s, cuda-checkpoint's 30 s, NVML's 30 s), so one of those answers first; this only bounds a
# check that has none of its own.
HOST_CHECKS_DEADLINE_S = 90.0


def run_concurrently(jobs: Sequence[tuple[str, Callable[[], T]]],
                     deadline_s: float = HOST_CHECKS_DEADLINE_S) -> list[T | SnapguardError]:
    """Each job (name, fn) in a daemon thread of its own, all started at once: the host probes are
    independent children and reads (`criu check`, `cuda-checkpoint -h`, NVML, libcuda's symbol
    table), so the preflight waits for the slowest of them rather than for their sum. Their values
    in the order given; an exception a job raised is its value; one still running `deadline_s`
    after the start is a SnapguardError (PREFLIGHT_FAILED) in its place (a thread left blocked
    dies with the process)."""
    import threading

    boxes: list[dict[str, Any]] = [{} for _ in jobs]

    def call(box: dict[str, Any], fn: Callable[[], T]) -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    # each named as the caller's thread: what they run is its work (the restore's host checks run
    # in a thread of their own while the image is fetched, and say so by its name)
    caller = threading.current_thread().name
    threads = [threading.Thread(target=call, args=(box, fn), name=caller, daemon=True) for box, (_, fn) in zip(boxes, jobs)]
    end = time.monotonic() + deadline_s
    for t in threads:
        t.start()
    out: list[T | SnapguardError] = []
    for t, box, (name, _) in zip(threads, boxes, jobs):
        t.join(max(0.0, end - time.monotonic()))
        if t.is_alive():
            out.append(SnapguardError(Reason.PREFLIGHT_FAILED, f"the {name} check did not answer within "
                                      f"{deadline_s:g} s", evidence={"check": name, "deadline_s": deadline_s}))
        elif "error" in box:
            err = box["error"]
            if not isinstance(err, Exception):
                raise err  # KeyboardInterrupt, SystemExit: not a check's result
            out.append(err if isinstance(err, SnapguardError) else SnapguardError(
                Reason.PREFLIGHT_FAILED, f"the {name} check failed: {type(err).__name__}: {err}"[:400],
                evidence={"check": name}))
        else:
            out.append(box["value"])
    return out


def check_privileges(proc: str | None = None) -> list[Finding]:
    if os.geteuid() != 0:
        return [Finding(Reason.INSUFFICIENT_PRIVILEGE, f"running as uid {os.geteuid()}, CRIU needs root",
                        evidence={"euid": os.geteuid()})]
    with open(os.path.join(proc or procfs.procfs_path(), "self", "status")) as f:
        cap_eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    missing = [name for bit, name in ((CAP_SYS_ADMIN, "CAP_SYS_ADMIN"), (CAP_SYS_PTRACE, "CAP_SYS_PTRACE"))
               if not cap_eff >> bit & 1]
    if missing:
        return [Finding(Reason.INSUFFICIENT_PRIVILEGE, f"root without {', '.join(missing)}",
                        evidence={"missing_capabilities": missing})]
    return []


def check_criu(path: str, state_dir: str | None, facts: dict[str, object]) -> list[Finding]:
    """CRIU at the pinned path, version 4.0 or newer, and `criu check` passing on this kernel."""
    problem = check_pinned_binary(path, "criu")
    if problem:
        return [Finding(Reason.CRIU_MISSING, problem, evidence={"path": path})]
    try:
        ver = criu.cached_version(path, state_dir)
    except criu.CriuBroken as e:
        return [Finding(Reason.CRIU_BROKEN, str(e), evidence={"path": path})]
    facts["criu_version"] = ".".join(map(str, ver))
    if ver < criu.MIN_VERSION:
        return [Finding(Reason.CRIU_TOO_OLD,
                        f"CRIU {facts['criu_version']} at {path}, snapguard needs "
                        f"{'.'.join(map(str, criu.MIN_VERSION))} or newer",
                        evidence={"path": path, "version": facts["criu_version"]})]
    passed, output = criu.check(path, state_dir)
    if not passed:
        errors = [str(e) for e in criu.extract_errors(output)] or output.splitlines()[-3:]
        return [Finding(Reason.CRIU_CHECK_FAILED, f"`criu check` failed: {'; '.join(errors)}",
                        evidence={"path": path, "output": output[-4000:]})]
    return []


def check_runc(path: str, facts: dict[str, object]) -> list[Finding]:
    """The pinned runc, which runs CRIU for containers: root's alone, and it runs (`runc --version`)."""
    problem = check_pinned_binary(path, "runc")
    if problem:
        return [Finding(Reason.RUNC_UNUSABLE, problem, evidence={"path": path})]
    out = probe([path, "--version"], timeout_s=10)
    if isinstance(out, str):
        return [Finding(Reason.RUNC_UNUSABLE, out, evidence={"path": path})]
    said = (out.stdout.strip() or out.stderr.strip()).splitlines()
    if out.returncode != 0:
        err = (out.stderr.strip() or out.stdout.strip()).splitlines()
        return [Finding(Reason.RUNC_UNUSABLE, f"`{path} --version` exited {out.returncode}: "
                        f"{err[0][:300] if err else 'it printed nothing'}", evidence={"path": path})]
    if said:
        facts["runc_version"] = said[0].removeprefix("runc version ").strip()
    return []


# The node's containerd: the first of these that exists (no PATH lookup). The last is the compat
# stack packaging/install-deps.sh unpacks (Debian unstable's containerd 2.x).
CONTAINERD_PATHS = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/opt/snapguard/compat/bin/containerd")

# The runc each containerd minor release is tested with: containerd's docs/RUNC.md recommends "a
# version of runc that's equal to or higher than" the one in script/setup/runc-version, which at
# v1.6.0 names v1.1.0, v1.7.0 v1.1.4, v2.0.0 v1.2.1, v2.1.0 v1.3.0, v2.2.0 v1.3.3, v2.3.0 v1.4.2
# (read from containerd's tags). Compared by minor: a later patch release may name a newer patch.
CONTAINERD_RUNC_FLOOR = {(1, 6): (1, 1), (1, 7): (1, 1), (2, 0): (1, 2), (2, 1): (1, 3), (2, 2): (1, 3), (2, 3): (1, 4)}
# runc 1.4 removed `--criu` (runc CHANGELOG, 1.4.0-rc.1: "The deprecated `--criu` flag has been
# removed entirely", #4722; 1.2 ignored it with a warning). containerd 1.6 passes it on every runc
# call when the runtime's CriuPath option is set (NewRunc in pkg/process/init.go and go-runc's
# global args, v1.6.0 to v1.6.39); 1.7 ignores CriuPath (containerd commit d2013d2c9, "runtime:
# deprecate runc --criu / -criu-path option", first in v1.7.0) and 2.0 removed it (RELEASES.md).
RUNC_WITHOUT_CRIU_FLAG = (1, 4)
CONTAINERD_PASSING_CRIU = (1, 6)
_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def runtime_pairing(containerd: tuple[int, int, int], runc_version: tuple[int, int, int],
                    evidence: dict[str, object] | None = None) -> list[Finding]:
    """Known bad pairings of a containerd and a runc version, as warnings (each rule's source is
    at CONTAINERD_RUNC_FLOOR and RUNC_WITHOUT_CRIU_FLAG)."""
    evidence = {"containerd_version": _dotted(containerd), "runc_version": _dotted(runc_version), **(evidence or {})}
    findings = []
    known = [m for m in CONTAINERD_RUNC_FLOOR if m <= containerd[:2]]
    if known:  # nothing is said here of a containerd older than 1.6
        tested = max(known)
        floor = CONTAINERD_RUNC_FLOOR[tested]
        if runc_version[:2] < floor:
            newest = " (the newest this check knows)" if tested < containerd[:2] else ""
            which = f"containerd {_dotted(tested)}{newest}"
            findings.append(Finding(
                Reason.RUNTIME_PAIRING_UNTESTED,
                f"runc {_dotted(runc_version)} is older than the runc containerd {_dotted(containerd)} is meant for: "
                f"{which} is tested with runc {_dotted(floor)}, and its docs/RUNC.md recommends that or newer",
                Severity.WARNING, {**evidence, "runc_recommended": _dotted(floor)}))
    if containerd[:2] <= CONTAINERD_PASSING_CRIU and runc_version[:2] >= RUNC_WITHOUT_CRIU_FLAG:
        findings.append(Finding(
            Reason.RUNTIME_PAIRING_UNTESTED,
            f"containerd {_dotted(containerd)} passes `--criu` to runc on every call when the runtime's CriuPath "
            f"option is set, and runc {_dotted(runc_version)} refuses that flag (removed in runc 1.4): leave "
            "CriuPath unset", Severity.WARNING, {**evidence, "rule": "runc>=1.4 has no --criu"}))
    return findings


def check_runtime_versions(runc_path: str, state_dir: str | None, facts: dict[str, object],
                           containerd_paths: tuple[str, ...] = CONTAINERD_PATHS) -> list[Finding]:
    """The runc and containerd versions of this node into the facts (`runc_version`,
    `containerd_version`, `containerd_path`), and a warning for a known bad pairing. Only
    root's binaries are run, each under a deadline."""
    from .. import runc

    runc_version = (0, 0, 0)
    if not check_pinned_binary(runc_path, "runc"):  # the runc check reports why not
        try:
            runc_version = runc.version(runc_path, state_dir)  # read once per binary, cached in the state dir
        except SnapguardError:
            pass  # did not start or answer: the runc check says so
        if runc_version != (0, 0, 0):
            facts.setdefault("runc_version", _dotted(runc_version))
    path = next((p for p in containerd_paths if os.path.lexists(p)), None)
    facts["containerd_path"] = path
    facts["containerd_version"] = None
    if path is None:
        return []
    problem = check_pinned_binary(path, "containerd")
    if problem:
        facts["containerd_problem"] = problem
        return []
    out = probe([path, "--version"], timeout_s=10)
    if isinstance(out, str):
        facts["containerd_problem"] = out
        return []
    # `containerd github.com/containerd/containerd[/v2] VERSION [REVISION]`
    words = out.stdout.split()
    said = words[2] if len(words) >= 3 and out.returncode == 0 else None
    facts["containerd_version"] = said
    m = _VERSION.match(said or "")
    if m is None or runc_version == (0, 0, 0):
        return []
    containerd = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    return runtime_pairing(containerd, runc_version, {"containerd_path": path, "runc_path": runc_path})


def spill_tmpfs() -> dict[str, object]:
    """Where a bare trainer's take point spills on this node by default (takepoint.SPILL_TMPFS where a
    tmpfs that every user may write is mounted there, else /dev/shm; a container's, where its spec
    binds SPILL_TMPFS at the same path) and whether that tmpfs gives
    huge pages (mounted huge=within_size, advise or always; or, for /dev/shm, the node's
    shmem_enabled at force): with 4 KiB pages its fill runs at about a third of the rate
    (bench/spill_fill.py). A fact for the node report, not a finding: a trainer's own
    SNAPGUARD_TAKE_SPILL_DIR overrides it."""
    chosen = node_spill_dir()
    mounted = procfs.mount_of(chosen)
    options = mounted.get("options") if mounted else None
    huge = options.get("huge") if isinstance(options, dict) else None
    forced = "[force]" in _read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    out: dict[str, object] = {"dir": chosen, "fstype": mounted.get("fstype") if mounted else None,
                              "huge_pages": huge in ("within_size", "advise", "always") or forced}
    if not out["huge_pages"]:
        out["hint"] = (f"spills fill 4 KiB pages; mount a tmpfs with huge pages at {SPILL_TMPFS}: "
                       f"mount -t tmpfs -o mode=1777,huge=within_size,size=50% snapguard-spill {SPILL_TMPFS} "
                       f"(the Debian package's unit: systemctl start snapguard-spill)")
    return out


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def check_network_lock() -> list[Finding]:
    """CRIU locks the network namespace with iptables-restore; without it every dump fails."""
    if any(os.access(p, os.X_OK) for p in IPTABLES_RESTORE):
        return []
    return [Finding(Reason.NETWORK_LOCK_UNAVAILABLE, f"none of {', '.join(IPTABLES_RESTORE)} exists",
                    evidence={"paths": list(IPTABLES_RESTORE)})]


def check_cuda_plugin(config: Config, required: bool) -> list[Finding]:
    """CRIU's CUDA plugin in its libdir and a cuda-checkpoint at the pinned path.

    Without them CRIU silently skips GPU state: a blocker for GPU workloads, a warning otherwise.
    """
    if not required and not os.path.exists(gpu.NVIDIA_DRIVER):
        return []  # a CPU workload on a node without a GPU needs neither
    severity = Severity.BLOCKER if required else Severity.WARNING
    findings = []
    plugin = os.path.join(config.criu_libdir, "cuda_plugin.so")
    if not os.path.isfile(plugin):
        findings.append(Finding(Reason.CUDA_PLUGIN_UNAVAILABLE, f"no CUDA plugin at {plugin}", severity,
                                {"path": plugin}))
    tool = resolve_cuda_checkpoint(config)
    problem = check_pinned_binary(tool, "cuda-checkpoint") if tool else \
        f"neither {config.cuda_checkpoint} nor snapguard-cuda-checkpoint is installed"
    if not problem and tool:
        problem = _cuda_checkpoint_probe(tool, config.state_dir)
    if problem:
        findings.append(Finding(Reason.CUDA_PLUGIN_UNAVAILABLE, problem, severity,
                                {"path": tool or config.cuda_checkpoint}))
    return findings


def _cuda_checkpoint_probe(tool: str, state_dir: str | None = None) -> str | None:
    """The plugin's own probe: `cuda-checkpoint -h` must run and mention --action, or the plugin
    disables itself and a dump "succeeds" without the GPU state. A pass is remembered in the state
    directory for this very binary until reboot (as `criu check`'s is): the probe is a child's start
    inside every snapshot's preflight otherwise."""
    key = _binary_key(tool)
    cache = os.path.join(state_dir, "cuda-checkpoint-probe.json") if state_dir else None
    if cache and key and _read_json(cache).get("passed") == key:
        return None
    out = probe([tool, "-h"], timeout_s=30)
    if isinstance(out, str):
        return out
    if "--action" not in out.stdout:
        return f"{tool} -h does not mention --action (exit {out.returncode}): the CUDA plugin would disable itself"
    if cache and key:
        try:
            ensure_private_dir(os.path.dirname(cache))
            write_private_json(cache, {"passed": key})
        except (OSError, UntrustedPathError):
            pass  # a cache we cannot write only costs time
    return None


def checkpoint_api(libcuda: str, state_dir: str | None) -> dict[str, bool]:
    """{symbol: exported} of the driver's checkpoint API in `libcuda` (cuda.libcuda_checkpoint_symbols:
    the ELF's symbol table read, tens of MB parsed in Python), remembered in the state directory for
    that very file until reboot: a snapshot's preflight otherwise parses it each time. Raises what
    the reading raises (OSError, ValueError)."""
    key = _binary_key(libcuda)
    cache = os.path.join(state_dir, "libcuda-symbols.json") if state_dir else None
    if cache and key:
        known = _read_json(cache)
        symbols = known.get("symbols")
        if known.get("key") == key and isinstance(symbols, dict) and symbols \
                and all(isinstance(v, bool) for v in symbols.values()):
            return {str(k): v for k, v in symbols.items()}
    from ..cuda import libcuda_checkpoint_symbols

    found = libcuda_checkpoint_symbols(libcuda)
    if cache and key:
        try:
            ensure_private_dir(os.path.dirname(cache))
            write_private_json(cache, {"key": key, "symbols": found})
        except (OSError, UntrustedPathError):
            pass  # a cache we cannot write only costs time
    return found


def _binary_key(path: str) -> str | None:
    """What a cached answer about a binary holds for: the file (resolved, size, mtime), the kernel
    and the boot; None where the file cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{os.uname().release}:{procfs.boot_id() or ''}"


def _read_json(path: str) -> dict[str, object]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
