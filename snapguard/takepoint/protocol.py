"""What the two ends of the take point share, and nothing else ties them: the socket's path, the
request words, the reply's fields, the environment variables the trainer reads, and the spill's
names and file-system checks.

The workload side (snapguard.takepoint.workload, inside the user's trainer) and the executor side
(snapguard.takepoint.client and .spill, as root) both import this module. Standard library only:
it is loaded into every process a hooked trainer starts.

One request per connection, a line of words; one JSON object per reply, a line:
  status                    -> STATUS fields: the step, whether it trains, can spill, resolves
  take <seconds> [spill]    -> hold at the end of the next step; the hold's figures
  take-at <S> <seconds> [spill]
                            -> hold at the end of step S (a step every rank of a job reaches)
  release [rendezvous H:P]  -> go on (a descriptor sent with it: the spill's file to reload from);
                               the process groups released at the hold are rebuilt, their store
                               at H:P when named (a restored job's new rank-0 address), else at
                               the address the job started with
A take's answer may carry one descriptor (SCM_RIGHTS): the spill's file.
"""

from __future__ import annotations

import os
import re
import socket

__all__ = [
    "COMPILE_IDLE_STEPS_ENV", "COMPILE_POOL", "DEFAULT_WAIT_S", "DROP_GRADS_ENV", "ERROR", "GC_AHEAD_ENV", "GPU_HANDLES_DROPPED",
    "HOLD_S_ENV", "MAX_FDS", "MAX_REQUEST", "MOVED_BYTES", "MOVED_STORAGES", "NCCL", "NVIDIA_DEV", "OFFLOAD",
    "OFFLOAD_DEVICE_ENV", "OFFLOAD_ENV", "OK", "PID", "POOL_PIDS", "POOL_SHUTDOWN_AT_TAKE", "POOL_STATE", "RELEASE",
    "RESOLVE", "RESOLVE_ENV", "RESOLVE_ERROR", "SHM_DIR", "SPILL", "SPILL_BUSY", "SPILL_BYTES", "SPILL_DIR",
    "SPILL_DIR_ENV", "SPILL_ENV", "SPILL_FILE", "SPILL_PATH", "SPILL_TMPFS", "SPILL_WORD", "STATUS", "STEP", "TAKE",
    "TAKE_AT", "TAKE_DIR_ENV", "TAKE_SPILL_SOURCE", "TMPFS_MAGIC", "TRAINER", "TakeRequest", "fs_type",
    "parse_take", "recv_fds", "release_request", "socket_path", "spill_tmpfs_usable", "status_request",
    "take_request", "take_spill_source_name",
    "GROUP_BACKEND", "GROUP_LIST", "GROUP_RANK", "GROUP_RANKS", "GROUP_SIZE", "GROUP_STORE", "GROUPS",
    "GROUPS_CAPTURED", "GROUPS_ENV", "GROUPS_RELEASED", "GROUPS_UNREACHED", "RENDEZVOUS_ENV", "RENDEZVOUS_WORD", "parse_rendezvous",
    "release_rendezvous",
]

# --- the trainer's environment ----------------------------------------------------------------

TAKE_DIR_ENV = "SNAPGUARD_TAKE_DIR"  # the directory of the take point's socket; set: the hook starts
RESOLVE_ENV = "SNAPGUARD_RESOLVE_BLOCKERS"  # 0: forked children keep their GPU handles, the pool stays
HOLD_S_ENV = "SNAPGUARD_TAKE_HOLD_S"  # how long a hold waits for its release (300 s)
COMPILE_IDLE_STEPS_ENV = "SNAPGUARD_COMPILE_IDLE_STEPS"  # optimizer steps of idle compilation (5)
GC_AHEAD_ENV = "SNAPGUARD_TAKE_GC_AHEAD"  # 0: the hold runs Python's full collection itself, inside the stall
DROP_GRADS_ENV = "SNAPGUARD_TAKE_DROP_GRADS"  # 1: the hold sets the stepped optimizer's gradients to None
OFFLOAD_ENV = "SNAPGUARD_TAKE_OFFLOAD"  # 0: the optimizer's tensors stay on the device
OFFLOAD_DEVICE_ENV = "SNAPGUARD_TAKE_OFFLOAD_DEVICE"  # cpu: a CPU trainer's tensors move (the tests')
SPILL_ENV = "SNAPGUARD_TAKE_SPILL"  # 0: a take asked to spill keeps the moved bytes in memory
SPILL_DIR_ENV = "SNAPGUARD_TAKE_SPILL_DIR"  # where the spill's file goes
CUDA_STACK_ENV = "SNAPGUARD_TAKE_CUDA_STACK"  # 0: the hold leaves the CUDA stack size limit as it is
GROUPS_ENV = "SNAPGUARD_TAKE_GROUPS"  # 0: torch.distributed's groups are left as torch makes them
RENDEZVOUS_ENV = "SNAPGUARD_RENDEZVOUS"  # the executor's: HOST:PORT a restore's release names

