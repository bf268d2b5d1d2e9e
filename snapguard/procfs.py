"""The process model: every read of /proc that snapguard makes, under one procfs root.

The root is `procfs_path()` ("/proc" unless a test or a container-aware caller sets another with
`set_procfs_path` or `using_procfs`, as psutil's PROCFS_PATH); functions also take `proc=` for
fixture trees. Processes that exit while they are read are normal on a busy node and skipped:
a read that loses its process yields the function's empty answer, never an exception.

psutil is not used: its `children(recursive=True)` scans every process's stat on the node, and
`memory_maps` is 20x slower than this module's reads (bench/scan.py); both matter on nodes with
thousands of processes, inside a snapshot's stall.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .reasons import Reason, SnapguardError

__all__ = [
    "Inventory", "ProcInfo", "cpu_info", "established_tcp", "host_facts", "internal_only", "inventory",
    "alive", "mem_available_bytes", "mount_here", "euid", "nspid", "own_mntns", "own_netns", "parse_maps", "process_state", "process_tree", "procfs_path",
    "read_proc", "set_procfs_path", "tree_tcp", "using_procfs", "check_target", "proc_text",
    "cgroup_memory_headroom", "mount_of", "mounts_on_path", "pid_map", "start_ticks",
]

_procfs = "/proc"

NVIDIA_DEV = re.compile(r"^/dev/nvidia(\d+|ctl|-uvm|-uvm-tools|-modeset|-caps/.*)$")
CUDA_LIB = re.compile(r"/libcuda\.so(\.\d+)*$")
NCCL_SHM = "/dev/shm/nccl-"
SOCKET = re.compile(r"^socket:\[(\d+)\]$")
O_ACCMODE, O_APPEND = 0o3, 0o2000
PF_KTHREAD = 0x00200000  # include/linux/sched.h: the task is a kernel thread

T = TypeVar("T")


def procfs_path() -> str:
    """The procfs root every read goes through."""
    return _procfs


def set_procfs_path(path: str) -> None:
    global _procfs
    _procfs = path


@contextmanager
def using_procfs(path: str) -> Iterator[str]:
    """Read another procfs root (a fixture tree) for the duration of the block."""
    old = _procfs
    set_procfs_path(path)
    try:
        yield path
    finally:
        set_procfs_path(old)


def _root(proc: str | None) -> str:
    return proc or _procfs


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _vanishing(fn: Callable[[], T], default: T) -> T:
    """Run a procfs read; a process or fd that went away meanwhile (or that we may not read)
    yields `default`."""
    try:
        return fn()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
        return default
    except OSError as e:
        if e.errno in (3, 2):  # ESRCH, ENOENT from some procfs files of an exiting task
            return default
        raise


# --- this host ---------------------------------------------------------------------------------


def cpu_info(proc: str | None = None) -> dict[str, Any]:
    """CPU model and the flags every CPU has (the intersection: flags can differ per core)."""
    model = ""
    flag_sets: list[set[str]] = []
    with open(os.path.join(_root(proc), "cpuinfo")) as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags":
                flag_sets.append(set(value.split()))
    flags = set.intersection(*flag_sets) if flag_sets else set()
    return {"model": model, "flags": sorted(flags)}


def mem_available_bytes(proc: str | None = None) -> int:
    with open(os.path.join(_root(proc), "meminfo")) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("MemAvailable missing from meminfo")


def host_facts(proc: str | None = None) -> dict[str, Any]:
    uname = os.uname()
    return {"hostname": uname.nodename, "kernel": uname.release, "arch": uname.machine, "cpu": cpu_info(proc)}


# --- single processes --------------------------------------------------------------------------


def _stat_fields(pid: int, proc: str | None) -> list[str] | None:
    """Fields of /proc/PID/stat after the comm (field 3, the state, first); None when gone."""
    text = _vanishing(lambda: _read(f"{_root(proc)}/{pid}/stat"), None)
    if text is None or ")" not in text:
        return None
    # comm, in parentheses, may itself contain spaces and parentheses
    return text.rsplit(")", 1)[1].split()


def process_state(pid: int, proc: str | None = None) -> str:
    """The state letter of /proc/PID/stat (R, S, Z...), or "gone"."""
    fields = _stat_fields(pid, proc)
    return fields[0] if fields else "gone"


def alive(pid: int, proc: str | None = None) -> bool:
    """Whether pid runs: neither gone nor a zombie (nor dead, X)."""
    return process_state(pid, proc) not in ("gone", "Z", "X")


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(text: str) -> list[dict[str, Any]]:
    """mountinfo's lines, in its order: {"id", "dev" ("major:minor"), "root" (the directory of the
    filesystem mounted there), "mount_point", "fstype", "options": {name: value or ""}} with the
    filesystem's own options (tmpfs's huge=, size=); lines that are not mountinfo's skipped."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split(" ")  # a mount's source may be empty
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        options = dict((o.partition("=")[0], o.partition("=")[2]) for o in tail[2].split(","))
        out.append({"id": fields[0], "dev": fields[2], "root": _unescape(fields[3]),
                    "mount_point": _unescape(fields[4]), "fstype": tail[0], "options": options})
    return out


