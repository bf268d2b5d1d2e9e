"""Workload checks: what in a process tree would make CRIU or cuda-checkpoint fail.

Everything is read from procfs (a swappable root, so fixture trees test the NVIDIA shapes this
machine cannot produce). Processes that exit while they are read are normal and skipped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import _host
from ..reasons import Finding, Reason, Severity, SnapguardError
from ._report import Report

__all__ = ["Inventory", "ProcInfo", "inventory", "process_tree", "run_checks", "read_proc"]

NVIDIA_DEV = re.compile(r"^/dev/nvidia(\d+|ctl|-uvm|-uvm-tools|-modeset|-caps/.*)$")
RDMA_DEV = re.compile(r"^/dev/(infiniband/.*|gdrdrv)$")
IO_URING = "anon_inode:[io_uring]"
CUDA_LIB = re.compile(r"/libcuda\.so(\.\d+)*$")
NCCL_SHM = "/dev/shm/nccl-"
SOCKET = re.compile(r"^socket:\[(\d+)\]$")
O_ACCMODE, O_APPEND = 0o3, 0o2000
GHOST_LIMIT = 1 << 20  # CRIU's default --ghost-limit: larger deleted files cannot be carried


@dataclass
class ProcInfo:
    """What one process holds; fields stay empty where procfs could not be read."""

    pid: int
    comm: str = ""
    ppid: int = 0
    rss_bytes: int = 0
    seccomp: int = 0
    env: dict[str, str] = field(default_factory=dict)
    mapped_paths: set[str] = field(default_factory=set)
    fd_targets: dict[int, str] = field(default_factory=dict)
    writable_files: list[dict[str, Any]] = field(default_factory=list)
    deleted_shm: list[str] = field(default_factory=list)

    def nvidia_handles(self) -> list[str]:
        held = {p for p in self.mapped_paths if NVIDIA_DEV.match(p)}
        held |= {t for t in self.fd_targets.values() if NVIDIA_DEV.match(t)}
        return sorted(held)

    @property
    def maps_libcuda(self) -> bool:
        return any(CUDA_LIB.search(p) for p in self.mapped_paths)

    @property
    def nccl_in_use(self) -> bool:
        """An NCCL communicator exists: NCCL maps its shared-memory transport under /dev/shm.
        (libnccl itself is mapped by every PyTorch CUDA process, and the NCCL_* environment is
        often set node-wide, so neither says that NCCL is in use.)"""
        return any(p.startswith(NCCL_SHM) for p in self.mapped_paths)

    @property
    def maps_gpu_memory(self) -> bool:
        """A CUDA context maps device memory (/dev/nvidiaN or /dev/nvidia-uvm); NVML alone does not."""
        return any(re.match(r"^/dev/nvidia(\d+|-uvm)$", p) for p in self.mapped_paths)


@dataclass
class Inventory:
    procs: list[ProcInfo]
    # pids the driver reports as having a CUDA context, when NVML could say; else None
    cuda_pids_from_driver: set[int] | None = None
    gpu_memory_by_pid: dict[int, int] = field(default_factory=dict)

    def cuda_processes(self) -> list[ProcInfo]:
        if self.cuda_pids_from_driver is not None:
            return [p for p in self.procs if p.pid in self.cuda_pids_from_driver]
        return [p for p in self.procs if p.maps_libcuda and p.maps_gpu_memory]

    @property
    def uses_gpu(self) -> bool:
        return any(p.nvidia_handles() for p in self.procs)

    def summary(self) -> list[dict[str, Any]]:
        cuda = {p.pid for p in self.cuda_processes()}
        return [{"pid": p.pid, "comm": p.comm, "gpu": p.pid in cuda,
                 "gpu_memory_bytes": self.gpu_memory_by_pid.get(p.pid, 0), "rss_bytes": p.rss_bytes}
                for p in self.procs]


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _vanishing(fn: Callable[[], Any], default: Any) -> Any:
    """Run a procfs read; a process or fd that went away meanwhile yields `default`."""
    try:
        return fn()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return default
    except PermissionError:
        return default


def _children(pid: int, proc: str) -> list[int]:
    kids: list[int] = []
    for tid in _vanishing(lambda: os.listdir(f"{proc}/{pid}/task"), []):
        text = _vanishing(lambda: _read(f"{proc}/{pid}/task/{tid}/children"), "")
        kids.extend(int(c) for c in text.split())
    return kids


def own_netns(pid: int, proc: str = _host.PROC) -> bool:
    """Whether pid lives in another network namespace than this process (CRIU then locks it)."""
    try:
        return os.readlink(f"{proc}/{pid}/ns/net") != os.readlink(f"{proc}/self/ns/net")
    except OSError:
        return True  # cannot tell: check the lock tools as if it did


def process_tree(root_pid: int, proc: str = _host.PROC) -> list[int]:
    """root_pid and all its descendants, root first."""
    if not os.path.isdir(f"{proc}/{root_pid}"):
        raise SnapguardError(Reason.PROCESS_NOT_FOUND, f"process {root_pid} does not exist",
                             evidence={"pid": root_pid})
    seen, order, todo = set(), [], [root_pid]
    while todo:
        pid = todo.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        order.append(pid)
        todo.extend(_children(pid, proc))
    return order


def _parse_status(text: str, info: ProcInfo) -> None:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "Name":
            info.comm = value
        elif key == "PPid":
            info.ppid = int(value)
        elif key == "VmRSS":
            info.rss_bytes = int(value.split()[0]) * 1024
        elif key == "Seccomp":
            info.seccomp = int(value)


def parse_maps(text: str) -> set[str]:
    """The paths and special names (`anon_inode:...`, `/dev/shm/x (deleted)`) of a maps file."""
    paths = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6:
            paths.add(parts[5].strip())
    return paths


def _fd_flags(proc: str, pid: int, fd: int) -> int:
    for line in _read(f"{proc}/{pid}/fdinfo/{fd}").splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0


def read_proc(pid: int, proc: str = _host.PROC) -> ProcInfo | None:
    """Everything the checks need about one process; None when it is gone."""
    info = ProcInfo(pid)
    status = _vanishing(lambda: _read(f"{proc}/{pid}/status"), None)
    if status is None:
        return None
    _parse_status(status, info)
    environ = _vanishing(lambda: _read(f"{proc}/{pid}/environ"), "")
    info.env = dict(kv.split("=", 1) for kv in environ.split("\0") if "=" in kv)
    info.mapped_paths = parse_maps(_vanishing(lambda: _read(f"{proc}/{pid}/maps"), ""))
    info.deleted_shm = sorted(p for p in info.mapped_paths if p.startswith("/dev/shm/") and p.endswith(" (deleted)"))
    for name in _vanishing(lambda: os.listdir(f"{proc}/{pid}/fd"), []):
        fd = int(name)
        target = _vanishing(lambda: os.readlink(f"{proc}/{pid}/fd/{name}"), None)
        if target is None:
            continue
        info.fd_targets[fd] = target
        if target.startswith("/") and not target.startswith("/dev/") and not target.endswith(" (deleted)"):
            flags = _vanishing(lambda: _fd_flags(proc, pid, fd), 0)
            if flags & O_ACCMODE and not flags & O_APPEND:
                info.writable_files.append({"fd": fd, "path": target})
    return info


def _nvml_cuda_pids() -> tuple[set[int] | None, dict[int, int]]:
    """pids with a CUDA context and their GPU memory, from the driver; (None, {}) without NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no driver or no library: fall back to procfs evidence
        return None, {}
    try:
        pids: set[int] = set()
        memory: dict[int, int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                pids.add(p.pid)
                memory[p.pid] = memory.get(p.pid, 0) + (p.usedGpuMemory or 0)
        return pids, memory
    except Exception:
        return None, {}
    finally:
        pynvml.nvmlShutdown()


def inventory(pids: list[int], proc: str = _host.PROC, use_nvml: bool = True) -> Inventory:
    procs = [info for pid in pids if (info := read_proc(pid, proc)) is not None]
    inv = Inventory(procs)
    if use_nvml and any(p.nvidia_handles() for p in procs):
        inv.cuda_pids_from_driver, inv.gpu_memory_by_pid = _nvml_cuda_pids()
    return inv


# --- the checks: each takes the inventory and returns findings -------------------------------


def check_stray_gpu_handles(inv: Inventory) -> list[Finding]:
    cuda = {p.pid for p in inv.cuda_processes()}
    findings = []
    for p in inv.procs:
        handles = p.nvidia_handles()
        if handles and p.pid not in cuda:
            how = "maps" if any(h in p.mapped_paths for h in handles) else "holds fds of"
            findings.append(Finding(
                Reason.STRAY_GPU_DEVICE_HANDLE,
                f"pid {p.pid} ({p.comm}) {how} {', '.join(handles[:4])} but has no CUDA context",
                evidence={"pid": p.pid, "comm": p.comm, "paths": handles}))
    return findings


def check_multi_cuda(inv: Inventory, trainers: dict[int, dict[str, Any]] | None = None) -> list[Finding]:
    """NCCL communicators cannot be checkpointed; several CUDA processes only when every one runs
    the take-point hook, so that all are held at one common step before any is locked.
    `trainers`: the take-point status of the processes that run the hook; it says whether a
    process has an NCCL process group, which procfs does not always show."""
    trainers = trainers or {}
    coordinated = set(trainers)
    cuda = inv.cuda_processes()
    nccl = [p for p in cuda if p.nccl_in_use or trainers.get(p.pid, {}).get("nccl")]
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


def established_tcp(pid: int, inodes: set[int], proc: str) -> list[dict[str, Any]]:
    """The pid's sockets (by inode) that its network namespace lists as ESTABLISHED."""
    found = []
    for table in ("tcp", "tcp6"):
        text = _vanishing(lambda: _read(f"{proc}/{pid}/net/{table}"), "")
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "01" and int(cols[9]) in inodes:
                found.append({"inode": int(cols[9]), "local": cols[1], "remote": cols[2], "table": table})
    return found


def tree_tcp(inv: Inventory, proc: str = _host.PROC) -> list[dict[str, Any]]:
    """Every established TCP connection of the tree, with its pid."""
    conns = []
    for p in inv.procs:
        inodes = {int(m.group(1)) for t in p.fd_targets.values() if (m := SOCKET.match(t))}
        conns += [{"pid": p.pid, **c} for c in (established_tcp(p.pid, inodes, proc) if inodes else [])]
    return conns


def internal_only(conns: list[dict[str, Any]]) -> bool:
    """Both ends of every connection are in the tree: frozen together, nothing outside can send
    into them, so CRIU's network lock (iptables rules on the host) is not needed."""
    ends = {(c["table"], c["local"]) for c in conns}
    return bool(conns) and all((c["table"], c["remote"]) in ends for c in conns)


def check_tcp(inv: Inventory, tcp_established: bool, proc: str = _host.PROC) -> list[Finding]:
    findings = []
    for p in inv.procs:
        inodes = {int(m.group(1)) for t in p.fd_targets.values() if (m := SOCKET.match(t))}
        conns = established_tcp(p.pid, inodes, proc) if inodes else []
        if conns:
            carried = "carried in the image (--tcp-established)" if tcp_established else \
                "CRIU refuses them without --tcp-established"
            findings.append(Finding(Reason.TCP_ESTABLISHED,
                                    f"pid {p.pid} ({p.comm}) has {len(conns)} established TCP connection(s): {carried}",
                                    Severity.WARNING if tcp_established else Severity.BLOCKER,
                                    {"pid": p.pid, "connections": conns}))
    return findings


def check_shm(inv: Inventory, proc: str = _host.PROC) -> list[Finding]:
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


def check_interposers(inv: Inventory, proc: str = _host.PROC) -> list[Finding]:
    findings = []
    cuda = {p.pid for p in inv.cuda_processes()}
    for p in inv.procs:
        preload = p.env.get("LD_PRELOAD", "").strip()
        global_preload = _vanishing(lambda: _read(f"{proc}/{p.pid}/root/etc/ld.so.preload"), "").strip()
        for source, value in (("LD_PRELOAD", preload), ("/etc/ld.so.preload", global_preload)):
            if value:
                # In a CUDA process a hook on libcuda can kill it at lock time; elsewhere it is only noted.
                severity = Severity.BLOCKER if p.pid in cuda else Severity.WARNING
                findings.append(Finding(Reason.INTERPOSER_PRESENT,
                                        f"pid {p.pid} ({p.comm}) preloads {value.split()[0]} via {source}",
                                        severity, {"pid": p.pid, "source": source, "value": value}))
    return findings


def _cgroup_headroom(pid: int, proc: str) -> int | None:
    """Bytes the pid's cgroup (v2) may still charge, or None when it has no limit."""
    text = _vanishing(lambda: _read(f"{proc}/{pid}/cgroup"), "")
    path = next((line.split(":", 2)[2] for line in text.splitlines() if line.startswith("0::")), None)
    if path is None:
        return None
    base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
    limit = _vanishing(lambda: _read(os.path.join(base, "memory.max")).strip(), "max")
    if limit == "max":
        return None
    current = int(_vanishing(lambda: _read(os.path.join(base, "memory.current")), "0"))
    return int(limit) - current


def check_host_memory(inv: Inventory, proc: str = _host.PROC) -> list[Finding]:
    """The driver copies a CUDA process's GPU memory into its host memory at checkpoint."""
    gpu_bytes = sum(inv.gpu_memory_by_pid.values())
    if not gpu_bytes:
        return []
    available = _host.mem_available_bytes(proc)
    findings = []
    if gpu_bytes > available:
        findings.append(Finding(Reason.HOST_MEMORY_INSUFFICIENT,
                                f"GPU memory to copy to host is {gpu_bytes >> 20} MiB, MemAvailable is "
                                f"{available >> 20} MiB", evidence={"needed": gpu_bytes, "available": available}))
    for p in inv.cuda_processes():
        headroom = _cgroup_headroom(p.pid, proc)
        need = inv.gpu_memory_by_pid.get(p.pid, 0)
        if headroom is not None and need > headroom:
            findings.append(Finding(Reason.HOST_MEMORY_INSUFFICIENT,
                                    f"pid {p.pid} needs {need >> 20} MiB more host memory, its cgroup allows "
                                    f"{headroom >> 20} MiB", evidence={"pid": p.pid, "needed": need,
                                                                       "cgroup_headroom": headroom}))
    return findings


def run_checks(report: Report, inv: Inventory, tcp_established: bool = False, proc: str = _host.PROC,
               trainers: dict[int, dict[str, Any]] | None = None) -> None:
    """All workload checks; `trainers`: take-point status of the pids that run the hook."""
    report.facts["processes"] = inv.summary()
    report.run("stray-gpu-handles", lambda: check_stray_gpu_handles(inv))
    report.run("multi-cuda-nccl", lambda: check_multi_cuda(inv, trainers))
    report.run("mps", lambda: check_mps(inv))
    report.run("io-uring", lambda: check_io_uring(inv))
    report.run("rdma", lambda: check_rdma(inv))
    report.run("tcp", lambda: check_tcp(inv, tcp_established, proc))
    report.run("deleted-shm", lambda: check_shm(inv, proc))
    report.run("writable-files", lambda: check_writable_files(inv))
    report.run("seccomp", lambda: check_seccomp(inv))
    report.run("interposers", lambda: check_interposers(inv, proc))
    report.run("host-memory", lambda: check_host_memory(inv, proc))
