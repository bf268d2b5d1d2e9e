"""runc bundles whose rootfs is bind mounts of the host's own directories (nothing pulled), and
the release of mounts a restore can leave under a bundle."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

__all__ = ["RUNC", "host_bundle", "release_mounts"]

RUNC = "/usr/sbin/runc"


def _mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    with open(mountinfo) as f:
        # the fifth field, with mountinfo's octal escapes (\040 for a space) decoded
        return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]


def release_mounts(path: Path) -> list[str]:
    """Lazily unmount every mount at or below `path`, deepest first; the mount points released.

    A bundle's rootfs can be left with mounts after a restore; removing the directory tree then
    would go through them into the host's own directories."""
    top = str(path).rstrip("/")
    below = [m for m in _mount_points() if m == top or m.startswith(top + "/")]
    for m in sorted(below, key=lambda m: m.count("/"), reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True, check=False)
    return below


def _with_submounts(dirs: list[str]) -> list[str]:
    """The directories, each followed by the mount points below it, parents before children."""
    points = _mount_points()
    out: list[str] = []
    for d in dirs:
        below = sorted({m for m in points if m.startswith(d.rstrip("/") + "/") and os.path.exists(m)},
                       key=lambda m: (m.count("/"), m))
        out += [d, *below]
    return out


def host_bundle(bundle: Path, args: list[str], env: list[str], host_dirs: list[str], *,
                writable: dict[str, str] | None = None, devices: list[str] | None = None,
                runc: str = RUNC) -> Path:
    """A runc bundle whose rootfs binds the host's own directories read-only (nothing pulled).

    `writable` maps container paths to host directories bound read-write; `devices` are host
    character devices (the GPU's /dev/nvidia*) bound at the same path and allowed in the device
    cgroup. The container stays in the host's network namespace: gloo talks over loopback, and a
    new namespace has lo down and would need iptables for CRIU's network lock.
    """
    rootfs = bundle / "rootfs"
    for d in ["proc", "dev", "sys", "tmp", "run/snapguard/take"]:
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    binds: list[str] = []
    # parents first, so a directory inside another bound one (a venv inside the repository) is
    # skipped: runc restore mounts such nested binds in the host's namespace and leaves them there
    for d in sorted(host_dirs, key=lambda p: p.rstrip("/").count("/")):
        if any(d == b or d.startswith(b.rstrip("/") + "/") for b in binds):
            continue  # already inside a bound directory
        inside = rootfs / d.lstrip("/")
        inside.parent.mkdir(parents=True, exist_ok=True)
        # merged-/usr hosts have /lib, /bin... as symlinks: the same links in the rootfs, real
        # directories bound (CRIU cannot restore a bind mount of a symlink)
        if os.path.islink(d):
            if not inside.is_symlink():
                inside.symlink_to(os.readlink(d))
        elif os.path.isdir(d):
            inside.mkdir(parents=True, exist_ok=True)
            binds.append(d)
    subprocess.run([runc, "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"]["readonly"] = False
    spec["process"].update(terminal=False, cwd="/", args=args, env=env)
    # Each mount under a bound directory (the driver's /usr/local/nvidia on the GPU machines) gets
    # a bind of its own: runc hands CRIU every spec bind as external, while a recursive bind's
    # submounts would be dumped, and CRIU cannot dump every filesystem.
    spec["mounts"] += [{"destination": d, "type": "bind", "source": d, "options": ["bind", "ro"]}
                       for d in _with_submounts(binds)]
    for inside_path, host in (writable or {}).items():
        (rootfs / inside_path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        spec["mounts"].append({"destination": inside_path, "type": "bind", "source": host, "options": ["rbind", "rw"]})
    allowed = spec["linux"]["resources"].setdefault("devices", [])
    for dev in devices or []:
        st = os.stat(dev)
        spec["mounts"].append({"destination": dev, "type": "bind", "source": dev, "options": ["bind", "rw"]})
        allowed.append({"allow": True, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev),
                        "access": "rwm"})
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle
