"""Workload checks: what in a process tree would make CRIU or cuda-checkpoint fail.

Each check takes the tree's `procfs.Inventory` (the process model, read once) and returns
findings; nothing here reads /proc but through `snapguard.procfs`.
"""

from __future__ import annotations

import re
from typing import Any

from .. import procfs
from ..procfs import Inventory
from ..reasons import Finding, Reason, Severity
from ..takepoint import protocol
from ._report import Report

__all__ = ["check_host_memory", "check_multi_cuda", "check_process_groups", "check_stray_gpu_handles", "groups_released",
           "run_checks"]

RDMA_DEV = re.compile(r"^/dev/(infiniband/.*|gdrdrv)$")
IO_URING = "anon_inode:[io_uring]"
GHOST_LIMIT = 1 << 20  # CRIU's default --ghost-limit: larger deleted files cannot be carried


# --- the checks: each takes the inventory and returns findings -------------------------------


def _hooked_ancestor(p: procfs.ProcInfo, by_pid: dict[int, procfs.ProcInfo],
                     trainers: dict[int, dict[str, Any]]) -> int | None:
    """The nearest ancestor of p in the tree that is a trainer running the take-point hook."""
    seen = {p.pid}
    q = by_pid.get(p.ppid)
    while q is not None and q.pid not in seen:
        if q.pid in trainers:
            return q.pid
        seen.add(q.pid)
        q = by_pid.get(q.ppid)
    return None


def _compile_pool_owner(p: procfs.ProcInfo, by_pid: dict[int, procfs.ProcInfo],
                        trainers: dict[int, dict[str, Any]]) -> int | None:
    """The hooked trainer whose torch.compile pool p belongs to (a pool pid, or a process below
    one), when that trainer's take point shuts its pool down at the take."""
    pools = {pid: t for t, st in trainers.items() if st.get(protocol.RESOLVE)
             for pid in (st.get(protocol.COMPILE_POOL) or {}).get(protocol.POOL_PIDS, [])
             if (st.get(protocol.COMPILE_POOL) or {}).get(protocol.POOL_SHUTDOWN_AT_TAKE)}
    seen: set[int] = set()
    q: procfs.ProcInfo | None = p
    while q is not None and q.pid not in seen:
        if q.pid in pools:
            return pools[q.pid]
        seen.add(q.pid)
        q = by_pid.get(q.ppid)
    return None


def check_stray_gpu_handles(inv: Inventory, trainers: dict[int, dict[str, Any]] | None = None) -> list[Finding]:
    """/dev/nvidia* held outside a CUDA context: CRIU cannot dump it. `trainers`: the take-point
    status of the tree's hooked trainers. A hooked trainer (SNAPGUARD_RESOLVE_BLOCKERS not 0) drops
    the handles its forked children inherit, right after each fork, so a clean tree has none to
    show; its torch.compile pool, still up, is shut down at the take (and the take refuses if it
    is not): noted, not a blocker. Anything else is refused before anything is frozen, the pid
    named with what to change."""
    trainers = trainers or {}
    cuda = {p.pid for p in inv.cuda_processes()}
    by_pid = {p.pid: p for p in inv.procs}
    findings = []
    for p in inv.procs:
        handles = p.nvidia_handles()
        if not handles or p.pid in cuda:
            continue
        how = "maps" if any(h in p.mapped_paths for h in handles) else "holds fds of"
        what = f"pid {p.pid} ({p.comm}) {how} {', '.join(handles[:4])} but has no CUDA context"
        evidence: dict[str, Any] = {"pid": p.pid, "comm": p.comm, "paths": handles}
        owner = _compile_pool_owner(p, by_pid, trainers)
        if owner is not None:
            findings.append(Finding(
                Reason.STRAY_GPU_DEVICE_HANDLE,
                f"{what}: it is torch.compile's worker pool of trainer {owner}, whose take point shuts the "
                "pool down before the freeze (the snapshot is refused if it does not)", Severity.WARNING,
                {**evidence, "cause": "compile-pool", "trainer": owner}))
            continue
        trainer = _hooked_ancestor(p, by_pid, trainers)
        st = trainers.get(trainer, {}) if trainer is not None else {}
        if trainer is None and p.ppid in cuda:
            cause, why = "unhooked", (f"forked from CUDA process {p.ppid}, which does not run snapguard's "
                                      "take-point hook: start the job with the hook (it drops the GPU handles "
                                      "forked children inherit and shuts torch.compile's pool down), or start "
                                      "workers with the spawn method")
        elif trainer is None:
            cause, why = "unhooked", ("no trainer above it runs snapguard's take-point hook: a torch.compile "
                                      "pool is shut down by the hook; an NVML user or monitor must be stopped "
                                      "before the snapshot")
        elif not st.get(protocol.RESOLVE) or not st.get(protocol.GPU_HANDLES_DROPPED):
            cause, why = "hook-resolve-off", (f"trainer {trainer} runs the take-point hook with "
                                              "SNAPGUARD_RESOLVE_BLOCKERS=0 (or a hook that predates it): unset "
                                              "it, or start workers with the spawn method")
        else:
            cause, why = "opened-in-child", (f"trainer {trainer} runs the hook, which drops what a child of a "
                                             "CUDA process inherits: this one opened them itself, or was forked "
                                             "before its parent had a CUDA context (NVML); stop it before the "
                                             "snapshot, or start it with the spawn method")
        findings.append(Finding(Reason.STRAY_GPU_DEVICE_HANDLE, f"{what}; {why}",
                                evidence={**evidence, "cause": cause, "trainer": trainer}))
    return findings


