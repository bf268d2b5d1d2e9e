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

Asked with `spill` (a trainer whose status offers it, with a spill directory the executor reaches:
`spill_dirs`), a trainer moves its tensors' bytes into a file of its own on a tmpfs instead of its
memory and hands the file's descriptor over with the take's answer (SCM_RIGHTS), holding no
reference to it while it is dumped: the executor writes that file into the image itself (`Spill`),
and passes it back with the release, to reload from. A restore passes the image's copy instead.
A container's trainer spills only into a directory that is a bind mount of the host's (runc gives
CRIU the spec's bind mounts as external ones, so their files are not dumped); its own /dev/shm is
dumped with the container, spill and all.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from typing import Any

from .. import files, names, procfs, wire
from ..reasons import Finding, Reason, Severity, SnapguardError

__all__ = ["Spill", "hold", "release_all", "in_tmpfs_dir", "open_dir", "remove_spill_name", "socket_for", "spill_dirs",
           "stray_under", "tmpfs_dir", "trainers"]


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


def _ask(path: str, line: str, timeout: float, send: int | None = None) -> dict[str, Any]:
    reply, fds = _ask_fds(path, line, timeout, send)
    for fd in fds:
        os.close(fd)
    return reply


def _ask_fds(path: str, line: str, timeout: float, send: int | None = None) -> tuple[dict[str, Any], list[int]]:
    """The reply to one request and the descriptors that came with it (the caller closes them);
    `send`: a descriptor to pass with the request."""
    # Through a descriptor of the directory: a path under /proc/PID/root can pass the length limit
    # of socket addresses, and the directory cannot be swapped for a symlink after the check.
    dir_fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}")
            return _exchange(s, line, send)
    finally:
        os.close(dir_fd)


_MAX_REPLY = 1 << 20  # a take point's answer is a few KB: more is not read into the executor


def _exchange(s: socket.socket, line: str, send: int | None = None) -> tuple[dict[str, Any], list[int]]:
    deadline = time.monotonic() + (s.gettimeout() or 30.0)  # for the whole answer, not each piece
    data = line.encode()
    sent = socket.send_fds(s, [data], [send]) if send is not None else 0
    s.sendall(data[sent:])
    fds: list[int] = []
    try:
        # the descriptors come with the reply's first bytes
        chunk, fds = wire.recv_fds(s, 65536, 4)
        reply = bytearray(chunk)
        # Wait for the workload to close its end: a connection still open when CRIU freezes the
        # workload is an external socket that fails the dump.
        while chunk:
            if len(reply) > _MAX_REPLY or time.monotonic() > deadline:
                raise ValueError("the take point's answer is too long, or does not end")
            s.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = s.recv(65536)
            reply += chunk
        answer = json.loads(bytes(reply).split(b"\n", 1)[0])
        if not isinstance(answer, dict):
            raise ValueError(f"the take point's answer is not an object: {str(answer)[:80]}")
        return answer, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _count(value: Any) -> int:
    """An answer's count as it is, or -1 when it is none (a bool, a float, text)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


class Spill:
    """A held trainer's moved bytes in a file of its own, handed over with the take's answer: the
    executor copies it into the image, passes it back with the release, and, when the trainer is
    gone with a stop snapshot, removes its name. `fd` is the executor's own descriptor of it."""

    def __init__(self, pid: int, fd: int, path: str, size: int) -> None:
        self.pid, self.fd, self.path, self.size = pid, fd, path, size

    @classmethod
    def received(cls, pid: int, figures: dict[str, Any], fds: list[int], asked: bool = True,
                 where: tuple[str, str] | None = None) -> Spill | None:
        """The spill a take's answer reports, checked against the descriptor that came with it;
        None when it reports none. `where`: (the trainer's spill directory as it names it, the
        same directory's path here), from `spill_dirs`; the trainer's own path when None. The
        spill's path here must name the descriptor's file. Raises ValueError (the descriptors
        closed) when the two do not agree, or when a spill comes that was not `asked` for: the
        bytes the trainer moved are then in no file the executor may take."""
        try:
            offload = figures.get("offload") if isinstance(figures, dict) else None
            spill = offload.get("spill") if isinstance(offload, dict) else None
            if spill is None and not fds:
                return None
            if not asked:
                raise ValueError("a spill came that was not asked for")
            if not isinstance(spill, dict) or len(fds) != 1:
                raise ValueError(f"the answer reports {str(spill)[:200]} with {len(fds)} descriptor(s)")
            assert isinstance(offload, dict)
            path = spill.get("path")
            named = names.TAKE_SPILL_SOURCE.fullmatch(os.path.basename(path)) if isinstance(path, str) else None
            size, moved, storages = (_count(spill.get("bytes")), _count(offload.get("bytes")),
                                     _count(offload.get("storages")))
            if isinstance(path, str) and where is not None:
                there, here = where
                path = os.path.join(here, os.path.basename(path)) if os.path.dirname(path) == there else None
            if not isinstance(path, str) or not in_tmpfs_dir(path) or \
                    named is None or named.group(1) != str(pid) or \
                    not 0 < moved <= size <= moved + storages * 4096:  # each storage starts on a page
                raise ValueError(f"the answer's spill {str(spill)[:200]} is not one the take point makes"
                                 + (f" in {where[0]}" if where is not None else ""))
            st = os.fstat(fds[0])
            if not stat.S_ISREG(st.st_mode) or st.st_size != size or st.st_blocks * 512 < moved:
                raise ValueError(f"the descriptor is no regular file of {size} bytes holding them")
            if files.fs_type(fds[0]) != files.TMPFS_MAGIC:  # memory: its reads cannot hang (a FUSE file's could)
                raise ValueError("the descriptor's file is not on a tmpfs")
            if not remove_spill_name(path, st.st_dev, st.st_ino, st.st_uid, dry_run=True):
                # what the executor later removes by this name, and journals, must be this file
                raise ValueError(f"{path} does not name the descriptor's file")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(pid, fds[0], path, size)

    def remove_source(self, uid: int | None) -> bool:
        """Remove the trainer's name of the file (its trainer is gone), when that name still is
        this file, owned by `uid` (the trainer's); whether it was removed (`remove_spill_name`)."""
        if self.fd < 0:
            return False
        mine = os.fstat(self.fd)
        return remove_spill_name(self.path, mine.st_dev, mine.st_ino, uid)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# file systems whose lookups can wait on a process or the network (a FUSE daemon, a server, an
