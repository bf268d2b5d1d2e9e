"""The executor side of the take point: find the workloads that run the hook, hold them at a step
boundary (every rank of a job at one common step), then release them.

A hooked process listens on <SNAPGUARD_TAKE_DIR>/<its pid>.sock in its own mount and pid
namespaces; the executor reaches it through /proc/<host pid>/root. Its status says whether it
resolves the GPU-handle blockers (`resolve`, `gpu_handles_dropped_in_children`, `compile_pool`:
state, pids, `shutdown_at_take`); the preflight lets a compile pool that the hold shuts down
through, and after the hold every process under the held trainers is read again: one that still
holds GPU handles without a CUDA context refuses the snapshot, the trainers released, before
anything is frozen. A container's filesystem is
not trusted: every directory on the way must be a real directory and the socket a socket, so a
symlink cannot send the executor (root) to a socket of the host.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from typing import Any

from .. import procfs
from ..reasons import Finding, Reason, Severity, SnapguardError

__all__ = ["hold", "release_all", "socket_for", "stray_under", "trainers"]


def socket_for(pid: int, proc: str | None = None) -> str | None:
    """The host path of pid's take-point socket, or None when it runs no hook."""
    proc = proc or procfs.procfs_path()
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        take_dir = env.get(b"SNAPGUARD_TAKE_DIR", b"").decode()
        if not take_dir.startswith("/"):
            return None
        path = f"{proc}/{pid}/root"
        for part in [p for p in take_dir.split("/") if p]:
            path = f"{path}/{part}"
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return None
        path = f"{path}/{procfs.nspid(pid, proc)}.sock"
        return path if stat.S_ISSOCK(os.lstat(path).st_mode) else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _ask(path: str, line: str, timeout: float) -> dict[str, Any]:
    # Through a descriptor of the directory: a path under /proc/PID/root can pass the length limit
    # of socket addresses, and the directory cannot be swapped for a symlink after the check.
    dir_fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}")
            return _exchange(s, line)
    finally:
        os.close(dir_fd)


def _exchange(s: socket.socket, line: str) -> dict[str, Any]:
    s.sendall(line.encode())
    f = s.makefile("rb")
    reply = f.readline()
    # Wait for the workload to close its end: a connection still open when CRIU freezes the
    # workload is an external socket that fails the dump.
    while f.read(4096):
        pass
    return json.loads(reply)


def trainers(pids: list[int], proc: str | None = None) -> dict[int, dict[str, Any]]:
    """{pid: status} of the pids whose hook has its step hook registered (they train); a launcher
    that runs the hook but no optimizer is not one to wait for, nor is a process of a trainer's
    torch.compile pool (it imports torch's optimizers, with the hook it inherited, but never steps)."""
    found = {}
    for pid in pids:
        path = socket_for(pid, proc)
        if path is None:
            continue
        try:
            st = _ask(path, "status\n", 5.0)
        except (OSError, ValueError):
            continue
        if st.get("trainer"):
            found[pid] = {**st, "socket": path}
    pools = {p for st in found.values() for p in (st.get("compile_pool") or {}).get("pids", [])}
    return {pid: st for pid, st in found.items() if pid not in pools}


def _hold_one(path: str, pid: int, wait_s: float) -> tuple[dict[str, Any] | None, Finding | None]:
    try:
        reply = _ask(path, f"take {wait_s}\n", wait_s + 5)
    except (OSError, ValueError) as e:
        reply = {"ok": False, "error": str(e)}
    if reply.get("ok"):
        return reply, None
    return None, Finding(Reason.TAKE_POINT_TIMEOUT,
                         f"pid {pid} did not reach a step boundary within {wait_s:g} s ({reply.get('error')})",
                         Severity.WARNING, {"pid": pid})


def _hold_together(found: dict[int, dict[str, Any]], wait_s: float) -> dict[int, dict[str, Any]]:
    """Every rank to the end of one common step: two past the furthest rank's, so a rank that
    finishes a step while the request is on its way still stops there, and none is left inside
    a collective waiting for a held peer. Raises COORDINATION_FAILED (with the held released)."""
    target = max(int(st["step"]) for st in found.values()) + 2
    replies: dict[int, dict[str, Any]] = {}

    def ask(pid: int) -> None:
        try:
            replies[pid] = _ask(found[pid]["socket"], f"take-at {target} {wait_s}\n", wait_s + 5)
        except (OSError, ValueError) as e:
            replies[pid] = {"ok": False, "error": str(e)}

    threads = [threading.Thread(target=ask, args=(pid,)) for pid in found]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = {pid: r for pid, r in replies.items() if r.get("ok")}
    failed = {pid: r.get("error") for pid, r in replies.items() if not r.get("ok")}
    if failed:
        release_all({pid: found[pid] for pid in held})
        raise SnapguardError(Reason.COORDINATION_FAILED, f"ranks not held at step {target}: {failed}",
                             evidence={"held": sorted(held), "ranks": sorted(found), "step": target})
    return held


