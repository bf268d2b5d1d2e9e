"""The CUDA checkpoint driver API (cuCheckpointProcess*) through cffi, loaded from libcuda.so.1.

Mechanism only: each call returns or raises CudaError with the CUresult; what a failure means
for a snapshot (a timeout, a wedged process) is decided by the callers.
"""

from __future__ import annotations

import threading

from cffi import FFI

__all__ = ["CudaError", "Driver", "STATES", "load"]

_CDEF = """
typedef int CUresult;
typedef unsigned long long cuuint64_t;
typedef struct { char bytes[16]; } CUuuid;
typedef struct { unsigned int timeoutMs; unsigned int reserved0; cuuint64_t reserved1[7]; } CUcheckpointLockArgs;
typedef struct { cuuint64_t reserved[8]; } CUcheckpointCheckpointArgs;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[44];
    cuuint64_t reserved1;
} CUcheckpointRestoreArgs;
typedef struct { cuuint64_t reserved[8]; } CUcheckpointUnlockArgs;
CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *version);
CUresult cuGetErrorName(CUresult error, const char **name);
CUresult cuGetErrorString(CUresult error, const char **str);
CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid);
CUresult cuCheckpointProcessGetState(int pid, int *state);
CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);
"""

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_TIMEOUT = 909
# Restore arguments carry GPU pairs from the CUDA 13.0 driver API (driver r580); before that the
# same 64 bytes are reserved and must be zero.
GPU_PAIRS_MIN_DRIVER_API = 13000
CHECKPOINT_SYMBOLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                      "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState",
                      "cuCheckpointProcessGetRestoreThreadId")


class CudaError(Exception):
    """A CUresult other than CUDA_SUCCESS from a checkpoint call."""

    def __init__(self, call: str, code: int, name: str, text: str, pid: int | None = None) -> None:
        self.call, self.code, self.name, self.text, self.pid = call, code, name, text, pid
        where = f" (pid {pid})" if pid is not None else ""
        super().__init__(f"{call}{where}: {name} ({code}): {text}")

    @property
    def timed_out(self) -> bool:
        return self.code == CUDA_ERROR_TIMEOUT


class Driver:
    """One loaded libcuda. cuInit is called only when a call answers CUDA_ERROR_NOT_INITIALIZED
    (restore does without persistence mode): it costs a driver start-up on every cuda-checkpoint
    run, and CRIU's plugin runs cuda-checkpoint several times while the trainer is stalled."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self.ffi = FFI()
        self.ffi.cdef(_CDEF)
        self.lib = self.ffi.dlopen(library)
        self._init_lock = threading.Lock()
        self._initialised = False

    def _name(self, code: int) -> tuple[str, str]:
        name, text = self.ffi.new("const char **"), self.ffi.new("const char **")
        self.lib.cuGetErrorName(code, name)
        self.lib.cuGetErrorString(code, text)
        decode = (lambda p: self.ffi.string(p[0]).decode() if p[0] != self.ffi.NULL else "unknown")
        return decode(name), decode(text)

    def _check(self, call: str, code: int, pid: int | None = None) -> None:
        if code != 0:
            raise CudaError(call, code, *self._name(code), pid=pid)

    def init(self) -> None:
        with self._init_lock:
            if not self._initialised:
                self._check("cuInit", self.lib.cuInit(0))
                self._initialised = True

    def version(self) -> int:
        v = self.ffi.new("int *")
        self._check("cuDriverGetVersion", self.lib.cuDriverGetVersion(v))
        return int(v[0])

    def _call(self, call: str, pid: int, *args: object) -> None:
        """One checkpoint call, with cuInit and a second try if the driver was not initialised."""
        fn = getattr(self.lib, call)
        code = fn(pid, *args)
        if code == CUDA_ERROR_NOT_INITIALIZED and not self._initialised:
            self.init()
            code = fn(pid, *args)
        self._check(call, code, pid)

    def state(self, pid: int) -> str:
        s = self.ffi.new("int *")
        self._call("cuCheckpointProcessGetState", pid, s)
        return STATES.get(int(s[0]), f"unknown({s[0]})")

    def restore_thread_id(self, pid: int) -> int:
        tid = self.ffi.new("int *")
        self._call("cuCheckpointProcessGetRestoreThreadId", pid, tid)
        return int(tid[0])

    def lock(self, pid: int, timeout_ms: int = 0) -> None:
        args = self.ffi.new("CUcheckpointLockArgs *")
        args.timeoutMs = timeout_ms
        self._call("cuCheckpointProcessLock", pid, args)

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, self.ffi.new("CUcheckpointCheckpointArgs *"))

    def restore(self, pid: int, gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        """Restore GPU state; gpu_pairs maps old GPU UUIDs to new ones and must list every GPU."""
        args = self.ffi.new("CUcheckpointRestoreArgs *")
        keep = None
        if gpu_pairs:
            if self.version() < GPU_PAIRS_MIN_DRIVER_API:
                raise CudaError("cuCheckpointProcessRestore", 801, "CUDA_ERROR_NOT_SUPPORTED",
                                "this driver's restore takes no GPU pairs (needs the CUDA 13 driver API)", pid)
            keep = self.ffi.new("CUcheckpointGpuPair[]", len(gpu_pairs))
            for i, (old, new) in enumerate(gpu_pairs):
                self.ffi.memmove(keep[i].oldUuid.bytes, uuid_bytes(old), 16)
                self.ffi.memmove(keep[i].newUuid.bytes, uuid_bytes(new), 16)
            args.gpuPairs, args.gpuPairsCount = keep, len(gpu_pairs)
        self._call("cuCheckpointProcessRestore", pid, args)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, self.ffi.new("CUcheckpointUnlockArgs *"))


def uuid_bytes(gpu_uuid: str) -> bytes:
    """'GPU-8c3b...' (as NVML and nvidia-smi print it) to the 16 raw bytes of CUuuid."""
    import uuid  # only a device map needs it: cuda-checkpoint's start-up is in the trainer's stall

    text = gpu_uuid[4:] if gpu_uuid.upper().startswith(("GPU-", "MIG-")) else gpu_uuid
    return uuid.UUID(text).bytes


_loaded: Driver | None = None


def load() -> Driver:
    """The process-wide Driver; raises OSError when libcuda.so.1 cannot be loaded."""
    global _loaded
    if _loaded is None:
        _loaded = Driver()
    return _loaded