# automounter): a trainer's path through one could hold root's lookup for ever
_MAY_HANG = ("fuse", "autofs", "nfs", "cifs", "smb", "9p", "ceph", "glusterfs", "lustre", "gpfs", "afs", "davfs",
             "sshfs", "virtiofs")


def tmpfs_dir(directory: str) -> bool:
    """Whether `directory` (absolute and canonical) is on a tmpfs reached through no file system
    whose lookups may wait on something outside the kernel (`_MAY_HANG`): told from mountinfo
    alone, before root looks anything up along it."""
    if not directory.startswith("/") or os.path.normpath(directory) != directory:
        return False
    chain = procfs.mounts_on_path(directory)
    if not chain:
        return False
    return chain[-1]["fstype"] == "tmpfs" and not any(str(m["fstype"]).startswith(_MAY_HANG) for m in chain)


def in_tmpfs_dir(path: str) -> bool:
    """Whether `path` (absolute and canonical, as a trainer reports its spill) is a name in a
    `tmpfs_dir`: a path a trainer chose, looked up by root only there."""
    return path.startswith("/") and os.path.normpath(path) == path and tmpfs_dir(os.path.dirname(path))


def spill_dirs(found: dict[int, dict[str, Any]], containers: bool,
               proc: str | None = None) -> dict[int, tuple[str, str] | None]:
    """{pid: (its spill directory as it names it, that directory's path here)} of the trainers
    (as `trainers` found them) whose spill the executor may take: their status offers one, in a
    directory that is a tmpfs here, reached without following a link. A trainer in this mount
    namespace names its directory as the executor does (None: a hook older than `spill_dir`, whose
    answer's own path is checked instead). One in another (`containers`: a runc container's)
    spills only into a directory that is itself the mount point of a bind of a host directory
    (`procfs.mount_here`; runc hands CRIU the spec's binds as external mounts, so the files in it
    are not dumped), and only where the directory the trainer sees (looked up through its root,
    without following a link, past no mount whose lookups may hang) is the very one found here. A
    trainer in another mount namespace of a bare snapshot does not spill (CRIU would dump what its
    mounts hold)."""
    out: dict[int, tuple[str, str] | None] = {}
    for pid, st in found.items():
        there = st.get("spill_dir")
        if st.get("spill") is not True:
            continue
        own = not procfs.own_mntns(pid, proc)
        if there is None and own:
            out[pid] = None
            continue
        if not isinstance(there, str) or not there.startswith("/") or os.path.normpath(there) != there:
            continue
        here = there if own else procfs.mount_here(pid, there, proc) if containers else None
        # judged from mountinfo before root looks anything up along it
        if here is None or not tmpfs_dir(here) or (here_id := _dir_id(here)) is None:
            continue
        if not own:
            chain = procfs.mounts_on_path(there, proc, pid=pid)
            if not chain or any(str(m["fstype"]).startswith(_MAY_HANG) for m in chain) or \
                    _dir_id(there, f"{proc or procfs.procfs_path()}/{pid}/root") != here_id:
                continue  # not the directory it sees: something over it, or a source gone
        out[pid] = (there, here)
    return out


