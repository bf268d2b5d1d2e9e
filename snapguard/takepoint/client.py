"""The executor's side of the take point: find the workloads that run the hook (`trainers`), hold
them at a step boundary, every rank of a job at one common step (`hold`, a `TakeResult`), then
release them (`release_all`).

A hooked process listens on <TAKE_DIR_ENV>/<its pid>.sock in its own mount and pid namespaces;
the executor reaches it through /proc/<host pid>/root. Its status says whether it resolves the
GPU-handle blockers (RESOLVE, GPU_HANDLES_DROPPED, COMPILE_POOL: its state, pids,
POOL_SHUTDOWN_AT_TAKE); the preflight lets a compile pool that the hold shuts down through, and
after the hold every process under the held trainers is read again: one that still holds GPU
handles without a CUDA context refuses the snapshot, the trainers released, before anything is
frozen. A container's filesystem is not trusted: every directory on the way must be a real
directory, opened one by one without following a link, and the socket a socket of the
trainer's user, answered by the trainer itself (SO_PEERCRED) before anything is sent: a link
swapped in cannot send the executor (root) to a socket of the host.

Asked with `spill` (a trainer whose status offers it, with a spill directory the executor reaches:
`spill.spill_dirs`), a trainer moves its tensors' bytes into a file of its own on a tmpfs instead
of its memory and hands the file's descriptor over with the take's answer (SCM_RIGHTS), holding no
reference to it while it is dumped: the executor writes that file into the image itself
(`spill.Spill`), and passes it back with the release, to reload from. A restore passes the
image's copy instead. A container's trainer spills only into a directory that is a bind mount of
the host's (runc gives CRIU the spec's bind mounts as external ones, so their files are not
dumped); its own /dev/shm is dumped with the container, spill and all.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import procfs
from ..reasons import Finding, Reason, Severity, SnapguardError
from .protocol import (COMPILE_POOL, ERROR, OK, POOL_PIDS, SPILL_BUSY, STEP, TAKE_DIR_ENV, TRAINER, recv_fds,
                       release_request, status_request, take_request)
from .spill import Spill

__all__ = ["SOCKET", "PeerRefused", "TakeResult", "hold", "release_all", "socket_for", "stray_under", "trainers"]

SOCKET = "socket"  # the key `trainers` adds to each status: the host path of its socket
_REFUSED = "refused"  # the key `_take` adds to an answer it cannot take


@dataclass(frozen=True)
class TakeResult:
    """What `hold` did: {pid: the take's figures} of the trainers held, the warnings (a trainer
    that reached no step boundary in time), the seconds it took, and {pid: Spill} of the files
    handed over (the caller closes them, after `release_all` with them)."""

    held: dict[int, dict[str, Any]]
    warnings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    spills: dict[int, Spill] = field(default_factory=dict)


def socket_for(pid: int, proc: str | None = None) -> str | None:
    """The host path of pid's take-point socket, or None when it runs no hook."""
    proc = proc or procfs.procfs_path()
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        take_dir = env.get(TAKE_DIR_ENV.encode(), b"").decode()
        if not take_dir.startswith("/"):
            return None
        path = f"{proc}/{pid}/root"
        for part in [p for p in take_dir.split("/") if p]:
            if part in (".", ".."):  # ".." at the container's root is the host's directory above it
                return None
            path = f"{path}/{part}"
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return None
        path = f"{path}/{procfs.nspid(pid, proc)}.sock"
        return path if stat.S_ISSOCK(os.lstat(path).st_mode) else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


class PeerRefused(ValueError):
    """The socket answered is not the trainer's: a link where its socket was, or another process."""