def groups_released(status: dict[str, Any] | None) -> bool:
    """Whether a trainer's take point (its status answer) releases all its process groups and
    their store at the hold: it has groups, and none it cannot reach."""
    groups = (status or {}).get(protocol.GROUPS) or {}
    return bool(groups.get(protocol.GROUP_LIST)) and not groups.get(protocol.GROUPS_UNREACHED) \
        and not groups.get(protocol.GROUPS_CAPTURED)


def _groups_text(groups: dict[str, Any]) -> str:
    listed = [f"{g.get(protocol.GROUP_BACKEND)} (rank {g.get(protocol.GROUP_RANK)} of ranks "
              f"{g.get(protocol.GROUP_RANKS)})" for g in groups.get(protocol.GROUP_LIST) or []][:6]
    store = groups.get(protocol.GROUP_STORE) or {}
    where = f"; store {store.get('host')}:{store.get('port')}{' hosted here' if store.get('hosted') else ''}" \
        if store else ""
    return ", ".join(listed) + where


def check_process_groups(inv: Inventory, trainers: dict[int, dict[str, Any]] | None = None,
                         tcp_established: bool = False) -> list[Finding]:
    """What the take point resolves of torch.distributed and what it cannot: groups and stores it
    does not reach (PROCESS_GROUP_UNREACHED), NCCL collectives captured in a CUDA graph
    (COLLECTIVE_IN_CUDA_GRAPH), and NCCL groups that may use NVLink multicast (NCCL_NVLS_ON:
    NCCL_NVLS_ENABLE not 0 in the rank's environment). With --tcp-established a group it does
    not reach is a warning: its connections are carried, for a restore on the same addresses."""
    by_pid = {p.pid: p for p in inv.procs}
    findings = []
    for pid, st in (trainers or {}).items():
        groups = st.get(protocol.GROUPS) or {}
        for why in groups.get(protocol.GROUPS_UNREACHED) or []:
            carried = "; its connections are carried (--tcp-established): restore on the same addresses" \
                if tcp_established else ""
            findings.append(Finding(Reason.PROCESS_GROUP_UNREACHED, f"pid {pid}: {why}{carried}",
                                    Severity.WARNING if tcp_established else Severity.BLOCKER,
                                    {"pid": pid, "groups": groups}))
        if groups.get(protocol.GROUPS_CAPTURED):
            findings.append(Finding(Reason.COLLECTIVE_IN_CUDA_GRAPH, f"pid {pid}: an NCCL collective ran under "
                                    "CUDA graph capture; its communicator cannot be released at the hold",
                                    evidence={"pid": pid}))
        nccl = [g for g in groups.get(protocol.GROUP_LIST) or [] if g.get(protocol.GROUP_BACKEND) == "nccl"]
        p = by_pid.get(pid)
        nvls = p.env.get("NCCL_NVLS_ENABLE", "") if p is not None else ""
        if nccl and nvls.strip() != "0":
            findings.append(Finding(Reason.NCCL_NVLS_ON, f"pid {pid} has {len(nccl)} NCCL group(s) and "
                                    f"NCCL_NVLS_ENABLE={nvls or '(unset)'}: NVLink multicast may be in use",
                                    evidence={"pid": pid, "NCCL_NVLS_ENABLE": nvls}))
    return findings