def open_dir(directory: str, root: str = "/") -> int | None:
    """An O_PATH descriptor of `directory` (absolute) looked up from `root` one component at a time,
    following no link on the way (not even one a process swaps in meanwhile); None when that
    cannot be done. The caller closes it. `root` is itself opened following links: "/" or a
    process's /proc/PID/root."""
    try:
        dir_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for part in [p for p in directory.split("/") if p]:
            next_fd = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
    except OSError:
        os.close(dir_fd)
        return None
    return dir_fd


def _dir_id(directory: str, root: str = "/") -> tuple[int, int] | None:
    fd = open_dir(directory, root)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def remove_spill_name(path: str, dev: int, ino: int, uid: int | None, *, dry_run: bool = False) -> bool:
    """Remove the name `path` of a spill whose trainer is gone, when it still names that file
    (`dev`, `ino`), a regular one owned by `uid` (the trainer's): never any other file the path
    may name by now. Only a name in a tmpfs directory (`in_tmpfs_dir`) is looked up at all. The
    directories on the way are opened one by one without following a link (the trainer could
    swap one for a link elsewhere between a check and the unlink); the name is then checked and
    removed through that directory. Whether it was removed (`dry_run`: whether the name still is
    that file, left as it is)."""
    if uid is None or not in_tmpfs_dir(path):
        return False
    dir_fd = open_dir(os.path.dirname(path))
    if dir_fd is None:
        return False
    try:
        name = os.path.basename(path)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino) or st.st_uid != uid:
            return False
        if not dry_run:
            os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(dir_fd)


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


def _take(path: str, pid: int, request: str, wait_s: float, spill: bool, where: tuple[str, str] | None,
          spills: dict[int, Spill]) -> dict[str, Any]:
    """One take's answer; its spill, when it made one, into `spills`. An answer whose spill does
    not come with its file, or that is not the answer of a take point, is a take refused
    (`refused`): the trainer is released (it reloads from its own name) and the snapshot must not
    go on, since the trainer is not held."""
    try:
        reply, fds = _ask_fds(path, f"{request} {wait_s}{' spill' if spill else ''}\n", wait_s + 5)
    except (OSError, ValueError) as e:
        return {"ok": False, "error": str(e)}
    try:
        # named by the pid the trainer sees: its own pid namespace's
        got = Spill.received(procfs.nspid(pid), reply, fds, asked=spill,
                             where=where) if reply.get("ok") is True else None
        if got is None:
            for fd in fds:
                os.close(fd)
    except (ValueError, OSError, TypeError, AttributeError) as e:  # received closed the descriptors
        _ask_quietly(path, "release\n", 10.0)
        return {"ok": False, "refused": True, "error": f"its answer cannot be taken: {e}"}
    if got is not None:
        got.pid = pid
        spills[pid] = got
    return reply


def _ask_quietly(path: str, line: str, timeout: float) -> None:
    try:
        _ask(path, line, timeout)
    except (OSError, ValueError):
        pass  # gone, or it goes on by itself after its hold limit


