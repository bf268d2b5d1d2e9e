"""Host checks: can this machine run CRIU snapshots at all."""

from __future__ import annotations

import os

from .. import criu
from ..children import probe
from ..config import Config, check_pinned_binary, resolve_cuda_checkpoint
from ..reasons import Finding, Reason, Severity

__all__ = ["check_criu", "check_network_lock", "check_privileges", "check_cuda_plugin", "check_runc",
           "IPTABLES_RESTORE"]

CAP_SYS_PTRACE, CAP_SYS_ADMIN = 19, 21
NVIDIA_DRIVER = "/proc/driver/nvidia/version"
IPTABLES_RESTORE = ("/usr/sbin/iptables-restore", "/sbin/iptables-restore")


def check_privileges(proc: str = "/proc") -> list[Finding]:
    if os.geteuid() != 0:
        return [Finding(Reason.INSUFFICIENT_PRIVILEGE, f"running as uid {os.geteuid()}, CRIU needs root",
                        evidence={"euid": os.geteuid()})]
    with open(os.path.join(proc, "self", "status")) as f:
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
    if not required and not os.path.exists(NVIDIA_DRIVER):
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
        problem = _cuda_checkpoint_probe(tool)
    if problem:
        findings.append(Finding(Reason.CUDA_PLUGIN_UNAVAILABLE, problem, severity,
                                {"path": tool or config.cuda_checkpoint}))
    return findings


def _cuda_checkpoint_probe(tool: str) -> str | None:
    """The plugin's own probe: `cuda-checkpoint -h` must run and mention --action, or the plugin
    disables itself and a dump "succeeds" without the GPU state."""
    out = probe([tool, "-h"], timeout_s=30)
    if isinstance(out, str):
        return out
    if "--action" not in out.stdout:
        return f"{tool} -h does not mention --action (exit {out.returncode}): the CUDA plugin would disable itself"
    return None