def check_multi_cuda(inv: Inventory, trainers: dict[int, dict[str, Any]] | None = None) -> list[Finding]:
    """NCCL communicators cannot be checkpointed; several CUDA processes only when every one runs
    the take-point hook, so that all are held at one common step before any is locked.
    `trainers`: the take-point status of the processes that run the hook; it says whether a
    process has an NCCL process group, which procfs does not always show."""
    trainers = trainers or {}
    coordinated = set(trainers)
    cuda = inv.cuda_processes()
    # an NCCL communicator the take point releases at the hold (its own backend) is none of these
    nccl = [p for p in cuda if (p.nccl_in_use and not groups_released(trainers.get(p.pid)))
            or trainers.get(p.pid, {}).get(protocol.NCCL)]
    if nccl:
        p = nccl[0]
        return [Finding(Reason.NCCL_UNSUPPORTED,
                        f"pid {p.pid} ({p.comm}) has an NCCL communicator, which cuda-checkpoint cannot "
                        "checkpoint (locking one rank hangs its peers)",
                        evidence={"pids": [q.pid for q in nccl]})]
    if len(cuda) > 1 and not {p.pid for p in cuda} <= coordinated:
        return [Finding(Reason.NCCL_UNSUPPORTED,
                        f"{len(cuda)} CUDA processes ({', '.join(str(p.pid) for p in cuda)}) "
                        "cannot be locked as one: not all run the take-point hook",
                        evidence={"pids": [p.pid for p in cuda]})]
    return []


