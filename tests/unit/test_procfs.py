"""The process model: targets CRIU cannot take are typed before anything runs, on real processes
(a kernel thread, a zombie, a thread id) and on fixture trees; the procfs root is one setting."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from snapguard import procfs
from snapguard.reasons import Reason, SnapguardError
from tests.fake_proc import with_mountinfo


def _refusal(pid: int) -> Reason:
    with pytest.raises(SnapguardError) as e:
        procfs.process_tree(pid)
    assert "\n" not in str(e.value)
    return e.value.reason


def test_kernel_thread_is_refused() -> None:
    kthreadd = 2  # kthreadd: pid 2 in the root pid namespace
    assert procfs.proc_text(2, "comm").strip() == "kthreadd"
    assert _refusal(kthreadd) is Reason.KERNEL_THREAD


def test_zombie_is_refused() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while procfs.process_state(proc.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)  # exited, not reaped: a zombie until wait()
    try:
        assert _refusal(proc.pid) is Reason.ZOMBIE_PROCESS
    finally:
        proc.wait()


def test_thread_id_is_refused() -> None:
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def run() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        done.wait()

    t = threading.Thread(target=run)
    t.start()
    try:
        ready.wait()
        assert tid[0] != os.getpid()
        with pytest.raises(SnapguardError) as e:
            procfs.process_tree(tid[0])
        assert e.value.reason is Reason.NOT_THREAD_GROUP_LEADER
        assert e.value.failure.evidence["tgid"] == os.getpid()
    finally:
        done.set()
        t.join()


def test_absent_and_nonpositive_pids() -> None:
    assert _refusal(0) is Reason.PROCESS_NOT_FOUND
    assert _refusal(-5) is Reason.PROCESS_NOT_FOUND
    assert _refusal(2 ** 22 + 17) is Reason.PROCESS_NOT_FOUND


def test_one_procfs_root_for_every_read(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    (root / "4242" / "task" / "4242").mkdir(parents=True)
    (root / "4242" / "task" / "4242" / "children").write_text("")
    (root / "4242" / "stat").write_text("4242 (a (b) c) S 1 4242 4242 0 -1 4194560 0\n")
    (root / "4242" / "status").write_text("Name:\ta (b) c\nTgid:\t4242\nNSpid:\t4242\t7\nPPid:\t1\n"
                                          "Uid:\t1000\t1001\t1002\t1003\n")
    with procfs.using_procfs(str(root)):
        assert procfs.procfs_path() == str(root)
        assert procfs.process_tree(4242) == [4242]
        assert procfs.nspid(4242) == 7
        assert procfs.euid(4242) == 1001 and procfs.euid(4243) is None  # the effective one; gone
        assert procfs.process_state(4242) == "S"
        assert procfs.alive(4242) and not procfs.alive(4243)
        assert procfs.start_ticks(4242) is None  # a stat line cut short says no start
    assert procfs.procfs_path() == "/proc"
    assert procfs.process_state(4242, proc=str(root)) == "S"


def test_ordinary_process_is_a_valid_target() -> None:
    assert procfs.process_tree(os.getpid())[0] == os.getpid()


def test_a_process_start_names_it_apart_from_a_later_one_with_its_pid(tmp_path: Path) -> None:
    """start_ticks is /proc/PID/stat's field 22 (counted with the comm, which may hold spaces and
    parentheses), the same at every read; a zombie is not alive."""
    root = tmp_path / "proc"
    (root / "77").mkdir(parents=True)
    fields = ["Z", "1"] + [str(n) for n in range(5, 22)] + ["123456", "0"]
    (root / "77" / "stat").write_text("77 (x) y) z) " + " ".join(fields) + "\n")
    assert procfs.start_ticks(77, proc=str(root)) == 123456 and not procfs.alive(77, proc=str(root))
    own = procfs.start_ticks(os.getpid())
    assert isinstance(own, int) and own == procfs.start_ticks(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert procfs.start_ticks(child.pid) is None and not procfs.alive(child.pid)


def test_node_scans_and_running_start(tmp_path: Path) -> None:
    """The scans the agent makes: processes naming an argument (never this one), a start time only
    for a process that runs (a zombie's is None), whether /proc/PID is there; and the boot id."""
    root = tmp_path / "proc"
    for pid, state, argv in ((77, "Z", b"criu\0dump\0--images-dir\0/img\0"), (78, "S", b"runc\0/img\0"),
                             (79, "S", b"runc\0/img2\0"), (os.getpid(), "S", b"me\0/img\0")):
        (root / str(pid)).mkdir(parents=True)
        fields = [state, "1"] + [str(n) for n in range(5, 22)] + ["4242", "0"]
        (root / str(pid) / "stat").write_text(f"{pid} (x) " + " ".join(fields) + "\n")
        (root / str(pid) / "cmdline").write_bytes(argv)
    (root / "self").mkdir()
    proc = str(root)
    assert sorted(procfs.with_argument("/img", proc)) == [77, 78]
    assert procfs.cmdline(79, proc) == [b"runc", b"/img2", b""] and procfs.cmdline(80, proc) is None
    assert procfs.running_start_ticks(78, proc) == 4242 and procfs.running_start_ticks(77, proc) is None
    assert procfs.start_ticks(77, proc) == 4242 and procfs.running_start_ticks(80, proc) is None
    assert procfs.exists(77, proc) and not procfs.exists(80, proc)
    assert procfs.self_fd(3, proc) == f"{proc}/self/fd/3"
    assert procfs.running_start_ticks(os.getpid()) == procfs.start_ticks(os.getpid())
    boot = procfs.boot_id()
    assert boot is not None and len(boot) == 36 and procfs.boot_id(proc) is None

def test_a_paths_mount_is_the_last_on_the_longest_mount_point_holding_it(tmp_path: Path) -> None:
    """mountinfo's mount point (octal escapes undone) and the filesystem's own options, after
    the " - " separator; a mount stacked on another at the same point wins; a lookalike prefix
    (/run/ab against /run/a) does not hold the path. And the real one: / holds everything."""
    root = with_mountinfo(
        tmp_path,
        "1 0 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw",
        "2 1 0:5 / /run rw,nosuid shared:2 - tmpfs tmpfs rw,size=100k,mode=755",
        "3 2 0:6 / /run/a rw shared:3 - tmpfs tmpfs rw,size=4k",
        "4 3 0:7 / /run/a rw shared:4 master:9 - tmpfs spill rw,size=8k,huge=within_size",
        "5 2 0:8 / /run/with\\040space rw - tmpfs x rw",
        "6 2 0:9 / /run/blank rw - tmpfs  rw,huge=advise",  # an empty source
        "garbage line")
    with procfs.using_procfs(str(root)):
        got = procfs.mount_of("/run/a/f")
        assert got == {"id": "4", "dev": "0:7", "root": "/", "mount_point": "/run/a", "fstype": "tmpfs",
                       "options": {"rw": "", "size": "8k", "huge": "within_size"}}
        assert procfs.mount_of("/run/ab")["mount_point"] == "/run"  # type: ignore[index]
        assert procfs.mount_of("/run/with space/x")["mount_point"] == "/run/with space"  # type: ignore[index]
        assert procfs.mount_of("/etc")["fstype"] == "ext4"  # type: ignore[index]
        assert procfs.mount_of("/run/blank/f")["options"]["huge"] == "advise"  # type: ignore[index]
        chain = procfs.mounts_on_path("/run/a/f")
        assert [(m["mount_point"], m["options"].get("size")) for m in chain or []] == \
            [("/", None), ("/run", "100k"), ("/run/a", "8k")]
    assert procfs.mount_of("/", proc=str(tmp_path / "nothing")) is None
    real = procfs.mount_of("/proc/self")
    assert real is not None and real["fstype"] == "proc"


def test_mount_here_finds_a_containers_bind_mount_where_this_namespace_reaches_it(tmp_path: Path) -> None:
    """A directory a container has mounted (pid 42's mountinfo) is reached here where the same
    filesystem (device and type) is mounted at a root holding the mount's root: a bind of a host
    tmpfs's subdirectory maps under the host's mount of that tmpfs (the mount whose root is
    nearest wins); the container's own tmpfs (a device mounted nowhere here), a mount point the
    container does not have, a filesystem here only under something mounted over it, and another
    type on the same device number map to nothing. And the real one: this process's own /."""
    root = with_mountinfo(
        tmp_path,
        "1 0 8:1 / / rw - ext4 /dev/vda rw",
        "2 1 0:30 / /run/snapguard-spill rw - tmpfs spill rw,huge=within_size",
        "3 1 0:30 /pods /srv/pods rw - tmpfs spill rw,huge=within_size",
        "4 1 0:31 / /dev/shm rw - tmpfs shm rw",
        "5 1 0:33 / /hidden rw - tmpfs h rw",
        "6 1 0:34 / /hidden rw - tmpfs over rw",  # stacked over 5
        "7 1 0:35 / /var/lib/x rw - ext4 /dev/vdb rw")
    (root / "42").mkdir()
    (root / "42" / "mountinfo").write_text("\n".join([
        "100 99 8:2 / / rw - overlay overlay rw",
        "101 100 0:30 /pods/p1 /run/snapguard-spill rw - tmpfs spill rw,huge=within_size",
        "102 100 0:40 / /dev/shm rw - tmpfs shm rw,size=65536k",  # its own
        "103 100 0:31 /with\\040space /data rw - tmpfs shm rw",
        "104 100 0:33 / /h rw - tmpfs h rw",
        "105 100 0:35 / /t rw - tmpfs t rw",  # the device number of an ext4 here, another type
    ]) + "\n")
    proc = str(root)
    assert procfs.mount_here(42, "/run/snapguard-spill", proc) == "/srv/pods/p1"  # nearer than /run/snapguard-spill/pods/p1
    assert procfs.mount_here(42, "/data", proc) == "/dev/shm/with space"
    assert procfs.mount_here(42, "/dev/shm", proc) is None
    assert procfs.mount_here(42, "/run", proc) is None
    assert procfs.mount_here(42, "/h", proc) is None
    assert procfs.mount_here(42, "/t", proc) is None
    assert procfs.mount_here(43, "/run/snapguard-spill", proc) is None  # gone
    assert procfs.mount_here(os.getpid(), "/") == "/"
