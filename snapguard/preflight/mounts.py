"""A container's mounts against its OCI spec: a mount CRIU cannot dump, refused before the dump.

runc's checkpoint hands CRIU each bind mount of the spec (config.json's `mounts`) as an external
mount, and CRIU dumps the rest of the container's mount tree itself: whole mounts of the virtual
filesystems it knows (proc, sysfs, tmpfs, devpts, mqueue, cgroup ...), remade at restore. A mount
that is neither (a submount a recursive bind, `rbind`, brought in with a host directory: the host's
/usr/local/nvidia under a bind of /usr/local, say) fails CRIU's dump with `mnt: FS mnt ./PATH ...
unsupported`, after the take point, the CUDA lock and the freeze. This check refuses it first,
MOUNT_NOT_IN_SPEC naming the mount point.

What is compared: the container init's mounts (its /proc/PID/mountinfo, through snapguard.procfs;
mount points relative to the container's root) with the spec of its bundle (`runc state`'s
`bundle`, config.json read through snapguard.trust). A mount is accounted for when its point is `/`
(the rootfs), a spec mount's destination, one of the spec's `linux.maskedPaths` or
`linux.readonlyPaths` (runc's masks and read-only binds), `/dev/console`, or below a spec mount of
type cgroup (cgroup v1's controllers); else when it is a whole mount (root `/`) of a filesystem
CRIU dumps itself (`CRIU_DUMPS`). Destinations are compared as the spec writes them: a destination
through a symlink inside the container is not resolved.

A bundle whose config.json cannot be read (not root's, not JSON) is a warning: CRIU still refuses
what it cannot dump, only later.
"""

from __future__ import annotations

import json
import os
import posixpath
from typing import Any

from .. import procfs, runc
from ..reasons import Finding, Reason, Severity
from ..trust import UntrustedPathError, open_trusted

__all__ = ["CRIU_DUMPS", "check_container_mounts", "unaccounted_mounts"]

CRIU_DUMPS = frozenset({"proc", "sysfs", "tmpfs", "devtmpfs", "devpts", "mqueue", "cgroup", "cgroup2",
                        "securityfs", "debugfs", "tracefs", "pstore", "fusectl", "binfmt_misc", "hugetlbfs", "bpf"})
MAX_SPEC_BYTES = 4 << 20


def _clean(path: Any) -> str | None:
    if not isinstance(path, str) or not path.startswith("/"):
        return None
    return posixpath.normpath(path).replace("//", "/")


def _under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def unaccounted_mounts(mounts: list[dict[str, Any]], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The mounts of `mounts` (procfs mountinfo entries) the spec does not account for (see the
    module's docstring), each with `came_with`: the nearest spec mount above it, if any."""
    listed = spec.get("mounts")
    spec_mounts = [m for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
    linux = spec.get("linux") if isinstance(spec.get("linux"), dict) else {}
    named = {"/", "/dev/console"}
    cgroups = []
    for m in spec_mounts:
        dest = _clean(m.get("destination"))
        if dest is not None:
            named.add(dest)
            if m.get("type") in ("cgroup", "cgroup2"):
                cgroups.append(dest)
    for key in ("maskedPaths", "readonlyPaths"):
        paths = linux.get(key)
        named.update(p for p in (_clean(x) for x in (paths if isinstance(paths, list) else [])) if p is not None)
    out = []
    for m in mounts:
        point = _clean(m.get("mount_point"))
        if point is None or point in named or any(_under(point, c) for c in cgroups):
            continue
        if m.get("fstype") in CRIU_DUMPS and m.get("root") == "/":
            continue
        above = [s for s in spec_mounts if (d := _clean(s.get("destination"))) and d != "/" and _under(point, d)]
        came = max(above, key=lambda s: len(str(s.get("destination"))), default=None)
        out.append({**m, "came_with": came})
    return out


def _read_spec(bundle: str) -> dict[str, Any]:
    fd = open_trusted(os.path.join(bundle, "config.json"), "file")
    try:
        data = os.read(fd, MAX_SPEC_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SPEC_BYTES:
        raise ValueError(f"larger than {MAX_SPEC_BYTES >> 20} MiB")
    spec = json.loads(data)
    if not isinstance(spec, dict):
        raise ValueError("not a JSON object")
    return spec


def _detail(m: dict[str, Any]) -> str:
    came = m.get("came_with")
    what = f"{m['mount_point']} ({m.get('fstype')}, root {m.get('root')}, device {m.get('dev')})"
    if came is None:
        return f"{what} is not a mount of the container's spec"
    opts = [o for o in came.get("options") or [] if isinstance(o, str)]
    how = "the recursive bind (rbind)" if "rbind" in opts else "the mount"
    return (f"{what} is not a mount of the container's spec: it came in with {how} of {came.get('source')} "
            f"at {came.get('destination')}")


def check_container_mounts(pid: int, runc_path: str, root: str | None, container_id: str) -> list[Finding]:
    """MOUNT_NOT_IN_SPEC for each mount of container `container_id` (init `pid`) CRIU could not
    dump (see the module's docstring)."""
    state = runc.state(runc_path, root, container_id)
    bundle = state.get("bundle")
    if not isinstance(bundle, str) or not bundle.startswith("/"):
        return [Finding(Reason.PREFLIGHT_FAILED, f"runc state {container_id} names no bundle: its mounts were not "
                        "compared with its spec", Severity.WARNING, {"container": container_id})]
    try:
        spec = _read_spec(bundle)
    except (UntrustedPathError, OSError, ValueError) as e:
        return [Finding(Reason.PREFLIGHT_FAILED, f"{bundle}/config.json cannot be used ({e}): the container's mounts "
                        "were not compared with its spec", Severity.WARNING, {"bundle": bundle})]
    mounts = procfs.mount_table(pid)
    if mounts is None:
        return [Finding(Reason.PREFLIGHT_FAILED, f"the mounts of pid {pid} cannot be read: they were not compared "
                        "with its spec", Severity.WARNING, {"pid": pid})]
    return [Finding(Reason.MOUNT_NOT_IN_SPEC, _detail(m),
                    evidence={"pid": pid, "container": container_id, "mount_point": m["mount_point"],
                              "fstype": m.get("fstype"), "root": m.get("root"), "dev": m.get("dev"),
                              "came_with": (m.get("came_with") or {}).get("destination")})
            for m in unaccounted_mounts(mounts, spec)]