# --- the socket and its requests --------------------------------------------------------------

STATUS, TAKE, TAKE_AT, RELEASE = "status", "take", "take-at", "release"
RENDEZVOUS_WORD = "rendezvous"  # a release's option word, before HOST:PORT
SPILL_WORD = "spill"  # a take's option word, after its numbers: the executor takes the file
MAX_REQUEST = 4096  # a request line's bytes, at most
MAX_FDS = 4  # descriptors read with a request or a reply, at most
DEFAULT_WAIT_S = 10.0  # a take's wait when its request names none


def socket_path(take_dir: str, pid: int) -> str:
    """The take point's socket of process `pid` (as it sees its own pid) in `take_dir`."""
    return os.path.join(take_dir, f"{pid}.sock")


def status_request() -> str:
    return f"{STATUS}\n"


def release_request(rendezvous: str | None = None) -> str:
    """A release's line; with `rendezvous` (HOST:PORT) the released groups' store moves there."""
    return f"{RELEASE} {RENDEZVOUS_WORD} {rendezvous}\n" if rendezvous else f"{RELEASE}\n"


def parse_rendezvous(text: str) -> tuple[str, int]:
    """HOST:PORT ([V6]:PORT for IPv6) as (host, port); ValueError when it is not one."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or len(host) > 255 \
            or not re.fullmatch(r"[A-Za-z0-9.:_-]+", host):
        raise ValueError(f"not HOST:PORT: {text[:100]!r}")
    return host, int(port)


def release_rendezvous(words: list[str]) -> str | None:
    """The HOST:PORT a release's words name (validated), or None; ValueError when malformed."""
    if RENDEZVOUS_WORD not in words[1:]:
        return None
    i = words.index(RENDEZVOUS_WORD)
    if i + 1 >= len(words):
        raise ValueError("rendezvous names no HOST:PORT")
    host, port = parse_rendezvous(words[i + 1])
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def take_request(wait_s: float, spill: bool, at_step: int | None = None) -> str:
    """A take's line: at the next step's end, or at the end of step `at_step`."""
    head = f"{TAKE} " if at_step is None else f"{TAKE_AT} {at_step} "
    return f"{head}{wait_s}{' ' + SPILL_WORD if spill else ''}\n"


class TakeRequest:
    """A take's words read: `at` the step to hold at (None: the next), `wait_s`, `spill`."""

    def __init__(self, at: int | None, wait_s: float, spill: bool) -> None:
        self.at, self.wait_s, self.spill = at, wait_s, spill


def parse_take(words: list[str]) -> TakeRequest:
    """The words of a `take` or `take-at` request; ValueError when its numbers are not numbers."""
    spill = SPILL_WORD in words
    numbers = [w for w in words[1:] if w != SPILL_WORD]
    at = int(numbers[0]) if words[0] == TAKE_AT else None
    wait = float(numbers[-1]) if len(numbers) > (1 if at is not None else 0) else DEFAULT_WAIT_S
    return TakeRequest(at, wait, spill)


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int = MAX_FDS) -> tuple[bytes, list[int]]:
    """One read, and the descriptors that came with it (SCM_RIGHTS), none of them inherited by a
    child: socket.recv_fds cannot ask for MSG_CMSG_CLOEXEC."""
    data, fds, _, _ = socket.recv_fds(sock, bufsize, maxfds)
    for fd in fds:
        os.set_inheritable(fd, False)
    return data, list(fds)


# --- the replies' fields ----------------------------------------------------------------------

