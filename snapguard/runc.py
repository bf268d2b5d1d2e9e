"""The real runc, as snapguard asks it things (`runc state` of a container, under a deadline), and
a container's cgroup freezer kept as it was while a snapshot works on the container.

`FreezerGuard`: CRIU freezes a container for its dump, and the executor thaws a paused one for
the take point. Before either, the guard records the freezer's value (cgroup v1's freezer.state,
v2's cgroup.freeze) as it was, for the watchdog (snapguard.children) to write back should the
executor be killed, and in the children's record directory for a later run where the watchdog
died too: `sweep_freezers` (the next snapshot's preflight) thaws a freezer such a run left
frozen that was running, and `put_back_freezers` (the pass-through `resume` of that container,
containerd's resume of the task it paused) first puts back a pause the dead run had lifted, so
that the resume finds the container paused and containerd's shim sees it running after.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from . import children, procfs
from .children import run_captured
from .files import write_atomic
from .reasons import Reason, SnapguardError

__all__ = ["CRIU_BY_PATH", "Freezer", "FreezerGuard", "freezer", "put_back_freezers", "state", "sweep_freezers",
           "version"]

CRIU_BY_PATH = (1, 2, 0)  # from this runc on, CRIU is found through PATH only; `--criu` is ignored (1.4: refused)


def state(runc: str, root: str | None, container_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """`runc [--root R] state ID` as a dict with an int `pid`; CONTAINER_NOT_FOUND otherwise."""
    argv = [runc, *(["--root", root] if root else []), "state", container_id]
    out = run_captured(argv, timeout_s=timeout_s, what="runc state", reason=Reason.RUNC_TIMEOUT)
    evidence = {"container": container_id, "root": root}
    if out.returncode != 0:
        said = out.stderr.strip().splitlines()
        raise SnapguardError(Reason.CONTAINER_NOT_FOUND,
                             f"runc state {container_id}: {said[-1][:300] if said else f'exit {out.returncode}'}",
                             evidence=evidence)
    try:
        found = json.loads(out.stdout)
        found["pid"] = int(found["pid"])
    except (ValueError, KeyError, TypeError):
        raise SnapguardError(Reason.CONTAINER_NOT_FOUND, f"runc state {container_id} printed no pid",
                             evidence=evidence) from None
    return found


_VERSION = re.compile(r"^runc version (\d+)\.(\d+)\.(\d+)", re.M)


def version(runc: str, state_dir: str | None = None) -> tuple[int, int, int]:
    """The real runc's version, read once per binary (cached in the state dir under its inode,
    size and mtime): runc 1.2 and newer find CRIU only through PATH and ignore `--criu` (1.4
    rejects it), so what snapguard tells runc depends on it. (0, 0, 0) when runc does not say."""
    import hashlib
    import json
    import os

    from .files import ensure_private_dir, write_private_json
    from .trust import UntrustedPathError

    try:
        st = os.stat(runc)
    except OSError:
        return (0, 0, 0)
    key = hashlib.sha256(f"{runc}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    cache = os.path.join(state_dir, "runc-version.json") if state_dir else None
    if cache:
        try:
            fd = os.open(cache, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd) as f:
                known = json.loads(f.read(4096))
            if known.get("key") == key and len(known.get("version", [])) == 3:
                return tuple(int(v) for v in known["version"])  # type: ignore[return-value]
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    out = run_captured([runc, "--version"], timeout_s=10, what="runc --version", reason=Reason.RUNC_TIMEOUT,
                       start_reason=Reason.RUNC_UNUSABLE)
    m = _VERSION.search(out.stdout)
    found = (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else (0, 0, 0)
    if cache and m:
        try:
            ensure_private_dir(state_dir)  # type: ignore[arg-type]
            write_private_json(cache, {"key": key, "version": list(found)})
        except (OSError, UntrustedPathError):
            pass  # an unwritable cache only costs the next call a `runc --version`
    return found


# The control files a freezer record may name, by cgroup version: (thawed, frozen) values
FREEZER_VALUES = {"freezer.state": ("THAWED", "FROZEN"), "cgroup.freeze": ("0", "1")}
_CGROUP = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Freezer:
    """A cgroup's freezer: its control file and the (thawed, frozen) values it takes."""

    control: str

    def value(self, frozen: bool) -> str:
        return FREEZER_VALUES[os.path.basename(self.control)][int(frozen)]

    def frozen(self) -> bool | None:
        """Whether it is frozen (v1's FREEZING counts), None when it cannot be read (gone)."""
        try:
            fd = os.open(self.control, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                text = os.read(fd, 64).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
        except OSError:
            return None
        return text != self.value(False)

    def write(self, frozen: bool) -> bool:
        return _write(self.control, self.value(frozen))


def _write(control: str, value: str) -> bool:
    try:
        fd = os.open(control, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def _freezer_ok(control: str, value: str) -> bool:
    parts = control.split("/")
    return (control.startswith(_CGROUP + "/") and not {".", ".."} & set(parts) and
            not any(c in control for c in "\t\n\0") and value in FREEZER_VALUES.get(parts[-1], ()))


def freezer(pid: int) -> Freezer | None:
    """The freezer of pid's cgroup: v1's freezer hierarchy where there is one, else v2's
    cgroup.freeze; None where it has neither (gone, or no freezer)."""
    v2 = None
    for line in procfs.proc_text(pid, "cgroup").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if not path.startswith("/") or ".." in path.split("/"):
            continue
        if "freezer" in controllers.split(","):
            control = os.path.join(_CGROUP, "freezer", path.lstrip("/"), "freezer.state")
            if os.path.exists(control):
                return Freezer(control)
        elif controllers == "":
            control = os.path.join(_CGROUP, path.lstrip("/"), "cgroup.freeze")
            v2 = control if os.path.exists(control) else v2
    return Freezer(v2) if v2 else None


class FreezerGuard:
    """A container's freezer, put back as it was (`frozen`) should the executor die while a
    snapshot works on the container (see the module's docstring); `settle` puts it back itself."""

    def __init__(self, pid: int, container: str, root: str | None, frozen: bool) -> None:
        self.found = freezer(pid)
        self.frozen = frozen
        self.record: str | None = None
        if self.found is None:
            return
        value = self.found.value(frozen)
        start, directory = procfs.start_ticks(pid), children.records()
        if directory is not None and start is not None:
            self.record = os.path.join(directory, f"{children.FREEZER_PREFIX}{pid}-{start}.json")
            try:
                write_atomic(self.record, json.dumps({
                    "freezer": self.found.control, "value": value, "pid": pid, "start": start,
                    "container": container, "root": root, "executor": os.getpid(),
                    "executor_start": procfs.start_ticks(os.getpid()), "boot": procfs.boot_id()}).encode())
            except OSError:
                self.record = None  # the watchdog alone puts it back
        children.freezer_put_back(self.found.control, value, self.record)

    def thaw(self) -> bool:
        """Thawed (where runc's resume left it frozen: v1's FREEZING); whether it runs."""
        if self.found is None:
            return False
        return self.found.frozen() is False or (self.found.write(False) and self.found.frozen() is False)

    def settle(self) -> None:
        """The freezer as it was, where the container still is; nothing left to put back."""
        if self.found is None:
            return
        now = self.found.frozen()
        if now is not None and now != self.frozen:
            self.found.write(self.frozen)
        children.freezer_kept(self.found.control)
        if self.record is not None:
            try:
                os.unlink(self.record)
            except OSError:
                pass
            self.record = None


def _records(directory: str) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, "mine" | "left" | "stale") of each freezer record in `directory`: "mine"
    while its executor runs; "left" where an executor that died left it to put back; "stale"
    where there is nothing to (another boot, its container's init gone, not a record)."""
    found = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(children.FREEZER_PREFIX))
    except OSError:
        return found
    boot = procfs.boot_id()
    for name in names:
        path = os.path.join(directory, name)
        rec = children.read_record(path, ("pid", "start", "executor"))
        if rec is None or not (isinstance(rec.get("freezer"), str) and isinstance(rec.get("value"), str) and
                               name == f"{children.FREEZER_PREFIX}{rec['pid']}-{rec['start']}.json" and
                               _freezer_ok(rec["freezer"], rec["value"])):
            found.append((path, {}, "stale"))
        elif procfs.start_ticks(rec["executor"]) == rec.get("executor_start") is not None:
            found.append((path, rec, "mine"))
        elif rec.get("boot") == boot and procfs.start_ticks(rec["pid"]) == rec["start"]:
            found.append((path, rec, "left"))
        else:
            found.append((path, rec, "stale"))
    return found


def _put_back(path: str, rec: dict[str, Any], left: str) -> dict[str, Any] | None:
    try:
        os.unlink(path)
    except OSError:
        pass
    return {**rec, "put_back": True} if left == "left" and _write(rec["freezer"], rec["value"]) else None


def sweep_freezers(directory: str) -> list[dict[str, Any]]:
    """Thaw each freezer an executor that died left frozen where its container ran before (the
    records acted on); drop stale records. One that would freeze (a paused container the dead
    run thawed) is left to that container's resume: containerd may have resumed it since."""
    done = []
    for path, rec, left in _records(directory):
        if left == "mine" or (left == "left" and rec["value"] != FREEZER_VALUES[os.path.basename(rec["freezer"])][0]):
            continue
        put = _put_back(path, rec, left)
        if put is not None:
            done.append(put)
    return done


def put_back_freezers(directory: str, container: str, root: str | None) -> list[dict[str, Any]]:
    """Before `runc resume` of this container: a pause a dead executor lifted put back, so that
    the resume finds it paused (the records acted on); a record that would thaw is only dropped,
    the resume thaws. Never raises."""
    done = []
    for path, rec, left in _records(directory):
        if left != "mine" and rec.get("container") == container and rec.get("root") == root:
            thaws = rec.get("value") == FREEZER_VALUES.get(os.path.basename(rec.get("freezer", "")), ("",))[0]
            put = _put_back(path, rec, "stale" if thaws else left)
            if put is not None:
                done.append(put)
    return done
