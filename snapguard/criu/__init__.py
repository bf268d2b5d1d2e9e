"""Driving CRIU: its version, `criu check`, the environment runc runs it in, and its log.

runc starts CRIU itself (`criu swrk`) and CRIU inherits runc's environment; so snapguard configures
CRIU through that environment: a controlled PATH in which `criu` and `cuda-checkpoint` resolve to
pinned root-owned binaries, CRIU_LIBS_DIR for the plugin directory, and CRIU_CONFIG_FILE for a
generated config (timeouts).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass

from ..config import Config, resolve_cuda_checkpoint
from ..files import ensure_private_dir, write_private_bytes, write_private_json

__all__ = [
    "CriuLogError",
    "MIN_VERSION",
    "check",
    "extract_errors",
    "log_marks",
    "prepare_environment",
    "version",
]

MIN_VERSION = (4, 0, 0)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Lines CRIU logs at error level on healthy runs (seen on the lent VMs): not failures by themselves.
BENIGN_ERRORS = (
    re.compile(r"rlimit: Can't setup RLIMIT_NOFILE for self"),
)
_ERROR_LINE = re.compile(r"\bError \((?P<where>[^)]+:\d+)\): (?P<msg>.*)")
_VERSION = re.compile(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.M)


@dataclass
class CriuLogError:
    where: str
    message: str
    context: list[str]

    def __str__(self) -> str:
        return f"Error ({self.where}): {self.message}"


def version(criu: str) -> tuple[int, int, int]:
    """CRIU's version as a tuple; raises OSError or ValueError when it cannot be read."""
    out = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=10, check=False)
    m = _VERSION.search(out.stdout)
    if out.returncode != 0 or not m:
        raise ValueError(f"`{criu} --version` printed no version (exit {out.returncode})")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _check_cache_key(criu: str) -> str:
    st = os.stat(criu)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    raw = f"{os.path.realpath(criu)}:{st.st_size}:{st.st_mtime_ns}:{os.uname().release}:{boot_id}"
    return hashlib.sha256(raw.encode()).hexdigest()


def _cache_file(state_dir: str | None) -> str | None:
    return os.path.join(state_dir, "criu-check.json") if state_dir else None


def _read_cache(state_dir: str | None, criu: str) -> dict[str, object]:
    """What was learnt about this very binary since boot: its version, whether check passed."""
    cache = _cache_file(state_dir)
    if not cache:
        return {}
    try:
        with open(cache) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("key") == _check_cache_key(criu) else {}


def _update_cache(state_dir: str | None, criu: str, **facts: object) -> None:
    cache = _cache_file(state_dir)
    if not cache:
        return
    data = {**_read_cache(state_dir, criu), **facts, "key": _check_cache_key(criu)}
    try:
        ensure_private_dir(os.path.dirname(cache))
        write_private_json(cache, data)
    except OSError:
        pass  # a cache we cannot write only costs time


def cached_version(criu: str, state_dir: str | None) -> tuple[int, int, int]:
    """version(), remembered per binary and boot: a checkpoint should not spawn CRIU to ask."""
    known = _read_cache(state_dir, criu).get("version")
    if isinstance(known, list) and len(known) == 3 and all(isinstance(v, int) for v in known):
        return known[0], known[1], known[2]
    ver = version(criu)
    _update_cache(state_dir, criu, version=list(ver))
    return ver


def check(criu: str, state_dir: str | None = None) -> tuple[bool, str]:
    """Run `criu check`; (passed, its output). A pass is cached in state_dir until reboot.

    `criu check` takes a large share of a small container's checkpoint time and its answer only
    changes with the kernel or the binary, so a pass is remembered under the boot id.
    """
    if _read_cache(state_dir, criu).get("check_passed") is True:
        return True, "criu check passed (cached for this boot)"
    out = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=60, check=False)
    text = (out.stdout + out.stderr).strip()
    passed = out.returncode == 0
    if passed:
        _update_cache(state_dir, criu, check_passed=True)
    return passed, text


def extract_errors(log_text: str, context: int = 2) -> list[CriuLogError]:
    """The `Error (file:line)` lines of a CRIU log, each with the lines before it.

    Benign errors are left out: CRIU's exit status says whether it failed, these say why.
    """
    lines = log_text.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = _ERROR_LINE.search(line)
        if not m or any(p.search(line) for p in BENIGN_ERRORS):
            continue
        found.append(CriuLogError(m.group("where"), m.group("msg").strip(), lines[max(0, i - context):i]))
    return found