def _chain(mounts: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    on: dict[str, dict[str, Any]] = {}
    for m in mounts:
        point = m["mount_point"]
        if path == point or path.startswith(point.rstrip("/") + "/"):
            on[point] = m  # the last one stacked
    return [on[point] for point in sorted(on, key=len)]


def mounts_on_path(path: str, proc: str | None = None, pid: int | None = None) -> list[dict[str, Any]] | None:
    """The mounts a lookup of `path` (absolute, canonical, no component a link) goes through, as
    this process sees them (its /proc/self/mountinfo; `pid`'s, in its mount namespace), from / to
    the one `path` is on: for each mount point on the way, the last mount there. Each is as
    `_mounts` gives it ({"mount_point", "fstype", "options", ...}). None when mountinfo cannot be
    read. Read from mountinfo only: no filesystem on the way is touched."""
    text = _vanishing(lambda: _read(f"{_root(proc)}/{'self' if pid is None else pid}/mountinfo"), None)
    return None if text is None else _chain(_mounts(text), path)


def mount_here(pid: int, mount_point: str, proc: str | None = None) -> str | None:
    """Where this process reaches the directory that pid (in another mount namespace: a
    container's) has mounted at `mount_point`: the path, in this process's namespace, of that
    mount's root, found where the same filesystem (device) is mounted here at a root that holds
    it, and nothing is mounted over the way to it. A bind mount of a host directory into a
    container is found so; a filesystem mounted only in pid's namespace (its own tmpfs) is not.
    None when there is none, or mountinfo cannot be read. Read from mountinfo only."""
    root = _root(proc)
    theirs = _vanishing(lambda: _read(f"{root}/{pid}/mountinfo"), None)
    mine = _vanishing(lambda: _read(f"{root}/self/mountinfo"), None)
    if theirs is None or mine is None:
        return None
    on = _chain(_mounts(theirs), mount_point)
    # the last mount at that point (mountinfo's order cannot tell one mounted later over a
    # directory above it: the caller compares the directories themselves), of a source that still
    # exists (the kernel shows a removed one's root as ".../name//deleted")
    if not on or on[-1]["mount_point"] != mount_point or on[-1]["root"].endswith("//deleted"):
        return None
    there, here = on[-1], _mounts(mine)
    found = None
    for m in here:
        inside = m["root"].rstrip("/") + "/"
        if m["dev"] != there["dev"] or m["fstype"] != there["fstype"] or \
                not (there["root"] == m["root"] or there["root"].startswith(inside)):
            continue
        path = os.path.normpath(m["mount_point"].rstrip("/") + "/" + there["root"][len(m["root"]):].lstrip("/"))
        chain = _chain(here, path)
        if chain and chain[-1]["id"] == m["id"] and (found is None or len(m["root"]) > len(found[0])):
            found = (m["root"], path)  # the mount whose root is nearest theirs
    return found[1] if found else None


def mount_of(path: str, proc: str | None = None) -> dict[str, Any] | None:
    """The mount `path` is on (the last of `mounts_on_path`); None when that cannot be told."""
    chain = mounts_on_path(path, proc)
    return chain[-1] if chain else None


def start_ticks(pid: int, proc: str | None = None) -> int | None:
    """When the process started, in clock ticks since boot (/proc/PID/stat's field 22): with the
    pid, a name for one process that a later process given the same pid does not share. None
    when it is gone."""
    fields = _stat_fields(pid, proc)
    return int(fields[19]) if fields and len(fields) > 19 and fields[19].isdigit() else None


def _status(pid: int, proc: str | None) -> dict[str, str] | None:
    text = _vanishing(lambda: _read(f"{_root(proc)}/{pid}/status"), None)
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def euid(pid: int, proc: str | None = None) -> int | None:
    """The process's effective uid (its /proc/PID/status; the /proc/PID directory is root's when
    the process is not dumpable), or None when it is gone or does not say."""
    fields = ((_status(pid, proc) or {}).get("Uid") or "").split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def nspid(pid: int, proc: str | None = None) -> int:
    """The pid as the process itself sees it (its innermost pid namespace); pid when unknown."""
    status = _status(pid, proc) or {}
    try:
        return int(status.get("NSpid", str(pid)).split()[-1])
    except (ValueError, IndexError):
        return pid


def check_target(pid: int, proc: str | None = None) -> None:
    """Refuse, typed, a pid CRIU cannot take as the root of a tree: absent, a kernel thread, a
    zombie, or a thread that is not its thread group's leader (CRIU hits an internal BUG there)."""
    evidence: dict[str, object] = {"pid": pid}
    if pid <= 0:
        raise SnapguardError(Reason.PROCESS_NOT_FOUND, f"{pid} is not a process id", evidence=evidence)
    fields = _stat_fields(pid, proc)
    status = _status(pid, proc)
    if fields is None or status is None:
        raise SnapguardError(Reason.PROCESS_NOT_FOUND, f"process {pid} does not exist", evidence=evidence)
    comm = status.get("Name", "")
    evidence["comm"] = comm
    try:
        flags = int(fields[6])  # field 9 of stat: the task's PF_* flags
    except (IndexError, ValueError):
        flags = 0
    if flags & PF_KTHREAD or status.get("Kthread") == "1":
        raise SnapguardError(Reason.KERNEL_THREAD, f"pid {pid} ({comm}) is a kernel thread", evidence=evidence)
    if fields[0] in ("Z", "X"):
        raise SnapguardError(Reason.ZOMBIE_PROCESS, f"pid {pid} ({comm}) has exited (state {fields[0]})",
                             evidence=evidence)
    tgid = status.get("Tgid", str(pid))
    if tgid != str(pid):
        raise SnapguardError(Reason.NOT_THREAD_GROUP_LEADER,
                             f"{pid} is a thread of process {tgid} ({comm}), not a process", 
                             evidence={**evidence, "tgid": int(tgid) if tgid.isdigit() else tgid})


def _other_namespace(pid: int, kind: str, proc: str | None) -> bool:
    """Whether pid's namespace of `kind` (/proc/PID/ns/<kind>) is not this process's; True when
    that cannot be told."""
    root = _root(proc)
    try:
        return os.readlink(f"{root}/{pid}/ns/{kind}") != os.readlink(f"{root}/self/ns/{kind}")
    except OSError:
        return True


def own_netns(pid: int, proc: str | None = None) -> bool:
    """Whether pid lives in another network namespace than this process (CRIU then locks it; when
    it cannot be told, the lock tools are checked as if it did)."""
    return _other_namespace(pid, "net", proc)


def own_mntns(pid: int, proc: str | None = None) -> bool:
    """Whether pid lives in another mount namespace than this process (a container's; as if it
    did when that cannot be told)."""
    return _other_namespace(pid, "mnt", proc)


def _children(pid: int, proc: str) -> list[int]:
    kids: list[int] = []
    tids: list[str] = _vanishing(lambda: os.listdir(f"{proc}/{pid}/task"), [])
    for tid in tids:
        text = _vanishing(lambda: _read(f"{proc}/{pid}/task/{tid}/children"), "")
        kids.extend(int(c) for c in text.split() if c.isdigit())
    return kids


def process_tree(root_pid: int, proc: str | None = None) -> list[int]:
    """root_pid and all its descendants, root first; the root checked with `check_target`."""
    root = _root(proc)
    check_target(root_pid, root)
    seen, order, todo = set(), [], [root_pid]
    while todo:
        pid = todo.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        order.append(pid)
        todo.extend(_children(pid, root))
    return order


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


def _int(text: str, default: int = 0) -> int:
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return default


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


def proc_text(pid: int, name: str, proc: str | None = None) -> str:
    """/proc/PID/<name> as text; "" when the process or the file is gone or unreadable."""
    return _vanishing(lambda: _read(f"{_root(proc)}/{pid}/{name}"), "")


def cgroup_memory_headroom(pid: int, proc: str | None = None) -> int | None:
    """Bytes the pid's cgroup (v2) may still charge, or None when it has no limit."""
    text = proc_text(pid, "cgroup", proc)
    path = next((line.split(":", 2)[2] for line in text.splitlines() if line.startswith("0::")), None)
    if path is None:
        return None
    base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
    limit = _vanishing(lambda: _read(os.path.join(base, "memory.max")).strip(), "max")
    if limit == "max" or not limit.isdigit():
        return None
    current = _int(_vanishing(lambda: _read(os.path.join(base, "memory.current")), "0"))
    return int(limit) - current


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


def pid_map(root_pid: int, proc: str | None = None) -> dict[int, int]:
    """{pid as the tree sees it: host pid} for the tree under root_pid: how a restored container's
    processes, which keep their pids inside their own namespace, are found from the host."""
    return {nspid(p, proc): p for p in process_tree(root_pid, proc)}
