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
from dataclasses import dataclass

from .. import procfs
from ..children import probe
from ..files import ensure_private_dir, write_private_json
from ..names import DUMP_LOG, RESTORE_LOG
from ..trust import UntrustedPathError
from ._options import CriuOptions, RunDir

__all__ = [
    "CriuBroken",
    "CriuLogError",
    "CriuOptions",
    "DUMP_LOG",
    "RESTORE_LOG",
    "RunDir",
    "MIN_VERSION",
    "check",
    "extract_errors",
    "log_marks",
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


class CriuBroken(Exception):
    """The pinned CRIU does not run; the message is the loader's or CRIU's own first line."""


def version(criu: str) -> tuple[int, int, int]:
    """CRIU's version as a tuple; raises CriuBroken with what went wrong when it cannot be read."""
    out = probe([criu, "--version"], timeout_s=10)
    if isinstance(out, str):
        raise CriuBroken(out)
    m = _VERSION.search(out.stdout)
    if out.returncode != 0 or not m:
        said = (out.stderr.strip() or out.stdout.strip()).splitlines()
        raise CriuBroken(f"`{criu} --version` exited {out.returncode}: "
                         f"{said[0][:300] if said else 'it printed no version'}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _check_cache_key(criu: str) -> str:
    st = os.stat(criu)
    boot_id = procfs.boot_id() or ""
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
    except (OSError, UntrustedPathError):
        pass  # a cache we cannot write only costs time (the state dir's trust is checked at load)


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
    out = probe([criu, "check"], timeout_s=60)
    if isinstance(out, str):
        return False, out
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


