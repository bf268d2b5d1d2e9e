"""What a tree's processes hold (maps, descriptors, environment): ProcInfo, Inventory, and their
TCP connections."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from .process import leading_int as _int
from .process import status_fields as _status
from ._root import read as _read, root as _root, vanishing as _vanishing

__all__ = ["CUDA_LIB", "NCCL_SHM", "NVIDIA_DEV", "Inventory", "ProcInfo", "established_tcp", "internal_only",
           "inventory", "parse_maps", "read_proc", "tree_tcp"]

NVIDIA_DEV = re.compile(r"^/dev/nvidia(\d+|ctl|-uvm|-uvm-tools|-modeset|-caps/.*)$")
CUDA_LIB = re.compile(r"/libcuda\.so(\.\d+)*$")
NCCL_SHM = "/dev/shm/nccl-"
SOCKET = re.compile(r"^socket:\[(\d+)\]$")
O_ACCMODE, O_APPEND = 0o3, 0o2000


@dataclass
class ProcInfo:
    """What one process holds; fields stay empty where procfs could not be read."""

    pid: int
    comm: str = ""
    ppid: int = 0
    nspid: int = 0
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

    def socket_inodes(self) -> set[int]:
        return {int(m.group(1)) for t in self.fd_targets.values() if (m := SOCKET.match(t))}


@dataclass
class Inventory:
    procs: list[ProcInfo]
    # pids the driver reports as having a CUDA context, when the driver could say; else None
    cuda_pids_from_driver: set[int] | None = None
    gpu_memory_by_pid: dict[int, int] = field(default_factory=dict)

    def attach_gpu(self, gpu_facts: dict[str, Any] | None) -> None:
        """Take the CUDA pids and their GPU memory from the driver's inventory (NVML, read once
        by the host checks), which tells a CUDA process from a forked child holding its handles."""
        if not gpu_facts:
            return
        self.cuda_pids_from_driver = set()
        self.gpu_memory_by_pid = {}
        for g in gpu_facts.get("gpus", []):
            for pid, used in g.get("processes", {}).items():
                self.cuda_pids_from_driver.add(int(pid))
                self.gpu_memory_by_pid[int(pid)] = self.gpu_memory_by_pid.get(int(pid), 0) + int(used)

    def cuda_processes(self) -> list[ProcInfo]:
        if self.cuda_pids_from_driver is not None:
            return [p for p in self.procs if p.pid in self.cuda_pids_from_driver]
        return [p for p in self.procs if p.maps_libcuda and p.maps_gpu_memory]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def uses_gpu(self) -> bool:
        return any(p.nvidia_handles() for p in self.procs)

    def summary(self) -> list[dict[str, Any]]:
        cuda = {p.pid for p in self.cuda_processes()}
        return [{"pid": p.pid, "nspid": p.nspid or p.pid, "comm": p.comm, "gpu": p.pid in cuda,
                 "gpu_memory_bytes": self.gpu_memory_by_pid.get(p.pid, 0), "rss_bytes": p.rss_bytes}
                for p in self.procs]


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


def read_proc(pid: int, proc: str | None = None) -> ProcInfo | None:
    """Everything the checks need about one process; None when it is gone."""
    root = _root(proc)
    status = _status(pid, root)
    if status is None:
        return None
    info = ProcInfo(pid, comm=status.get("Name", ""), ppid=_int(status.get("PPid", "0")),
                    rss_bytes=_int(status.get("VmRSS", "0")) * 1024, seccomp=_int(status.get("Seccomp", "0")))
    try:
        info.nspid = int(status.get("NSpid", str(pid)).split()[-1])
    except (ValueError, IndexError):
        info.nspid = pid
    environ = _vanishing(lambda: _read(f"{root}/{pid}/environ"), "")
    info.env = dict(kv.split("=", 1) for kv in environ.split("\0") if "=" in kv)
    info.mapped_paths = parse_maps(_vanishing(lambda: _read(f"{root}/{pid}/maps"), ""))
    info.deleted_shm = sorted(p for p in info.mapped_paths if p.startswith("/dev/shm/") and p.endswith(" (deleted)"))
    names: list[str] = _vanishing(lambda: os.listdir(f"{root}/{pid}/fd"), [])
    for name in names:
        if not name.isdigit():
            continue
        fd = int(name)
        target = _vanishing(lambda: os.readlink(f"{root}/{pid}/fd/{name}"), None)
        if target is None:
            continue
        info.fd_targets[fd] = target
        if target.startswith("/") and not target.startswith("/dev/") and not target.endswith(" (deleted)"):
            flags = _vanishing(lambda: _fd_flags(root, pid, fd), 0)
            if flags & O_ACCMODE and not flags & O_APPEND:
                info.writable_files.append({"fd": fd, "path": target})
    return info


def inventory(pids: list[int], proc: str | None = None, gpu_facts: dict[str, Any] | None = None) -> Inventory:
    """What the processes hold, from procfs; `gpu_facts` (the host checks' NVML inventory)
    names the CUDA processes among them."""
    procs = [info for pid in pids if (info := read_proc(pid, proc)) is not None]
    inv = Inventory(procs)
    inv.attach_gpu(gpu_facts)
    return inv


# --- TCP ---------------------------------------------------------------------------------------


def established_tcp(pid: int, inodes: set[int], proc: str | None = None) -> list[dict[str, Any]]:
    """The pid's sockets (by inode) that its network namespace lists as ESTABLISHED."""
    root = _root(proc)
    found = []
    for table in ("tcp", "tcp6"):
        text = _vanishing(lambda: _read(f"{root}/{pid}/net/{table}"), "")
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "01" and cols[9].isdigit() and int(cols[9]) in inodes:
                found.append({"inode": int(cols[9]), "local": cols[1], "remote": cols[2], "table": table})
    return found


def tree_tcp(inv: Inventory, proc: str | None = None) -> list[dict[str, Any]]:
    """Every established TCP connection of the tree, with its pid."""
    conns = []
    for p in inv.procs:
        inodes = p.socket_inodes()
        conns += [{"pid": p.pid, **c} for c in (established_tcp(p.pid, inodes, proc) if inodes else [])]
    return conns


def internal_only(conns: list[dict[str, Any]]) -> bool:
    """Both ends of every connection are in the tree: frozen together, nothing outside can send
    into them, so CRIU's network lock (iptables rules on the host) is not needed."""
    ends = {(c["table"], c["local"]) for c in conns}
    return bool(conns) and all((c["table"], c["remote"]) in ends for c in conns)
