"""The typed failure reasons and the failure record.

Every way a guarded checkpoint or restore can be refused or can fail has one stable name here.
Callers (containerd's log, a scheduler reading ``snapguard-result.json``, a CI gate) key on the
name; the evidence says which pid, path, mapping or versions were involved.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Failure",
    "failure_from",
    "Finding",
    "Phase",
    "Reason",
    "SnapguardError",
    "Severity",
]


class Phase(str, enum.Enum):
    PREFLIGHT = "preflight"
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    USAGE = "usage"


class Severity(str, enum.Enum):
    BLOCKER = "blocker"
    WARNING = "warning"


@dataclass(frozen=True)
class _Meta:
    meaning: str
    phase: Phase
    workload_intact: bool
    remedy: str


P, C, R, U = Phase.PREFLIGHT, Phase.CHECKPOINT, Phase.RESTORE, Phase.USAGE


class Reason(enum.Enum):
    """One member per failure mode; the value carries its meaning, phase and remedy."""

    # argv, config and the executor's own environment
    USAGE_ERROR = _Meta("the command line is not one snapguard accepts", U, True,
                        "fix the arguments; see --help")
    CONFIG_INVALID = _Meta("snapguard's configuration is missing, unreadable or invalid", U, True,
                           "fix /etc/snapguard/config.toml (or $SNAPGUARD_CONFIG)")
    RUNC_UNUSABLE = _Meta("the pinned real runc is missing, not executable or not root-owned", U, True,
                          "install runc and point `runc` in the config at it")
    RUNTIME_PAIRING_UNTESTED = _Meta("this containerd and runc are a pairing known to misbehave or not tested together",
                                     P, True, "install the runc containerd's docs/RUNC.md names for its version "
                                     "(packaging/install-deps.sh installs tested pairs)")
    INSUFFICIENT_PRIVILEGE = _Meta("not running with the privileges CRIU needs", P, True,
                                   "run as root with CAP_SYS_ADMIN and CAP_SYS_PTRACE")
    CONTAINER_NOT_FOUND = _Meta("runc does not know the container or it is not running", P, True,
                                "check the container id and --root")
    PREFLIGHT_FAILED = _Meta("a preflight check could not run, so safety is unknown", P, True,
                             "read the check's error; fix what it could not read")
    PROCESS_NOT_FOUND = _Meta("the process to check or snapshot does not exist", P, True,
                              "check the pid")
    KERNEL_THREAD = _Meta("the pid is a kernel thread, which CRIU cannot snapshot", P, True,
                          "name the pid of a user process (the root of the job's tree)")
    ZOMBIE_PROCESS = _Meta("the process has exited and waits to be reaped", P, True,
                           "name a running process; the job may have ended")
    NOT_THREAD_GROUP_LEADER = _Meta("the pid is a thread of another process, not a process", P, True,
                                    "name the process (its Tgid in /proc/PID/status), not one of its threads")
    SNAPSHOT_IN_PROGRESS = _Meta("another snapguard run is snapshotting or restoring this tree or image", P, True,
                                 "wait for it to finish; one snapshot of a tree at a time")
    CHILDREN_LEFT_BEHIND = _Meta("an executor that died with its watchdog left runc or CRIU running; they were ended",
                                 P, True, "nothing to do: this run ended them; find why the executor was killed "
                                 "(its log, the OOM killer) if it recurs")
    UNTRUSTED_PATH = _Meta("a path that decides what runs as root, or an image, is writable or owned by another user",
                           P, True, "make it root-owned and writable by root alone (chown root; chmod go-w), "
                           "every parent included")
    INTERNAL_ERROR = _Meta("snapguard met an error it has no better reason for", P, True,
                           "report it with the detail; the workload was left as the record says")

    # host tooling
    CRIU_MISSING = _Meta("CRIU is not installed at the pinned path", P, True,
                         "install CRIU 4.x (the snapguard-criu package, packaging/profiles/criu.sh) or fix `criu` in the config")
    CRIU_TOO_OLD = _Meta("CRIU is older than the oldest version snapguard supports", P, True,
                         "install CRIU 4.0 or newer")
    CRIU_BROKEN = _Meta("the pinned CRIU does not run (missing libraries, wrong architecture)", P, True,
                        "read the loader's message; reinstall CRIU with its libraries")
    CRIU_CHECK_FAILED = _Meta("`criu check` fails on this kernel", P, True,
                              "read the quoted `criu check` output; a kernel or CRIU upgrade is needed")
    CUDA_PLUGIN_UNAVAILABLE = _Meta("CRIU's CUDA plugin or a working cuda-checkpoint is missing", P, True,
                                    "install cuda_plugin.so into CRIU's libdir and cuda-checkpoint on the pinned path")
    NETWORK_LOCK_UNAVAILABLE = _Meta("iptables-restore, which CRIU's network lock runs, is missing", P, True,
                                     "install iptables")

    # workload checks
    STRAY_GPU_DEVICE_HANDLE = _Meta("a process holds /dev/nvidia* but has no CUDA context", P, True,
                                    "start the job with snapguard's take-point hook (PYTHONPATH=<snapguard/takepoint/"
                                    "site>, SNAPGUARD_TAKE_DIR; it drops the GPU handles forked workers inherit "
                                    "and shuts torch.compile's pool down) or the spawn start method; stop NVML "
                                    "monitors in the tree")
    NCCL_UNSUPPORTED = _Meta("the job uses NCCL or several CUDA processes that cannot be coordinated", P, True,
                             "use a coordinated multi-rank snapshot or fall back to a file checkpoint")
    PROCESS_GROUP_UNREACHED = _Meta("a torch.distributed process group or store the take point cannot release at "
                                    "the hold", P, True, "make the groups with init_process_group (env:// or tcp://, "
                                    "no store of the trainer's) and new_group over gloo or nccl; under torchrun, "
                                    "start torchrun itself with the take point's environment (its agent then "
                                    "releases its stores too)")
    COLLECTIVE_IN_CUDA_GRAPH = _Meta("an NCCL collective was captured in a CUDA graph, which replays the "
                                     "communicator it captured: it cannot be released and rebuilt", P, True,
                                     "capture no collective in a CUDA graph (torch.compile mode=reduce-overhead "
                                     "around DDP/FSDP does), or fall back to a file checkpoint")
    NCCL_NVLS_ON = _Meta("an NCCL group may use NVLink multicast (NVLS), whose multicast objects no snapshot can "
                         "carry", P, True, "launch every rank with NCCL_NVLS_ENABLE=0")
    CUDA_IPC_UNSUPPORTED = _Meta("several CUDA processes share one GPU", P, True, "snapshot one CUDA process per GPU")
    MPS_UNSUPPORTED = _Meta("the workload uses CUDA MPS", P, True, "run without MPS")
    MIG_UNSUPPORTED = _Meta("a GPU is in MIG mode", P, True, "disable MIG on the node")
    IO_URING_PRESENT = _Meta("a process has an io_uring instance, which CRIU cannot dump", P, True,
                             "disable io_uring in the workload (e.g. liburing users)")
    RDMA_DEVICE_PRESENT = _Meta("a process holds an RDMA or GPUDirect device", P, True,
                                "close /dev/infiniband/* and /dev/gdrdrv handles first")
    TCP_ESTABLISHED = _Meta("a process has established TCP connections", P, True,
                            "pass --tcp-established (peers must tolerate it) or close the connections")
    SHM_DELETED_FILE = _Meta("a process maps a deleted /dev/shm file", P, True, "keep shared-memory files linked")
    MOUNT_NOT_IN_SPEC = _Meta("the container has a mount that is neither one of its OCI spec's mounts nor one runc "
                              "makes, which runc does not hand CRIU as external and CRIU cannot dump (a submount a "
                              "recursive bind brought in)", P, True, "make the bind non-recursive (options "
                              "[\"bind\"], not \"rbind\"), or name the submount as a mount of its own in the spec")
    FILE_CHANGED = _Meta("a file the image depends on changed size since the dump", R, True,
                         "restore the file as it was or open it O_APPEND")
    FILE_MISSING = _Meta("a file the image depends on is missing on this host", R, True,
                         "provide the file at the same path")
    AMX_STATE_UNSUPPORTED = _Meta("a process may use Intel AMX, whose state and permission CRIU does not restore", P, True,
                                  "start the workload with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (CPU bf16 stays "
                                  "off AMX), or restore only snapshots of processes that never ran AMX code")
    SECCOMP_BLOCKED = _Meta("a seccomp filter would block CRIU", P, True, "run the workload without seccomp")
    INTERPOSER_PRESENT = _Meta("a library interposer is preloaded (LD_PRELOAD or /etc/ld.so.preload)", P, True,
                               "remove the preload for snapshot-able workloads")
    HOST_MEMORY_INSUFFICIENT = _Meta("not enough host memory for the snapshot or restore", P, True,
                                     "free host memory or raise the cgroup limit")

    # the CUDA checkpoint driver API
    CUDA_LOCK_TIMEOUT = _Meta("the CUDA process could not be locked in time (busy kernels or a held lock)", C, True,
                              "retry later or raise the timeout; the process was left running")
    CUDA_CHECKPOINT_FAILED = _Meta("the driver failed to checkpoint the CUDA process", C, True,
                                   "read the CUDA error; the process was restored and unlocked")
    CUDA_RESTORE_FAILED = _Meta("the driver failed to restore the CUDA process's GPU state", R, False,
                                "check free GPU memory and the device map; cuda-checkpoint does not roll back")
    CUDA_STATE_WEDGED = _Meta("a CUDA process is left locked or checkpointed and could not be brought back", C, False,
                              "restore and unlock it by hand (snapguard-cuda-checkpoint --toggle), or restart it")
    NOT_A_CUDA_PROCESS = _Meta("the process has no CUDA context the driver can checkpoint", P, True,
                               "check the pid; forked workers and NVML users have no context")
    GPU_IDENTITY_MISMATCH = _Meta("a GPU the image used is absent here and no device map covers it", R, True,
                                  "pass a device map or restore on a host with those GPUs")
    COORDINATION_FAILED = _Meta("the ranks of a job could not be brought to one common step", C, True,
                                "start every rank with snapguard's take-point hook; check no rank is stuck")
    TAKE_POINT_TIMEOUT = _Meta("the workload did not answer the take point in time", C, True,
                               "the snapshot went on with the allocator's whole reserve; check the hook is loaded")
    TAKE_POINT_UNREACHABLE = _Meta("a process has a take-point socket that does not answer: a trainer that may be "
                                   "hung or mid-step, which a snapshot would catch mid-step; nothing was frozen", C,
                                   True, "find why the process does not answer (py-spy dump --pid PID); restart it "
                                   "or end it, and retry")

    # GPU identity and capacity
    GPU_DRIVER_MISSING = _Meta("no NVIDIA driver is loaded on this node", P, True,
                               "load the NVIDIA driver (and wait for it at boot) before snapshotting GPU work")
    DRIVER_TOO_OLD = _Meta("the NVIDIA driver has no cuCheckpointProcess* API", P, True, "install driver 555 or newer")
    DRIVER_VERSION_MISMATCH = _Meta("the image was taken under another NVIDIA driver", R, True,
                                    "restore on a host with the same driver")
    GPU_MODEL_MISMATCH = _Meta("the image was taken on another GPU model", R, True,
                               "restore on a host with the same GPU model")
    GPU_COUNT_MISMATCH = _Meta("this host has fewer GPUs than the image used", R, True,
                               "restore on a host with as many GPUs")
    GPU_MEMORY_INSUFFICIENT = _Meta("not enough free GPU memory to restore", R, True, "free GPU memory")
    PERSISTENCE_MODE_OFF = _Meta("NVIDIA persistence mode is off", P, True, "enable persistence mode")
    KERNEL_CHANGED = _Meta("the image was taken under another kernel release", R, True,
                           "usually harmless; if the restore fails, restore on the source kernel")
    CRIU_VERSION_CHANGED = _Meta("the image was written by another CRIU version", R, True,
                                 "usually harmless within CRIU 4.x; if the restore fails, use the source's CRIU")
    PID_CONFLICT = _Meta("a process the image restores has a pid that is taken on this host", R, True,
                         "stop the original (a leave-running snapshot) or restore into a new pid namespace")
    CPU_FEATURE_MISMATCH = _Meta("this host lacks CPU features the image's processes may use", R, True,
                                 "restore on a host with the same or a newer CPU")

    # images
    IMAGE_INCOMPLETE = _Meta("the image has no completion marker (half written or half copied)", R, True,
                             "copy the whole image again, or take a new one")
    IMAGE_CORRUPT = _Meta("a file in the image does not match its recorded checksum or size", R, True,
                          "copy the image again from its source")
    MANIFEST_INVALID = _Meta("the image's compatibility manifest is missing or malformed", R, True,
                             "take a new image with snapguard")

    # the snapshot itself
    CRIU_DUMP_FAILED = _Meta("CRIU failed to dump the workload", C, True,
                             "read the quoted CRIU errors; fall back to a file checkpoint")
    CRIU_RESTORE_FAILED = _Meta("CRIU failed to restore the workload", R, True,
                                "read the quoted CRIU errors; fall back to a file checkpoint")
    CRIU_TIMEOUT = _Meta("CRIU did not finish within snapguard's deadline and was killed", C, True,
                         "raise criu_timeout_s or find what CRIU waited on in its log; the workload was brought back")
    RUNC_TIMEOUT = _Meta("runc did not finish within snapguard's deadline and was killed", C, True,
                         "raise criu_timeout_s or look for a stuck runc; the workload was brought back")
    WORKLOAD_FROZEN = _Meta("the workload is frozen or stopped, so its take point and the CUDA driver's lock cannot "
                            "reach it", C, True, "resume it (runc resume, SIGCONT) and retry; nothing was frozen by "
                            "snapguard")
    IMAGE_WRITE_FAILED = _Meta("the manifest or checksums could not be written into the image", C, True,
                               "check space and permissions of the image path")

    # reclaim: the node agent (`snapguard agent`) and its notice sources
    NOTICE_SOURCE_UNAVAILABLE = _Meta("a notice source (cloud metadata service, Kubernetes API, local inbox) could not "
                                      "be read", P, True, "check the source's URL and that this node can reach it; "
                                      "the agent keeps polling and the other sources still work")
    NOTICE_MALFORMED = _Meta("a notice source answered something that is not in the format its owner documents", P, True,
                             "check the source's URL points at the real service (not a proxy or captive page)")
    CONTAINERD_UNAVAILABLE = _Meta("containerd's API (through its ctr client) could not list the annotated containers",
                                   P, True, "check --containerd-address and --ctr; the containers registered before "
                                   "stay protected and `snapguard protect --container` still works")
    AGENT_SNAPSHOT_INTERRUPTED = _Meta("the agent stopped while it snapshotted a workload; its unmarked image was "
                                       "discarded", C, True, "nothing to do when the workload still runs (the agent "
                                       "snapshots it again); else resume the job from its file checkpoint")
    AGENT_UPLOAD_FAILED = _Meta("a sealed image could not be put into the image store", C, True,
                                "check the store URL and credentials; the sealed image stays in the agent's state dir")
    NOTICE_TOO_SHORT = _Meta("the notice's lead left too little time for the workload's snapshot (its estimate from "
                             "its size and the last measured rate), so it was not started", C, True,
                             "resume the job from the file checkpoint the journal names; a longer lead, fewer or "
                             "smaller workloads per node, or a faster images disk lets more fit")
    AGENT_STATE_INVALID = _Meta("the agent's registry or notices file (or one entry in it) is too large, too deep or "
                                "not the shape snapguard writes", U, True,
                                "the entry is skipped and the others still act; `snapguard protect` the workload "
                                "again, or move the corrupt file aside")
    AGENT_NOT_RUNNING = _Meta("no snapguard agent holds this node's state dir, so a notice would not be acted on",
                              P, True, "start the agent (systemctl start snapguard-agent), or pass `notice --queue` "
                              "to leave the notice in the inbox for the next agent")
    STORE_JOB_NOT_FOUND = _Meta("the image store holds nothing of the job: a mistyped store URL or job name, or a "
                                "store that does not exist", U, True,
                                "check --store and --job; `snapguard images --store URL` lists what the store holds")
    STORE_NOT_WRITABLE = _Meta("the image store given to the agent could not be written at start (a probe object "
                               "was refused or the store did not answer)", R, True,
                               "fix the store URL, network or credentials before a notice comes; until then "
                               "snapshots stay on the node")

    # the mutating admission webhook (`snapguard webhook`)
    ADMISSION_REVIEW_INVALID = _Meta("a request to the webhook is not an admission.k8s.io/v1 AdmissionReview as the "
                                     "API server sends it (not JSON, too large, too deep, or fields of the wrong "
                                     "shape)", U, True, "point the MutatingWebhookConfiguration at /mutate with "
                                     "admissionReviewVersions [v1]; the pod is admitted unchanged (failurePolicy Ignore)")
    WEBHOOK_TLS_UNUSABLE = _Meta("the webhook's TLS certificate or key is missing, unreadable or not a matching "
                                 "PEM pair", U, True, "mount the Secret's tls.crt and tls.key and pass them with "
                                 "--tls-cert and --tls-key")

    # the image store and reclaim recovery (snapguard.store)
    STORE_UNREACHABLE = _Meta("the image store could not be reached or refused the request", R, True,
                              "check the store URL, the network and the credentials; fall back to a file checkpoint")
    STORE_TOO_SLOW = _Meta("the image store moved the image slower than its deadline allows", R, True,
                           "raise the deadline or fix the store's throughput; fall back to a file checkpoint")
    UPLOAD_INCOMPLETE = _Meta("the image in the store has no completion marker (upload interrupted or failed)", R, True,
                              "restore a whole image (one with its marker) or push the image again")
    STORE_RECORD_INVALID = _Meta("a record read from the image store (an image's store record or marker, a file "
                                 "checkpoint's record) is too large, too deep or not the shape snapguard writes",
                                 R, True, "the record is skipped and older good ones are used; delete it from the "
                                 "store or push the image again")
    STORE_WRITE_UNCONFIRMED = _Meta("the image store answered a write without confirming it (an ETag or checksum "
                                    "that is not the content's, or the object absent or short afterwards)", C, True,
                                    "check that the store URL reaches a real S3 service (not a proxy or captive "
                                    "page); the image was not marked whole in the store")
    FENCED = _Meta("a newer restore of the job holds a later epoch: this node's snapshot or restore is stale", R, True,
                   "stop this copy of the job; the node holding the newest epoch owns it now")
    ALREADY_RESTORED = _Meta("the image was pushed under an older epoch than the job's current one: the job was "
                             "restored since and a copy of it may be running", R, True,
                             "restore the job's newest image, or, once the running copy is known to be gone, "
                             "restore --force")
    FALLBACK_TO_FILE_CHECKPOINT = _Meta("the snapshot was refused, so the job starts from its newest file checkpoint",
                                        R, True, "start the job from the file checkpoint printed; the refusal says why")

    # the kubelet's path: CRI CheckpointContainer, OCI checkpoint images in a registry (snapguard.ocicheckpoint)
    CRI_UNAVAILABLE = _Meta("the node's CRI socket could not be reached, a CRI call ran past its deadline, or "
                            "a list or StopContainer call failed", C, True,
                            "check --cri-socket (containerd's CRI plugin) and the message containerd gave; the "
                            "job falls back to its file checkpoint")
    CRI_CHECKPOINT_FAILED = _Meta("containerd's CRI CheckpointContainer failed and the runtime left no typed reason "
                                  "of snapguard's", C, True, "read containerd's message quoted; the job falls back to "
                                  "its file checkpoint")
    CRI_CLIENT_MISSING = _Meta("the CRI client (grpcio) is not installed", U, True,
                               "pip install 'snapguard[k8s]'")
    CHECKPOINT_ARCHIVE_INVALID = _Meta("a CRI checkpoint archive is not the layout containerd writes (config.dump, "
                                       "spec.dump, checkpoint/; regular files and directories only)", C, True,
                                       "take the checkpoint again through CRI CheckpointContainer")
    REGISTRY_UNREACHABLE = _Meta("the OCI registry could not be reached or refused a request of the push", C, True,
                                 "check the registry URL and that this node may push to the repository; the job "
                                 "falls back to its file checkpoint")
    REGISTRY_TOO_SLOW = _Meta("the push to the OCI registry did not finish within its deadline", C, True,
                              "raise the deadline or fix the registry's throughput; the job falls back to its file "
                              "checkpoint")
    REGISTRY_DIGEST_MISMATCH = _Meta("the registry answered a push with a digest other than that of the bytes "
                                     "pushed", C, True, "check that the URL reaches a real OCI registry (not a proxy "
                                     "that rewrites content); the image was not recorded in the store")

    @property
    def meaning(self) -> str:
        return self.value.meaning

    @property
    def phase(self) -> Phase:
        return self.value.phase

    @property
    def workload_intact(self) -> bool:
        return self.value.workload_intact

    @property
    def remedy(self) -> str:
        return self.value.remedy


@dataclass
class Finding:
    """One thing a check saw: a blocker refuses the operation, a warning is reported only."""

    reason: Reason
    detail: str
    severity: Severity = Severity.BLOCKER
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason.name,
            "severity": self.severity.value,
            "detail": self.detail,
            "evidence": self.evidence,
            "remedy": self.reason.remedy,
        }

    def __str__(self) -> str:
        return f"{self.reason.name}: {self.detail}"


@dataclass
class Failure:
    """The record of a refused or failed operation, as written to snapguard-result.json."""

    reason: Reason
    detail: str
    phase: Phase | None = None
    workload_intact: bool | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    warnings: list[Finding] = field(default_factory=list)
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.phase is None:
            self.phase = self.reason.phase
        if self.workload_intact is None:
            self.workload_intact = self.reason.workload_intact

    @property
    def message(self) -> str:
        """One self-contained line: containerd shows only the first line of the last error."""
        return f"snapguard {self.reason.name}: {self.detail}".replace("\n", " ")

    def to_dict(self) -> dict[str, Any]:
        assert self.phase is not None
        return {
            "ok": False,
            "reason": self.reason.name,
            "meaning": self.reason.meaning,
            "phase": self.phase.value,
            "workload_intact": self.workload_intact,
            "detail": self.detail,
            "evidence": self.evidence,
            "remedy": self.reason.remedy,
            "warnings": [w.to_dict() for w in self.warnings],
            "time": self.time,
        }

    def __str__(self) -> str:
        return self.message


def failure_from(e: BaseException) -> Failure:
    """Any exception as a typed Failure: the one translation each entry point's boundary applies
    (psutil's wrap_exceptions is the model). A SnapguardError carries its own; an exception with
    a `reason` attribute naming a member (ConfigError, trust.UntrustedPathError, ArgvError) takes
    it; an OSError the entry point did not foresee, or anything else, is INTERNAL_ERROR with its
    message in one line, never a traceback."""
    if isinstance(e, SnapguardError):
        return e.failure
    named = getattr(e, "reason", None)
    if isinstance(named, str) and named in Reason.__members__:
        return Failure(Reason[named], str(e).replace("\n", " "))
    if isinstance(e, OSError):
        where = f": {e.filename}" if e.filename else ""
        return Failure(Reason.INTERNAL_ERROR, f"{e.strerror or e}{where}", evidence={"errno": e.errno})
    return Failure(Reason.INTERNAL_ERROR, f"{type(e).__name__}: {e}".splitlines()[0][:500])


class SnapguardError(Exception):
    """The one exception type user-facing code catches; it carries a Failure."""

    def __init__(self, reason: Reason, detail: str, **kw: Any) -> None:
        self.failure = Failure(reason, detail, **kw)
        super().__init__(self.failure.message)

    @property
    def reason(self) -> Reason:
        return self.failure.reason

    @classmethod
    def from_finding(cls, finding: Finding, warnings: list[Finding] | None = None) -> SnapguardError:
        return cls(finding.reason, finding.detail, evidence=finding.evidence, warnings=warnings or [])
