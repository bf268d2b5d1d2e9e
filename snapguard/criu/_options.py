"""The one place a snapshot's settings become CRIU's: argv for `criu dump/restore` run by
snapguard, and a config file plus environment for the CRIU that runc starts (`criu swrk`).

runc builds CRIU's RPC request from its own flags and gives CRIU its environment; what runc
cannot say (the plugin directory, the timeout, the network lock) reaches CRIU through
CRIU_LIBS_DIR and a generated CRIU_CONFIG_FILE. Either way a run gets a private directory of its
own in the state directory (a controlled PATH in which `criu` and `cuda-checkpoint` resolve to
the pinned binaries, and the config file), so concurrent runs never share a file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

from ..devicemap import DeviceMap
from ..wire import BROKER_ENV

__all__ = ["CriuOptions", "RunDir", "SYSTEM_PATH"]

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A preload or an audit library in the caller's environment would run inside CRIU, as root; the
# device map and the executor's cuda-checkpoint broker are snapguard's to set, never inherited.
_DROPPED_ENV = ("LD_PRELOAD", "LD_AUDIT", DeviceMap.ENV, BROKER_ENV, "CRIU_CONFIG_FILE", "CRIU_LIBS_DIR")


@dataclass(frozen=True)
class CriuOptions:
    """What CRIU is told, for either runner (the counterpart of runc's CriuOpts)."""

    images_dir: str
    work_dir: str
    libdir: str
    timeout_s: int
    leave_running: bool = False
    tcp_established: bool = False
    network_lock: str | None = None  # None: CRIU's default (iptables); "skip": nothing to lock
    log_file: str = "dump.log"
    # 3: errors, warnings and CRIU's info lines (every mark criu.log_marks reads, and the CUDA
    # plugin's steps). At 4 CRIU writes about 76,000 debug lines for an 85 M trainer's dump, each
    # with a write() of its own inside the page dump: -v3 took CRIU's dump from 2.27 to 1.74 s
    # (medians, bench/results/h200/criu-loglevel-2026-11-30). runc's own runs keep its level 4.
    log_level: int = 3

    def dump_argv(self, criu: str, pid: int) -> list[str]:
        """`criu dump` of a bare process tree."""
        argv = [criu, "dump", "--tree", str(pid), *self._common(), "--shell-job"]
        if self.leave_running:
            argv.append("--leave-running")
        return argv

    def restore_argv(self, criu: str, pidfile: str) -> list[str]:
        """`criu restore` of a bare process tree, detached."""
        return [criu, "restore", *self._common(), "--shell-job", "--restore-detached", "--pidfile", pidfile]

    def _common(self) -> list[str]:
        argv = ["--images-dir", self.images_dir, "--work-dir", self.work_dir, "--log-file", self.log_file,
                f"-v{self.log_level}", "--libdir", self.libdir, "--timeout", str(self.timeout_s)]
        if self.tcp_established:
            argv.append("--tcp-established")
        if self.network_lock:
            argv += ["--network-lock", self.network_lock]
        return argv

    def config_text(self) -> str:
        """The CRIU config file for the CRIU runc runs: what runc's flags cannot carry."""
        lines = [f"timeout {self.timeout_s}"]
        if self.network_lock:
            lines.append(f"network-lock {self.network_lock}")
        return "".join(f"{line}\n" for line in lines)


class RunDir:
    """A private directory of one run inside the state directory: `bin/` with the pinned criu and
    cuda-checkpoint, `criu.conf`, removed when the run ends."""

    def __init__(self, state_dir: str, criu: str, cuda_checkpoint: str | None) -> None:
        from ..files import write_private_bytes
        from ..trust import private_tempdir

        self.path = private_tempdir(state_dir, "run-")
        self.bin_dir = os.path.join(self.path, "bin")
        os.mkdir(self.bin_dir, 0o700)
        os.chmod(self.bin_dir, 0o700)
        for name, target in (("criu", criu), ("cuda-checkpoint", cuda_checkpoint)):
            if target:
                os.symlink(target, os.path.join(self.bin_dir, name))
        self.config_file = os.path.join(self.path, "criu.conf")
        self._write = write_private_bytes

    def environment(self, options: CriuOptions, device_map: Iterable[tuple[str, str]] | None = None,
                    base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment runc or CRIU runs in. The caller's environment (containerd's) otherwise
        stays: LD_LIBRARY_PATH is how a CRIU carried with its own libraries runs."""
        self._write(self.config_file, options.config_text().encode())
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _DROPPED_ENV}
        env.update({"PATH": f"{self.bin_dir}:{SYSTEM_PATH}", "CRIU_LIBS_DIR": options.libdir,
                    "CRIU_CONFIG_FILE": self.config_file})
        if device_map:
            # CRIU's plugin runs `cuda-checkpoint --action restore` with no map; snapguard's reads this
            DeviceMap(tuple(device_map)).into_env(env)
        return env

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
