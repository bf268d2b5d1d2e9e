"""Mounts as a process sees them (its mountinfo): the chain a path's lookup goes through, and
where a container's mount is reached from this mount namespace."""

from __future__ import annotations

import os
import re
from typing import Any

from ._root import read as _read, root as _root, vanishing as _vanishing

__all__ = ["mount_here", "mount_of", "mount_table", "mounts_on_path"]


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(text: str) -> list[dict[str, Any]]:
    """mountinfo's lines, in its order: {"id", "dev" ("major:minor"), "root" (the directory of the
    filesystem mounted there), "mount_point", "fstype", "options": {name: value or ""}} with the
    filesystem's own options (tmpfs's huge=, size=); lines that are not mountinfo's skipped."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split(" ")  # a mount's source may be empty
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        options = dict((o.partition("=")[0], o.partition("=")[2]) for o in tail[2].split(","))
        out.append({"id": fields[0], "dev": fields[2], "root": _unescape(fields[3]),
                    "mount_point": _unescape(fields[4]), "fstype": tail[0], "options": options})
    return out


def _chain(mounts: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    on: dict[str, dict[str, Any]] = {}
    for m in mounts:
        point = m["mount_point"]
        if path == point or path.startswith(point.rstrip("/") + "/"):
            on[point] = m  # the last one stacked
    return [on[point] for point in sorted(on, key=len)]


def mounts_on_path(path: str, proc: str | None = None, pid: int | None = None) -> list[dict[str, Any]] | None:
    """The mounts a lookup of `path` (absolute, canonical, no component a link) goes through, as
    this process sees them (its /proc/self/mountinfo; `pid`'s, in its mount namespace), from / to
    the one `path` is on: for each mount point on the way, the last mount there. Each is as
    `_mounts` gives it ({"mount_point", "fstype", "options", ...}). None when mountinfo cannot be
    read. Read from mountinfo only: no filesystem on the way is touched."""
    text = _vanishing(lambda: _read(f"{_root(proc)}/{'self' if pid is None else pid}/mountinfo"), None)
    return None if text is None else _chain(_mounts(text), path)


def mount_table(pid: int, proc: str | None = None) -> list[dict[str, Any]] | None:
    """Every mount of pid's mount namespace as pid sees it (its mountinfo, in order, as `_mounts`
    gives them; mount points relative to pid's root). None when mountinfo cannot be read."""
    text = _vanishing(lambda: _read(f"{_root(proc)}/{pid}/mountinfo"), None)
    return None if text is None else _mounts(text)


def mount_here(pid: int, mount_point: str, proc: str | None = None) -> str | None:
    """Where this process reaches the directory that pid (in another mount namespace: a
    container's) has mounted at `mount_point`: the path, in this process's namespace, of that
    mount's root, found where the same filesystem (device) is mounted here at a root that holds
    it, and nothing is mounted over the way to it. A bind mount of a host directory into a
    container is found so; a filesystem mounted only in pid's namespace (its own tmpfs) is not.
    None when there is none, or mountinfo cannot be read. Read from mountinfo only."""
    root = _root(proc)
    theirs = _vanishing(lambda: _read(f"{root}/{pid}/mountinfo"), None)
    mine = _vanishing(lambda: _read(f"{root}/self/mountinfo"), None)
    if theirs is None or mine is None:
        return None
    on = _chain(_mounts(theirs), mount_point)
    # the last mount at that point (mountinfo's order cannot tell one mounted later over a
    # directory above it: the caller compares the directories themselves), of a source that still
    # exists (the kernel shows a removed one's root as ".../name//deleted")
    if not on or on[-1]["mount_point"] != mount_point or on[-1]["root"].endswith("//deleted"):
        return None
    there, here = on[-1], _mounts(mine)
    found = None
    for m in here:
        inside = m["root"].rstrip("/") + "/"
        if m["dev"] != there["dev"] or m["fstype"] != there["fstype"] or \
                not (there["root"] == m["root"] or there["root"].startswith(inside)):
            continue
        path = os.path.normpath(m["mount_point"].rstrip("/") + "/" + there["root"][len(m["root"]):].lstrip("/"))
        chain = _chain(here, path)
        if chain and chain[-1]["id"] == m["id"] and (found is None or len(m["root"]) > len(found[0])):
            found = (m["root"], path)  # the mount whose root is nearest theirs
    return found[1] if found else None


def mount_of(path: str, proc: str | None = None) -> dict[str, Any] | None:
    """The mount `path` is on (the last of `mounts_on_path`); None when that cannot be told."""
    chain = mounts_on_path(path, proc)
    return chain[-1] if chain else None