OK, ERROR = "ok", "error"
STEP, TRAINER, NCCL, PID = "step", "trainer", "nccl", "pid"  # status: steps done, trains, has NCCL, own pid
RESOLVE = "resolve"  # status: forked children drop GPU handles, the compile pool goes when idle
GPU_HANDLES_DROPPED = "gpu_handles_dropped_in_children"  # status: the fork handler is registered
RESOLVE_ERROR = "resolve_error"  # status: why the pool's idle shutdown stopped working
SPILL, SPILL_DIR, SPILL_BUSY = "spill", "spill_dir", "spill_busy"  # status: can spill, where, file in use
COMPILE_POOL = "compile_pool"  # status and a take's figures: torch.compile's pool
POOL_STATE, POOL_PIDS, POOL_SHUTDOWN_AT_TAKE = "state", "pids", "shutdown_at_take"  # compile_pool's fields
OFFLOAD = "offload"  # a take's figures: the optimizer's move
MOVED_BYTES, MOVED_STORAGES = "bytes", "storages"  # offload's fields: bytes moved, storages moved
SPILL_PATH, SPILL_BYTES = "path", "bytes"  # offload's `spill` fields: the trainer's name, its size
SPILL_FILE = "file"  # offload's `spill` field the executor adds: the image's file of it
GROUPS = "process_groups"  # status and a take's figures: the trainer's torch.distributed groups
GROUP_LIST, GROUPS_UNREACHED, GROUPS_RELEASED = "groups", "unreached", "released"  # GROUPS' fields
GROUP_STORE = "store"  # GROUPS' field: the rendezvous store (host, port, hosted here)
GROUPS_CAPTURED = "captured_in_graph"  # GROUPS' field: an NCCL collective ran under CUDA graph capture
GROUP_BACKEND, GROUP_RANK, GROUP_SIZE, GROUP_RANKS = "backend", "rank", "size", "ranks"  # a group's

# --- the spill's names and file systems ---------------------------------------------------------

# Where a node mounts a tmpfs for take points' spills, with huge pages (huge=within_size): a
# trainer spills there when SNAPGUARD_TAKE_SPILL_DIR does not say and it is a tmpfs, else into
# SHM_DIR (4 KiB pages). `snapguard preflight --node` reports which.
SPILL_TMPFS = "/run/snapguard-spill"
SHM_DIR = "/dev/shm"
# take_spill_source_name's, and only those; group 1 the pid (as the trainer sees it)
TAKE_SPILL_SOURCE = re.compile(r"snapguard-take-([0-9]+)-[0-9a-f]{16}")
TMPFS_MAGIC = 0x01021994  # statfs(2)'s f_type of a tmpfs (and of a memfd's internal mount)
# the device files of a GPU: held outside a CUDA context they keep CRIU from dumping a process
NVIDIA_DEV = re.compile(r"^/dev/nvidia(\d+|ctl|-uvm|-uvm-tools|-modeset|-caps/.*)$")


def take_spill_source_name(pid: int) -> str:
    """A new name for the file on a tmpfs into which pid's take point moves its bytes (its spill,
    before the executor writes it into the image): the pid and 64 random bits."""
    import secrets

    return f"snapguard-take-{pid}-{secrets.token_hex(8)}"


def fs_type(fd: int) -> int:
    """The f_type of the filesystem an open file is on (fstatfs(2)); OSError when it fails."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    buf = (ctypes.c_long * 32)()  # struct statfs is 120 bytes on x86_64 and aarch64; f_type first
    if libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(buf[0]) & 0xFFFFFFFF


def spill_tmpfs_usable(path: str, anyone: bool = False) -> bool:
    """Whether `path` is a tmpfs mounted there (not merely a directory of the tmpfs above it, as
    one left on /run by a mount that failed would be) in which this process may make files; with
    `anyone`, in which every user may (mode 1777, as /dev/shm: what root asks for its trainers).
    Never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st, above = os.fstat(fd), os.stat("..", dir_fd=fd)
        if fs_type(fd) != TMPFS_MAGIC or st.st_dev == above.st_dev:
            return False
        if anyone:
            return st.st_mode & 0o1777 == 0o1777
        return os.access(f"/proc/self/fd/{fd}", os.W_OK | os.X_OK)
    except OSError:
        return False
    finally:
        os.close(fd)
