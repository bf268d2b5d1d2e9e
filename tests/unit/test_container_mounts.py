"""snapguard.preflight.mounts: which of a container's mounts its spec does not account for.

The mount tables are mountinfo lines as the kernel writes them for a container's init (parsed by
snapguard.procfs), the specs as containerd's CRI and `runc spec` write them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from snapguard import procfs
from snapguard.preflight.mounts import unaccounted_mounts

# a CRI pod on cgroup v2 whose spec binds the host's /usr/local recursively: the host's
# /usr/local/nvidia (a mount of its own there) comes along
MOUNTINFO = """\
1385 1202 0:120 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
1386 1385 0:123 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1387 1385 0:124 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
1388 1387 0:125 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666
1389 1387 0:119 / /dev/mqueue rw,nosuid,nodev,noexec,relatime - mqueue mqueue rw
1390 1385 0:126 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro
1391 1390 0:27 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw
1392 1385 254:1 /var/lib/kubelet/pods/u/etc-hosts /etc/hosts rw,relatime - ext4 /dev/vda1 rw
1393 1387 254:1 /var/lib/kubelet/pods/u/containers/c/t /dev/termination-log rw,relatime - ext4 /dev/vda1 rw
1394 1385 254:1 /usr/local /usr/local ro,relatime - ext4 /dev/vda1 rw
1395 1394 254:16 / /usr/local/nvidia ro,relatime - xfs /dev/vdb rw
1396 1394 0:130 / /usr/local/scratch rw,relatime - tmpfs tmpfs rw
1397 1394 0:44 /sub /usr/local/part rw,relatime - tmpfs tmpfs rw
1398 1387 0:118 / /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k
1399 1386 0:123 /bus /proc/bus ro,nosuid,nodev,noexec,relatime - proc proc rw
1400 1386 0:124 /null /proc/kcore rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
1401 1386 0:131 / /proc/acpi ro,relatime - tmpfs tmpfs ro
"""

SPEC: dict[str, Any] = {
    "mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue"},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs"},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"},
        {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/kubelet/pods/u/etc-hosts",
         "options": ["rbind", "rprivate", "rw"]},
        {"destination": "/dev/termination-log", "type": "bind", "source": "/t", "options": ["rbind", "rw"]},
        {"destination": "/usr/local", "type": "bind", "source": "/usr/local", "options": ["rbind", "ro"]},
        {"destination": "/dev/shm", "type": "bind", "source": "/run/shm", "options": ["rbind", "rw"]},
    ],
    "linux": {"maskedPaths": ["/proc/acpi", "/proc/kcore"], "readonlyPaths": ["/proc/bus"]},
}


@pytest.fixture
def table(tmp_path: Path):
    def read(text: str) -> list[dict[str, Any]]:
        (tmp_path / "7").mkdir(exist_ok=True)
        (tmp_path / "7" / "mountinfo").write_text(text)
        got = procfs.mount_table(7, proc=str(tmp_path))
        assert got is not None
        return got
    return read


def test_a_submount_the_recursive_bind_brought_in_is_named_with_the_bind(table) -> None:
    found = unaccounted_mounts(table(MOUNTINFO), SPEC)
    # the xfs mount and the bind of part of a tmpfs; a whole tmpfs CRIU dumps itself
    assert [m["mount_point"] for m in found] == ["/usr/local/nvidia", "/usr/local/part"]
    assert found[0]["fstype"] == "xfs" and found[0]["came_with"]["destination"] == "/usr/local"


def test_the_submount_named_in_the_spec_is_accounted_for(table) -> None:
    spec = {**SPEC, "mounts": [*SPEC["mounts"],
                               {"destination": "/usr/local/nvidia", "type": "bind", "source": "/usr/local/nvidia",
                                "options": ["bind", "ro"]},
                               {"destination": "/usr/local/part/", "type": "bind", "source": "/x",
                                "options": ["bind"]}]}
    assert unaccounted_mounts(table(MOUNTINFO), spec) == []


def test_runc_masks_and_cgroup_v1_controllers_and_odd_specs(table, tmp_path: Path) -> None:
    v1 = ("10 1 0:5 / / rw - ext4 /dev/vda rw\n"
          "11 10 0:30 /sg-1 /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
          "12 10 254:1 /dev/pts/3 /dev/console rw - devpts devpts rw\n"
          "13 10 254:1 /opt /opt rw - ext4 /dev/vda rw\n")
    spec = {"mounts": [{"destination": "/sys/fs/cgroup", "type": "cgroup"}, "junk", {"destination": 3}],
            "linux": {"maskedPaths": "not a list"}}
    found = unaccounted_mounts(table(v1), spec)
    assert [m["mount_point"] for m in found] == ["/opt"] and found[0]["came_with"] is None
    assert procfs.mount_table(8, proc=str(tmp_path)) is None  # no such process
