"""Single processes and process trees: state, start time, ids, namespaces, children, and the
scans of every process on the node."""

from __future__ import annotations

import os
from collections.abc import Iterator

from ..reasons import Reason, SnapguardError
from ._root import read as _read, root as _root, vanishing as _vanishing

__all__ = ["alive", "cgroup_memory_headroom", "check_target", "cmdline", "euid", "exists", "nspid", "own_mntns",
           "own_netns", "pid_map", "pids", "proc_text", "process_state", "process_tree", "running_start_ticks",
           "self_fd", "start_ticks", "status_fields", "with_argument"]

PF_KTHREAD = 0x00200000  # include/linux/sched.h: the task is a kernel thread


def leading_int(text: str, default: int = 0) -> int:
    """The number a procfs value begins with ("123 kB"); `default` when none."""
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return default


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



def start_ticks(pid: int, proc: str | None = None) -> int | None:
    """When the process started, in clock ticks since boot (/proc/PID/stat's field 22): with the
    pid, a name for one process that a later process given the same pid does not share. None
    when it is gone."""
    fields = _stat_fields(pid, proc)
    return int(fields[19]) if fields and len(fields) > 19 and fields[19].isdigit() else None


def status_fields(pid: int, proc: str | None = None) -> dict[str, str] | None:
    """/proc/PID/status as {key: value}; None when it is gone."""
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
    fields = ((status_fields(pid, proc) or {}).get("Uid") or "").split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def nspid(pid: int, proc: str | None = None) -> int:
    """The pid as the process itself sees it (its innermost pid namespace); pid when unknown."""
    status = status_fields(pid, proc) or {}
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
    status = status_fields(pid, proc)
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
    current = leading_int(_vanishing(lambda: _read(os.path.join(base, "memory.current")), "0"))
    return int(limit) - current



def pid_map(root_pid: int, proc: str | None = None) -> dict[int, int]:
    """{pid as the tree sees it: host pid} for the tree under root_pid: how a restored container's
    processes, which keep their pids inside their own namespace, are found from the host."""
    return {nspid(p, proc): p for p in process_tree(root_pid, proc)}


def exists(pid: int, proc: str | None = None) -> bool:
    """Whether /proc/PID is there (a zombie's too)."""
    return os.path.exists(f"{_root(proc)}/{pid}")


def running_start_ticks(pid: int, proc: str | None = None) -> int | None:
    """`start_ticks` of a process that runs; None when it is gone or has exited (a zombie)."""
    fields = _stat_fields(pid, proc)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def pids(proc: str | None = None) -> Iterator[int]:
    """Every process id procfs lists now."""
    names: list[str] = _vanishing(lambda: os.listdir(_root(proc)), [])
    return (int(name) for name in names if name.isdigit())


def cmdline(pid: int, proc: str | None = None) -> list[bytes] | None:
    """The process's argv as bytes (its cmdline split at NULs); None when it is gone."""
    def argv() -> list[bytes]:
        with open(f"{_root(proc)}/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    return _vanishing(argv, None)


def with_argument(arg: str, proc: str | None = None) -> list[int]:
    """The processes, other than this one, that have `arg` as one of their arguments."""
    own, want = os.getpid(), arg.encode()
    return [pid for pid in pids(proc) if pid != own and want in (cmdline(pid, proc) or [])]


def self_fd(fd: int, proc: str | None = None) -> str:
    """The path of this process's descriptor `fd` under procfs (self/fd/FD)."""
    return f"{_root(proc)}/self/fd/{fd}"