def stray_under(trainer_pids: list[int], cuda_pids: list[int], proc: str | None = None) -> list[dict[str, Any]]:
    """The processes below the trainers that hold /dev/nvidia* without a CUDA context, read now."""
    cuda, seen, out = set(cuda_pids), set(trainer_pids), []
    for trainer in trainer_pids:
        try:
            tree = procfs.process_tree(trainer, proc)
        except SnapguardError:
            continue  # gone: nothing of it is dumped
        for pid in tree[1:]:
            if pid in cuda or pid in seen:
                continue
            seen.add(pid)
            info = procfs.read_proc(pid, proc)
            handles = info.nvidia_handles() if info else []
            if info and handles:
                out.append({"pid": pid, "comm": info.comm, "ppid": info.ppid, "paths": handles, "trainer": trainer})
    return out


def _refuse_stray(stray: list[dict[str, Any]], held: dict[int, dict[str, Any]],
                  found: dict[int, dict[str, Any]]) -> None:
    release_all({pid: found[pid] for pid in held if pid in found})
    first = stray[0]
    raise SnapguardError(Reason.STRAY_GPU_DEVICE_HANDLE,
                         f"after the take point, pid(s) {', '.join(str(s['pid']) for s in stray)} under trainer "
                         f"{first['trainer']} still hold {', '.join(first['paths'][:3])} without a CUDA context "
                         "(the compile pool did not shut down, or a process opened them itself); nothing was "
                         "frozen, the trainers go on", evidence={"pids": [s["pid"] for s in stray], "processes": stray})


def hold(found: dict[int, dict[str, Any]], cuda_pids: list[int],
         wait_s: float) -> tuple[dict[int, dict[str, Any]], list[Finding], float]:
    """Hold the trainers (as `trainers` found them): one alone, several at one common step.
    Several CUDA processes must all be held together, or the snapshot is refused before anything
    is frozen. Then the processes below them must hold no GPU handle outside a CUDA context
    (the hold shut torch.compile's pool down), or the trainers are released and the snapshot is
    refused (STRAY_GPU_DEVICE_HANDLE). Returns (figures of those held, warnings, seconds spent)."""
    t0 = time.monotonic()
    unhooked = sorted(set(cuda_pids) - set(found))
    if len(cuda_pids) > 1 and unhooked:
        raise SnapguardError(Reason.COORDINATION_FAILED,
                             f"CUDA processes {unhooked} run no take-point hook: ranks cannot be held at a "
                             "common step", evidence={"cuda_pids": cuda_pids})
    if len(found) > 1:
        held = _hold_together(found, wait_s)
        warnings: list[Finding] = []
    else:
        held, warnings = {}, []
        for pid, st in found.items():
            figures, warning = _hold_one(st["socket"], pid, wait_s)
            if figures:
                held[pid] = figures
            if warning:
                warnings.append(warning)
    # a compile pool the hold shut down: its processes were reaped as it returned; a moment more
    # for any still on its way out, then whatever still holds GPU handles refuses the snapshot
    pool = [p for f in held.values() for p in ((f.get("compile_pool") or {}).get("pids") or [])]
    deadline = time.monotonic() + wait_s
    while pool and time.monotonic() < deadline:
        pool = [p for p in pool if procfs.process_state(p) not in ("gone", "Z", "X")]
        if pool:
            time.sleep(0.02)
    stray = stray_under(sorted(found), cuda_pids) if found else []
    if stray:
        _refuse_stray(stray, held, found)
    return held, warnings, time.monotonic() - t0


def release_all(found: dict[int, dict[str, Any]], timeout: float = 10.0) -> None:
    for st in found.values():
        try:
            _ask(st["socket"], "release\n", timeout)
        except (OSError, ValueError):
            pass  # gone, or it goes on by itself after its hold limit