def check_mps(inv: Inventory) -> list[Finding]:
    for p in inv.procs:
        evidence: list[str] = [k for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY") if k in p.env]
        evidence += sorted(t for t in p.fd_targets.values() if "nvidia-mps" in t)
        if evidence and (p.nvidia_handles() or p.comm == "nvidia-cuda-mps"):
            return [Finding(Reason.MPS_UNSUPPORTED, f"pid {p.pid} ({p.comm}) uses CUDA MPS ({evidence[0]})",
                            evidence={"pid": p.pid, "evidence": evidence})]
    return []


def check_io_uring(inv: Inventory) -> list[Finding]:
    return [Finding(Reason.IO_URING_PRESENT, f"pid {p.pid} ({p.comm}) has an io_uring instance",
                    evidence={"pid": p.pid, "comm": p.comm})
            for p in inv.procs if IO_URING in p.fd_targets.values() or IO_URING in p.mapped_paths]


def check_rdma(inv: Inventory) -> list[Finding]:
    findings = []
    for p in inv.procs:
        held = sorted({t for t in [*p.fd_targets.values(), *p.mapped_paths] if RDMA_DEV.match(t)})
        if held:
            findings.append(Finding(Reason.RDMA_DEVICE_PRESENT, f"pid {p.pid} ({p.comm}) holds {', '.join(held)}",
                                    evidence={"pid": p.pid, "paths": held}))
    return findings


def check_tcp(inv: Inventory, tcp_established: bool, proc: str | None = None,
              trainers: dict[int, dict[str, Any]] | None = None) -> list[Finding]:
    """Established TCP connections: CRIU refuses them without --tcp-established. A trainer whose
    take point releases its process groups and their store at the hold has none left at the
    dump (they are rebuilt after it, at the job's new addresses after a restore): noted, not a
    blocker. A connection that is not the groups' is still one CRIU refuses at the dump."""
    findings = []
    # torchrun's agent hosts its workers' store; their take point has it release its own stores
    agents = {st[protocol.GROUPS][protocol.GROUP_STORE]["agent"]: st for st in (trainers or {}).values()
              if groups_released(st) and "agent" in (st[protocol.GROUPS].get(protocol.GROUP_STORE) or {})}
    for p in inv.procs:
        inodes = p.socket_inodes()
        conns = procfs.established_tcp(p.pid, inodes, proc) if inodes else []
        status = (trainers or {}).get(p.pid)
        if conns and p.pid in agents and status is None and not tcp_established:
            findings.append(Finding(Reason.TCP_ESTABLISHED,
                                    f"pid {p.pid} ({p.comm}) is torchrun's agent, with {len(conns)} established TCP "
                                    "connection(s) of its stores, released at its workers' hold and rebuilt after it",
                                    Severity.WARNING, {"pid": p.pid, "connections": conns, "cause": "agent-released"}))
        elif conns and groups_released(status) and not tcp_established:
            findings.append(Finding(Reason.TCP_ESTABLISHED,
                                    f"pid {p.pid} ({p.comm}) has {len(conns)} established TCP connection(s) of its "
                                    "process groups, released at the hold and rebuilt after it: "
                                    f"{_groups_text(status[protocol.GROUPS])}",
                                    Severity.WARNING, {"pid": p.pid, "connections": conns, "cause": "groups-released",
                                                       "groups": status[protocol.GROUPS]}))
        elif conns:
            carried = "carried in the image (--tcp-established)" if tcp_established else \
                "CRIU refuses them without --tcp-established"
            findings.append(Finding(Reason.TCP_ESTABLISHED,
                                    f"pid {p.pid} ({p.comm}) has {len(conns)} established TCP connection(s): {carried}",
                                    Severity.WARNING if tcp_established else Severity.BLOCKER,
                                    {"pid": p.pid, "connections": conns}))
    return findings


def check_shm(inv: Inventory, proc: str | None = None) -> list[Finding]:
    findings = []
    for p in inv.procs:
        for path in p.deleted_shm:
            findings.append(Finding(
                Reason.SHM_DELETED_FILE,
                f"pid {p.pid} ({p.comm}) maps deleted {path.removesuffix(' (deleted)')}; CRIU carries such files "
                f"only up to its ghost limit ({GHOST_LIMIT >> 20} MiB)",
                Severity.WARNING, {"pid": p.pid, "path": path}))
    return findings


def check_writable_files(inv: Inventory) -> list[Finding]:
    return [Finding(Reason.FILE_CHANGED,
                    f"pid {p.pid} ({p.comm}) has {w['path']} open for writing without O_APPEND: if its size "
                    "changes after the dump, the restore fails",
                    Severity.WARNING, {"pid": p.pid, **w})
            for p in inv.procs for w in p.writable_files]


def check_seccomp(inv: Inventory) -> list[Finding]:
    filtered = [p for p in inv.procs if p.seccomp == 2]
    if not filtered:
        return []
    return [Finding(Reason.SECCOMP_BLOCKED,
                    f"{len(filtered)} process(es) run under a seccomp filter (pid {filtered[0].pid}); "
                    "CRIU suspends it through ptrace, which `criu check` verified",
                    Severity.WARNING, {"pids": [p.pid for p in filtered]})]


def check_interposers(inv: Inventory, proc: str | None = None) -> list[Finding]:
    findings = []
    cuda = {p.pid for p in inv.cuda_processes()}
    for p in inv.procs:
        preload = p.env.get("LD_PRELOAD", "").strip()
        global_preload = procfs.proc_text(p.pid, "root/etc/ld.so.preload", proc).strip()
        for source, value in (("LD_PRELOAD", preload), ("/etc/ld.so.preload", global_preload)):
            if value:
                # In a CUDA process a hook on libcuda can kill it at lock time; elsewhere it is only noted.
                severity = Severity.BLOCKER if p.pid in cuda else Severity.WARNING
                findings.append(Finding(Reason.INTERPOSER_PRESENT,
                                        f"pid {p.pid} ({p.comm}) preloads {value.split()[0]} via {source}",
                                        severity, {"pid": p.pid, "source": source, "value": value}))
    return findings


def check_host_memory(inv: Inventory, proc: str | None = None) -> list[Finding]:
    """The driver copies a CUDA process's GPU memory into its host memory at checkpoint."""
    gpu_bytes = sum(inv.gpu_memory_by_pid.values())
    if not gpu_bytes:
        return []
    available = procfs.mem_available_bytes(proc)
    findings = []
    if gpu_bytes > available:
        findings.append(Finding(Reason.HOST_MEMORY_INSUFFICIENT,
                                f"GPU memory to copy to host is {gpu_bytes >> 20} MiB, MemAvailable is "
                                f"{available >> 20} MiB", evidence={"needed": gpu_bytes, "available": available}))
    for p in inv.cuda_processes():
        headroom = procfs.cgroup_memory_headroom(p.pid, proc)
        need = inv.gpu_memory_by_pid.get(p.pid, 0)
        if headroom is not None and need > headroom:
            findings.append(Finding(Reason.HOST_MEMORY_INSUFFICIENT,
                                    f"pid {p.pid} needs {need >> 20} MiB more host memory, its cgroup allows "
                                    f"{headroom >> 20} MiB", evidence={"pid": p.pid, "needed": need,
                                                                       "cgroup_headroom": headroom}))
    return findings


ONEDNN_LIB = re.compile(r"/(libtorch_cpu|libdnnl|libmkldnn)[^/]*\.so")
AMX_FREE_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                 "AVX512_CORE_BF16", "AVX512_CORE_FP16")


