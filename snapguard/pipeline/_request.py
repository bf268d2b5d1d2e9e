"""What a snapshot or a restore is asked to do: the one options object both entry points fill.

`snapguard-runc checkpoint/restore` and `snapguard checkpoint/restore` only map their flags onto
a Request (runc's counterpart is CriuOpts); `checkpoint` and `restore` read nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from ..config import Config
from ..devicemap import DeviceMap

__all__ = ["NETWORK_LOCKS", "Request", "Timeouts"]

NETWORK_LOCKS = ("auto", "iptables", "nftables", "skip")
# snapguard's own deadline on a runc or CRIU run, as a multiple of CRIU's timeout: CRIU's timeout
# bounds each of its waits (freezing, seizing), the whole run may take several (at most the
# config's run_timeout_s)
RUN_DEADLINE_FACTOR = 10
# a dump whose workload died under it gets this much of its deadline, at most DIED_GRACE_S, to end
# by itself (a stopping dump's CRIU may be finishing its last steps) before it is killed
DIED_GRACE_SHARE, DIED_GRACE_S = 0.1, 10.0


@dataclass(frozen=True)
class Timeouts:
    """Seconds. `criu_s`: CRIU's own timeout and the CUDA lock's; `run_s`: the deadline snapguard
    enforces on the whole runc or CRIU child, killing its process group when it passes;
    `died_grace_s`: how long a dump goes on once its workload died under it (DIED_GRACE_SHARE of
    `run_s`, at most DIED_GRACE_S)."""

    criu_s: int = 60
    run_s: float = 600.0
    take_wait_s: float = 10.0

    @property
    def died_grace_s(self) -> float:
        return min(DIED_GRACE_S, DIED_GRACE_SHARE * self.run_s)

    @classmethod
    def from_config(cls, config: Config, take_wait_s: float | None = None) -> Timeouts:
        run_s = min(config.criu_timeout_s * RUN_DEADLINE_FACTOR, config.run_timeout_s)
        return cls(criu_s=int(config.criu_timeout_s), run_s=float(run_s),
                   take_wait_s=float(config.take_wait_s if take_wait_s is None else take_wait_s))


@dataclass(frozen=True)
class Request:
    """One checkpoint or restore. Paths are absolute; `work_dir` defaults to the image dir."""

    image_dir: str
    work_dir: str = ""
    leave_running: bool = False
    tcp_established: bool = False
    network_lock: str = "auto"  # auto: skip when nothing outside the tree can reach it, else CRIU's default
    device_map: DeviceMap | None = None  # restore: None derives it from the manifest
    # restore: (name, sha256, st_dev, st_ino) of files whose digests were computed as they were
    # written into a private directory (a store's pull): not read a second time
    verified_digests: tuple[tuple[str, str, int, int], ...] = ()
    fence_epoch: int | None = None  # checkpoint: the job's fencing epoch on this node, sealed into the manifest
    at_step: int | None = None  # checkpoint: hold every trainer at the end of this optimizer step (every node's same)
    rendezvous: str | None = None  # restore: HOST:PORT the restored ranks' process groups rebuild their store at
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        if not os.path.isabs(self.image_dir):
            object.__setattr__(self, "image_dir", os.path.abspath(self.image_dir))
        if not self.work_dir:
            object.__setattr__(self, "work_dir", self.image_dir)
        elif not os.path.isabs(self.work_dir):
            object.__setattr__(self, "work_dir", os.path.abspath(self.work_dir))
        if self.network_lock not in NETWORK_LOCKS:
            raise ValueError(f"network lock must be one of {', '.join(NETWORK_LOCKS)}, got {self.network_lock!r}")

    def path(self, name: str) -> str:
        """A file of the run in the work directory (logs, the result record)."""
        return os.path.join(self.work_dir, name)

    def with_(self, **changes: object) -> Request:
        return replace(self, **changes)  # type: ignore[arg-type]