def _hold_one(path: str, pid: int, wait_s: float, spill: bool, where: tuple[str, str] | None,
              spills: dict[int, Spill]) -> tuple[dict[str, Any] | None, Finding | None]:
    reply = _take(path, pid, "take", wait_s, spill, where, spills)
    if reply.get("refused"):
        raise SnapguardError(Reason.PREFLIGHT_FAILED, f"pid {pid}'s take point: {reply.get('error')}; it was "
                             "released, nothing was frozen", evidence={"pid": pid})
    if reply.get("ok"):
        return reply, None
    if spill:
        _spill_settled(path, pid, wait_s)
    return None, Finding(Reason.TAKE_POINT_TIMEOUT,
                         f"pid {pid} did not reach a step boundary within {wait_s:g} s ({reply.get('error')})",
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
            busy = _ask(path, "status\n", 5.0).get("spill_busy") is True
        except (OSError, ValueError):
            return
        if not busy:
            return
        if time.monotonic() >= deadline:
            _ask_quietly(path, "release\n", 10.0)  # in case it was held after all (a release repeats safely)
            raise SnapguardError(Reason.PREFLIGHT_FAILED,
                                 f"pid {pid} reached its take point as the wait ran out and is still moving its "
                                 f"optimizer's bytes through a file of its own {wait_s:g} s later: an image now "
                                 "would need that file; nothing was frozen, the trainer goes on",
                                 evidence={"pid": pid})
        time.sleep(0.05)


def _hold_together(found: dict[int, dict[str, Any]], wait_s: float, spill: dict[int, tuple[str, str] | None],
                   spills: dict[int, Spill]) -> dict[int, dict[str, Any]]:
    """Every rank to the end of one common step: two past the furthest rank's, so a rank that
    finishes a step while the request is on its way still stops there, and none is left inside
    a collective waiting for a held peer. Raises COORDINATION_FAILED (with the held released)."""
    target = max(int(st["step"]) for st in found.values()) + 2
    replies: dict[int, dict[str, Any]] = {}

    def ask(pid: int) -> None:
        try:
            replies[pid] = _take(found[pid]["socket"], pid, f"take-at {target}", wait_s, pid in spill, spill.get(pid),
                                 spills)
        except Exception as e:  # whatever it was, this rank is not held
            replies[pid] = {"ok": False, "error": f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=ask, args=(pid,)) for pid in found]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = {pid: r for pid, r in replies.items() if r.get("ok")}
    failed = {pid: r.get("error") for pid, r in replies.items() if not r.get("ok")}
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
         spill: dict[int, tuple[str, str] | None] | None = None) -> tuple[dict[int, dict[str, Any]], list[Finding],
                                                                         float, dict[int, Spill]]:
    """Hold the trainers (as `trainers` found them): one alone, several at one common step.
    Several CUDA processes must all be held together, or the snapshot is refused before anything
    is frozen. Then the processes below them must hold no GPU handle outside a CUDA context
    (the hold shut torch.compile's pool down), or the trainers are released and the snapshot is
    refused (STRAY_GPU_DEVICE_HANDLE). `spill` (`spill_dirs`'s): those trainers move their bytes
    into files handed over here. Returns (figures of those held, warnings, seconds spent,
    {pid: Spill}); the caller closes the spills (after `release_all` with them)."""
    t0 = time.monotonic()
    spills: dict[int, Spill] = {}
    spilling = {pid: where for pid, where in (spill or {}).items() if pid in found}
    try:
        held, warnings = _hold(found, cuda_pids, wait_s, spilling, spills)
    except BaseException:
        for s in spills.values():
            s.close()
        raise
    return held, warnings, time.monotonic() - t0, spills


def _hold(found: dict[int, dict[str, Any]], cuda_pids: list[int], wait_s: float,
          spilling: dict[int, tuple[str, str] | None], spills: dict[int, Spill]) -> tuple[dict[int, dict[str, Any]],
                                                                                          list[Finding]]:
    unhooked = sorted(set(cuda_pids) - set(found))
    if len(cuda_pids) > 1 and unhooked:
        raise SnapguardError(Reason.COORDINATION_FAILED,
                             f"CUDA processes {unhooked} run no take-point hook: ranks cannot be held at a "
                             "common step", evidence={"cuda_pids": cuda_pids})
    if len(found) > 1:
        held = _hold_together(found, wait_s, spilling, spills)
        warnings: list[Finding] = []
    else:
        held, warnings = {}, []
        for pid, st in found.items():
            figures, warning = _hold_one(st["socket"], pid, wait_s, pid in spilling, spilling.get(pid), spills)
            if figures:
                held[pid] = figures
            if warning:
                warnings.append(warning)
    # a compile pool the hold shut down: its processes were reaped as it returned; a moment more
    # for any still on its way out, then whatever still holds GPU handles refuses the snapshot
    pool = [p for f in held.values() for p in ((f.get("compile_pool") or {}).get("pids") or [])]
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
                timeout: float = 10.0, attempts: int = 3) -> dict[int, str]:
    """Let the trainers go on; each one's spill (when it has one) passed back to reload from. A
    release that does not go through is asked again (a release is idempotent: the same file, and
    a hold already over keeps none). {pid: why} of those it never reached (gone, or they go on by
    themselves after their hold limit, reloading from their own file when it is there)."""
    failed: dict[int, str] = {}
    for pid, st in found.items():
        spill = (spills or {}).get(pid)
        for attempt in range(attempts):
            try:
                reply = _ask(st["socket"], "release\n", timeout,
                             spill.fd if spill is not None and spill.fd >= 0 else None)
                if reply.get("ok") is True:
                    failed.pop(pid, None)
                    break
                failed[pid] = f"answered {str(reply)[:200]}"
            except (OSError, ValueError) as e:
                failed[pid] = f"{type(e).__name__}: {e}"[:300]
            if attempt + 1 < attempts:
                time.sleep(0.2)
    return failed