def read_log_errors(path: str, limit: int = 3) -> list[CriuLogError]:
    try:
        with open(path, errors="replace") as f:
            return extract_errors(f.read())[:limit]
    except OSError:
        return []


# Where the time of a dump or restore goes: the first line of each, seconds into CRIU's log.
# The CUDA plugin logs before it runs cuda-checkpoint, so the gap to the next mark holds the tool.
LOG_MARKS = {
    "cuda_lock": "pausing devices on pid",
    "seized": "Seized task",
    "cuda_checkpoint": "Checkpointing CUDA devices",
    "dump_pages": "Dumping pages (type",
    "unfreeze": "Unfreezing tasks into",
    "cuda_resume": "resuming devices on pid",
    "dumped": "Dumping finished successfully",
    "fork": "Forking task with",
}
_LOG_TIME = re.compile(r"^\((\d+)\.(\d+)\) ")


def log_marks(path: str) -> dict[str, float]:
    """{mark: seconds into the log} for the LOG_MARKS found in a CRIU log, and "end" for its last
    timestamped line; empty when the log cannot be read."""
    found: dict[str, float] = {}
    last = None
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = _LOG_TIME.match(line)
                if not m:
                    continue
                last = int(m.group(1)) + int(m.group(2)) / 10 ** len(m.group(2))
                for name, text in LOG_MARKS.items():
                    if name not in found and text in line:
                        found[name] = last
    except OSError:
        return {}
    if last is not None:
        found["end"] = last
    return found


def prepare_environment(config: Config, criu: str, device_map: list[tuple[str, str]] | None = None) -> dict[str, str]:
    """The environment runc (and through it CRIU and its CUDA plugin) runs in.

    Builds `<state_dir>/bin`, root-only, holding links to the pinned criu and cuda-checkpoint,
    and a CRIU config with snapguard's timeout.
    """
    cuda_checkpoint = resolve_cuda_checkpoint(config)
    bin_dir = os.path.join(config.state_dir, "bin")
    ensure_private_dir(config.state_dir)
    ensure_private_dir(bin_dir)
    for name, target in (("criu", criu), ("cuda-checkpoint", cuda_checkpoint)):
        link = os.path.join(bin_dir, name)
        if os.path.lexists(link):
            os.unlink(link)
        if target:
            os.symlink(target, link)
    criu_conf = os.path.join(config.state_dir, "criu.conf")
    write_private_bytes(criu_conf, f"timeout {config.criu_timeout_s}\n".encode())
    # The caller's environment (containerd's) otherwise stays: LD_LIBRARY_PATH is how a CRIU
    # carried with its own libraries runs. A preload would run inside every dumped process's CRIU.
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_AUDIT")}
    env.update({
        "PATH": f"{bin_dir}:{SYSTEM_PATH}",
        "CRIU_LIBS_DIR": config.criu_libdir,
        "CRIU_CONFIG_FILE": criu_conf,
    })
    env.pop("SNAPGUARD_DEVICE_MAP", None)
    if device_map:
        # CRIU's plugin runs `cuda-checkpoint --action restore` with no map; snapguard's reads this
        env["SNAPGUARD_DEVICE_MAP"] = ",".join(f"{old}={new}" for old, new in device_map)
    return env


def dump_argv(criu: str, pid: int, images: str, work: str, *, leave_running: bool, tcp_established: bool,
              libdir: str, network_lock: str | None = None) -> list[str]:
    """`criu dump` of a bare process tree (snapguard checkpoint --pid)."""
    argv = [criu, "dump", "--tree", str(pid), "--images-dir", images, "--work-dir", work, "--log-file", "dump.log",
            "-v4", "--shell-job", "--libdir", libdir]
    if leave_running:
        argv.append("--leave-running")
    if tcp_established:
        argv.append("--tcp-established")
    if network_lock:
        argv += ["--network-lock", network_lock]
    return argv


def restore_argv(criu: str, images: str, work: str, pidfile: str, *, tcp_established: bool,
                 libdir: str, network_lock: str | None = None) -> list[str]:
    """`criu restore` of a bare process tree, detached (snapguard restore --images)."""
    argv = [criu, "restore", "--images-dir", images, "--work-dir", work, "--log-file", "restore.log", "-v4",
            "--shell-job", "--restore-detached", "--pidfile", pidfile, "--libdir", libdir]
    if tcp_established:
        argv.append("--tcp-established")
    if network_lock:
        argv += ["--network-lock", network_lock]
    return argv