def check_amx(inv: Inventory, cpu_flags: list[str]) -> list[Finding]:
    """Intel AMX: oneDNN (PyTorch's CPU matmuls in bf16) uses it where the CPU has it, after the
    kernel grants the process AMX permission. CRIU 4.2.1 restores neither that permission nor the
    tile registers: the restored process dies with SIGILL at its next AMX instruction. Noted for
    processes that load oneDNN on such a CPU without capping its ISA below AMX."""
    if "amx_tile" not in cpu_flags:
        return []
    findings = []
    for p in inv.procs:
        if not any(ONEDNN_LIB.search(m) for m in p.mapped_paths):
            continue
        if p.env.get("ONEDNN_MAX_CPU_ISA", "").upper() in AMX_FREE_ISAS:
            continue
        findings.append(Finding(Reason.AMX_STATE_UNSUPPORTED,
                                f"pid {p.pid} ({p.comm}) loads oneDNN on a CPU with AMX: if it ran AMX code "
                                "(bf16 matmuls on the CPU), its restored process dies with SIGILL",
                                Severity.WARNING, {"pid": p.pid, "comm": p.comm}))
    return findings


def run_checks(report: Report, inv: Inventory, tcp_established: bool = False, proc: str | None = None,
               trainers: dict[int, dict[str, Any]] | None = None) -> None:
    """All workload checks; `trainers`: take-point status of the pids that run the hook."""
    report.processes = inv.summary()
    report.run("stray-gpu-handles", lambda: check_stray_gpu_handles(inv, trainers))
    report.run("multi-cuda-nccl", lambda: check_multi_cuda(inv, trainers))
    report.run("mps", lambda: check_mps(inv))
    report.run("io-uring", lambda: check_io_uring(inv))
    report.run("rdma", lambda: check_rdma(inv))
    report.run("process-groups", lambda: check_process_groups(inv, trainers, tcp_established))
    report.run("tcp", lambda: check_tcp(inv, tcp_established, proc, trainers))
    report.run("deleted-shm", lambda: check_shm(inv, proc))
    report.run("writable-files", lambda: check_writable_files(inv))
    report.run("seccomp", lambda: check_seccomp(inv))
    report.run("interposers", lambda: check_interposers(inv, proc))
    report.run("host-memory", lambda: check_host_memory(inv, proc))
    cpu_flags = report.host.cpu_flags
    report.run("amx", lambda: check_amx(inv, cpu_flags))