_O_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _open_socket_dir(path: str, pid: int) -> int:
    """The directory holding `path`, opened O_PATH. Under /proc/PID/root (the trainer's root, a
    link procfs resolves) each directory is opened through the one before it without following a
    link, so nothing checked before can be swapped for a link on the way now."""
    parent = os.path.dirname(path)
    root = f"{procfs.procfs_path()}/{pid}/root"
    if parent != root and not parent.startswith(root + "/"):
        return os.open(parent, _O_PATH_DIR)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in parent[len(root):].split("/") if p]:
            if part in (".", ".."):
                raise PeerRefused(f"{path}: {part!r} on the way to a take point's socket")
            below = os.open(part, _O_PATH_DIR, dir_fd=fd)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def _connect(path: str, pid: int, timeout: float) -> socket.socket:
    """A connection to pid's take point at `path`, through a descriptor of its directory (a path
    under /proc/PID/root can pass the length limit of socket addresses, and no directory on the
    way can be swapped for a link after the check). The entry must be a socket (not a link) of
    the trainer's user; the kernel resolves that last name itself at connect, so the peer is
    then asked who it is (SO_PEERCRED: pid, as this pid namespace sees it, and uid) and must be
    the trainer, before anything is sent. PeerRefused otherwise."""
    uid = procfs.euid(pid)
    if uid is None:
        raise PeerRefused(f"pid {pid} is gone, or its user cannot be read")
    dir_fd = _open_socket_dir(path, pid)
    try:
        name = os.path.basename(path)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
            raise PeerRefused(f"{path} is not a socket of pid {pid}'s user {uid}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect(f"{procfs.self_fd(dir_fd)}/{name}")
            peer_pid, peer_uid, _ = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            if peer_pid != pid or peer_uid != uid:
                raise PeerRefused(f"{path} is answered by pid {peer_pid} uid {peer_uid}, not by the trainer "
                                  f"(pid {pid} uid {uid}): nothing was sent")
        except BaseException:
            s.close()
            raise
        return s
    finally:
        os.close(dir_fd)


def _ask(path: str, pid: int, line: str, timeout: float, send: int | None = None) -> dict[str, Any]:
    reply, fds = _ask_fds(path, pid, line, timeout, send)
    for fd in fds:
        os.close(fd)
    return reply


def _ask_fds(path: str, pid: int, line: str, timeout: float,
             send: int | None = None) -> tuple[dict[str, Any], list[int]]:
    """The reply of pid's take point at `path` to one request, and the descriptors that came with
    it (the caller closes them); `send`: a descriptor to pass with the request."""
    with _connect(path, pid, timeout) as s:
        return _exchange(s, line, send)


_MAX_REPLY = 1 << 20  # a take point's answer is a few KB: more is not read into the executor
_MAX_DEPTH = 32  # its deepest part (a compile pool's pids) is three levels down
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets: deleted


def _exchange(s: socket.socket, line: str, send: int | None = None) -> tuple[dict[str, Any], list[int]]:
    deadline = time.monotonic() + (s.gettimeout() or 30.0)  # for the whole answer, not each piece
    data = line.encode()
    sent = socket.send_fds(s, [data], [send]) if send is not None else 0
    s.sendall(data[sent:])
    fds: list[int] = []
    try:
        # the descriptors come with the reply's first bytes
        chunk, fds = recv_fds(s, 65536)
        reply = bytearray(chunk)
        # Wait for the workload to close its end: a connection still open when CRIU freezes the
        # workload is an external socket that fails the dump.
        while chunk:
            if len(reply) > _MAX_REPLY or time.monotonic() > deadline:
                raise ValueError("the take point's answer is too long, or does not end")
            s.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = s.recv(65536)
            reply += chunk
        if not reply.strip():
            raise ValueError("the take point closed the connection without an answer (its process exited, "
                             "or it no longer serves)")
        first = bytes(reply).split(b"\n", 1)[0]
        depth = 0
        for b in _STRING.sub(b'""', first).translate(None, _BRACKETS):  # outside strings, before parsing
            depth += 1 if b in b"[{" else -1
            if depth > _MAX_DEPTH:
                raise ValueError(f"the take point's answer nests deeper than {_MAX_DEPTH} levels")
        answer = json.loads(first)
        if not isinstance(answer, dict):
            raise ValueError(f"the take point's answer is not an object: {str(answer)[:80]}")
        return answer, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


_STATUS_WAIT_S = 5.0  # a hook answers its status from a thread of its own, at once


def trainers(pids: list[int], proc: str | None = None) -> dict[int, dict[str, Any]]:
    """{pid: status} of the pids whose hook has its step hook registered (they train); a launcher
    that runs the hook but no optimizer is not one to wait for, nor is a process of a trainer's
    torch.compile pool (it imports torch's optimizers, with the hook it inherited, but never steps).
    A process whose socket is there but does not answer (a hook that hangs, a socket answered by
    another process) is TAKE_POINT_UNREACHABLE: it may be a trainer mid-step, which no snapshot
    may catch so, and which nothing would wait for. One gone meanwhile is left out."""
    found, unreachable = {}, {}
    for pid in pids:
        path = socket_for(pid, proc)
        if path is None:
            continue
        try:
            st = _ask(path, pid, status_request(), _STATUS_WAIT_S)
        except (OSError, ValueError) as e:
            if procfs.alive(pid):
                timed_out = isinstance(e, TimeoutError)
                unreachable[pid] = (path, f"no answer in {_STATUS_WAIT_S:g} s" if timed_out else str(e) or repr(e))
            continue
        if st.get(TRAINER):
            found[pid] = {**st, SOCKET: path}
    if unreachable:
        raise SnapguardError(Reason.TAKE_POINT_UNREACHABLE,
                             f"pid(s) {sorted(unreachable)} have a take-point socket that does not answer: " +
                             "; ".join(f"pid {p}: {why}" for p, (_, why) in sorted(unreachable.items())) +
                             "; nothing was frozen",
                             evidence={"pids": sorted(unreachable),
                                       "sockets": {str(p): path for p, (path, _) in unreachable.items()}})
    pools = {p for st in found.values() for p in (st.get(COMPILE_POOL) or {}).get(POOL_PIDS, [])}
    return {pid: st for pid, st in found.items() if pid not in pools}


def _take(path: str, pid: int, at_step: int | None, wait_s: float, spill: bool, where: tuple[str, str] | None,
          spills: dict[int, Spill]) -> dict[str, Any]:
    """One take's answer; its spill, when it made one, into `spills`. An answer whose spill does
    not come with its file, or that is not the answer of a take point, is a take refused
    (`refused`): the trainer is released (it reloads from its own name) and the snapshot must not
    go on, since the trainer is not held."""
    try:
        reply, fds = _ask_fds(path, pid, take_request(wait_s, spill, at_step), wait_s + 5)
    except (OSError, ValueError) as e:
        return {OK: False, ERROR: str(e)}
    try:
        # named by the pid the trainer sees: its own pid namespace's
        got = Spill.received(procfs.nspid(pid), reply, fds, asked=spill,
                             where=where) if reply.get(OK) is True else None
        if got is None:
            for fd in fds:
                os.close(fd)
    except (ValueError, OSError, TypeError, AttributeError) as e:  # received closed the descriptors
        _ask_quietly(path, pid, release_request(), 10.0)
        return {OK: False, _REFUSED: True, ERROR: f"its answer cannot be taken: {e}"}
    if got is not None:
        got.pid = pid
        spills[pid] = got
    return reply


def _ask_quietly(path: str, pid: int, line: str, timeout: float) -> None:
    try:
        _ask(path, pid, line, timeout)
    except (OSError, ValueError):
        pass  # gone, or it goes on by itself after its hold limit


def _hold_one(path: str, pid: int, wait_s: float, spill: bool, where: tuple[str, str] | None,
              spills: dict[int, Spill]) -> tuple[dict[str, Any] | None, Finding | None]:
    reply = _take(path, pid, None, wait_s, spill, where, spills)
    if reply.get(_REFUSED):
        raise SnapguardError(Reason.PREFLIGHT_FAILED, f"pid {pid}'s take point: {reply.get(ERROR)}; it was "
                             "released, nothing was frozen", evidence={"pid": pid})
    if reply.get(OK):
        return reply, None
    if spill:
        _spill_settled(path, pid, wait_s)
    return None, Finding(Reason.TAKE_POINT_TIMEOUT,
                         f"pid {pid} did not reach a step boundary within {wait_s:g} s ({reply.get(ERROR)})",
                         Severity.WARNING, {"pid": pid})


def _spill_settled(path: str, pid: int, wait_s: float) -> None:
    """After a take asked to spill ran out of time: the trainer may have begun it all the same
    (it reached its step boundary just as the wait ran out). Until its reload ends it has the
    spill's file mapped or open, and an image then would need that file, outside the image: it
    could be restored only where the file still is. Wait up to `wait_s` more for the trainer's
    status to say it is done; refuse the snapshot, nothing frozen and the trainer released, when
    it does not. A trainer that does
    not answer its status is left to the snapshot as before (it cannot be told to be spilling)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            busy = _ask(path, pid, status_request(), 5.0).get(SPILL_BUSY) is True
        except (OSError, ValueError):
            return
        if not busy:
            return
        if time.monotonic() >= deadline:
            _ask_quietly(path, pid, release_request(), 10.0)  # in case it was held after all (a release repeats safely)
            raise SnapguardError(Reason.PREFLIGHT_FAILED,
                                 f"pid {pid} reached its take point as the wait ran out and is still moving its "
                                 f"optimizer's bytes through a file of its own {wait_s:g} s later: an image now "
                                 "would need that file; nothing was frozen, the trainer goes on",
                                 evidence={"pid": pid})
        time.sleep(0.05)


def _hold_together(found: dict[int, dict[str, Any]], wait_s: float, spill: dict[int, tuple[str, str] | None],
                   spills: dict[int, Spill], at_step: int | None = None) -> dict[int, dict[str, Any]]:
    """Every rank to the end of one common step: `at_step` (the one every node of a job was
    given), else two past the furthest rank's, so a rank that finishes a step while the request
    is on its way still stops there, and none is left inside a collective waiting for a held
    peer. Raises COORDINATION_FAILED (with the held released)."""
    target = at_step if at_step is not None else max(int(st[STEP]) for st in found.values()) + 2
    replies: dict[int, dict[str, Any]] = {}

    def ask(pid: int) -> None:
        try:
            replies[pid] = _take(found[pid][SOCKET], pid, target, wait_s, pid in spill, spill.get(pid),
                                 spills)
        except Exception as e:  # whatever it was, this rank is not held
            replies[pid] = {OK: False, ERROR: f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=ask, args=(pid,)) for pid in found]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = {pid: r for pid, r in replies.items() if r.get(OK)}
    failed = {pid: r.get(ERROR) for pid, r in replies.items() if not r.get(OK)}
    if failed:
        release_all({pid: found[pid] for pid in held}, spills)
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
                  found: dict[int, dict[str, Any]], spills: dict[int, Spill] | None = None) -> None:
    release_all({pid: found[pid] for pid in held if pid in found}, spills)
    first = stray[0]
    raise SnapguardError(Reason.STRAY_GPU_DEVICE_HANDLE,
                         f"after the take point, pid(s) {', '.join(str(s['pid']) for s in stray)} under trainer "
                         f"{first['trainer']} still hold {', '.join(first['paths'][:3])} without a CUDA context "
                         "(the compile pool did not shut down, or a process opened them itself); nothing was "
                         "frozen, the trainers go on", evidence={"pids": [s["pid"] for s in stray], "processes": stray})


def hold(found: dict[int, dict[str, Any]], cuda_pids: list[int], wait_s: float,
         spill: dict[int, tuple[str, str] | None] | None = None, at_step: int | None = None) -> TakeResult:
    """Hold the trainers (as `trainers` found them): one alone, several at one common step.
    Several CUDA processes must all be held together, or the snapshot is refused before anything
    is frozen. Then the processes below them must hold no GPU handle outside a CUDA context
    (the hold shut torch.compile's pool down), or the trainers are released and the snapshot is
    refused (STRAY_GPU_DEVICE_HANDLE). `spill` (`spill.spill_dirs`'s): those trainers move their bytes
    into files handed over here. The caller closes the result's spills (after `release_all`
    with them: `spill.close`)."""
    t0 = time.monotonic()
    spills: dict[int, Spill] = {}
    spilling = {pid: where for pid, where in (spill or {}).items() if pid in found}
    try:
        held, warnings = _hold(found, cuda_pids, wait_s, spilling, spills, at_step)
    except BaseException:
        for s in spills.values():
            s.close()
        raise
    return TakeResult(held, warnings, time.monotonic() - t0, spills)


def _hold(found: dict[int, dict[str, Any]], cuda_pids: list[int], wait_s: float,
          spilling: dict[int, tuple[str, str] | None], spills: dict[int, Spill],
          at_step: int | None = None) -> tuple[dict[int, dict[str, Any]], list[Finding]]:
    unhooked = sorted(set(cuda_pids) - set(found))
    if len(cuda_pids) > 1 and unhooked:
        raise SnapguardError(Reason.COORDINATION_FAILED,
                             f"CUDA processes {unhooked} run no take-point hook: ranks cannot be held at a "
                             "common step", evidence={"cuda_pids": cuda_pids})
    if len(found) > 1 or (found and at_step is not None):
        held = _hold_together(found, wait_s, spilling, spills, at_step)
        warnings: list[Finding] = []
    else:
        held, warnings = {}, []
        for pid, st in found.items():
            figures, warning = _hold_one(st[SOCKET], pid, wait_s, pid in spilling, spilling.get(pid), spills)
            if figures:
                held[pid] = figures
            if warning:
                warnings.append(warning)
    # a compile pool the hold shut down: its processes were reaped as it returned; a moment more
    # for any still on its way out, then whatever still holds GPU handles refuses the snapshot
    pool = [p for f in held.values() for p in ((f.get(COMPILE_POOL) or {}).get(POOL_PIDS) or [])]
    deadline = time.monotonic() + wait_s
    while pool and time.monotonic() < deadline:
        pool = [p for p in pool if procfs.alive(p)]
        if pool:
            time.sleep(0.02)
    stray = stray_under(sorted(found), cuda_pids) if found else []
    if stray:
        _refuse_stray(stray, held, found, spills)
    return held, warnings


def release_all(found: dict[int, dict[str, Any]], spills: dict[int, Spill] | None = None,
                timeout: float = 10.0, attempts: int = 3, rendezvous: str | None = None) -> dict[int, str]:
    """Let the trainers go on; each one's spill (when it has one) passed back to reload from. A
    release that does not go through is asked again (a release is idempotent: the same file, and
    a hold already over keeps none). {pid: why} of those it never reached (gone, or they go on by
    themselves after their hold limit, reloading from their own file when it is there).
    `rendezvous` (HOST:PORT): where their released process groups rebuild their store."""
    failed: dict[int, str] = {}
    for pid, st in found.items():
        spill = (spills or {}).get(pid)
        for attempt in range(attempts):
            try:
                reply = _ask(st[SOCKET], pid, release_request(rendezvous), timeout,
                             spill.fd if spill is not None and spill.fd >= 0 else None)
                if reply.get(OK) is True:
                    failed.pop(pid, None)
                    break
                failed[pid] = f"answered {str(reply)[:200]}"
            except (OSError, ValueError) as e:
                failed[pid] = f"{type(e).__name__}: {e}"[:300]
            if attempt + 1 < attempts:
                time.sleep(0.2)
    return failed
