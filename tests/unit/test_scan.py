"""The C helper and the pure-Python scanner: same results, on real processes and a churning /proc.
(A planted device node, which needs root to make, is in tests/system/test_root_scan.py.)"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapguard import procfs
from snapguard.preflight import scan


def test_the_c_helper_is_built() -> None:
    """`pip install -e .` builds it (a compiler is in the dev setup): every comparison below needs it."""
    assert scan.have_c_helper(), "snapguard/_procscan is not built: pip install -e . with a C compiler"


def _by_pid(matches: list[scan.Match] | set[scan.Match]) -> dict[int, list[scan.Match]]:
    out: dict[int, list[scan.Match]] = {}
    for m in sorted(matches):
        out.setdefault(m.pid, []).append(m)
    return out


@pytest.fixture
def sleepers() -> Iterator[set[int]]:
    """Four processes that hold still through a test, whatever else the node runs (a CI container
    may run only the test's own): each maps libc under /usr/lib and holds /dev/null and a pipe."""
    read_end, write_end = os.pipe()
    procs = [subprocess.Popen(["/bin/sleep", "120"], stdin=subprocess.DEVNULL, pass_fds=(read_end, write_end))
             for _ in range(4)]
    try:
        deadline = time.monotonic() + 10
        # Sleeping (S) means the loader has mapped everything and nanosleep has begun.
        while not all(procfs.process_state(p.pid) == "S" for p in procs):
            assert time.monotonic() < deadline, "sleepers did not settle"
            time.sleep(0.01)
        yield {p.pid for p in procs}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        os.close(read_end)
        os.close(write_end)


def _quiet_pids(*scans: list[scan.Match]) -> set[int]:
    """The pids every scan saw alike, less this process: a process that started, exec'd or mapped
    something between two scans of the node (any tool's on a shared machine) cannot be compared,
    whatever the scanners do."""
    per = [_by_pid(x) for x in scans]
    pids = set.intersection(*(set(p) for p in per)) - {os.getpid()}
    return {pid for pid in pids if all(p[pid] == per[0][pid] for p in per[1:])}


def test_c_and_python_agree_on_whole_node(sleepers: set[int]) -> None:
    prefixes = ("/dev/", "anon_inode:", "socket:", "pipe:", "/usr/lib", "/tmp")
    pids = scan.all_pids()
    # C before and after Python: the processes the two C scans saw alike held still meanwhile
    before = scan.scan(pids, prefixes, (1, 5, 136), impl="c")
    py = scan.scan(pids, prefixes, (1, 5, 136), impl="python")
    after = scan.scan(pids, prefixes, (1, 5, 136), impl="c")
    quiet = _quiet_pids(before, after)
    assert len(before) > 20 and sleepers <= quiet
    assert all(any(m.pid == pid and m.path == "/dev/null" for m in py) for pid in sleepers)
    assert {m for m in before if m.pid in quiet} == {m for m in py if m.pid in quiet}


def test_vanishing_processes_are_skipped() -> None:
    """Children exit while both scanners run over their pids: no error, only live matches."""
    stop = threading.Event()
    spawned: list[int] = []

    def churn() -> None:
        while not stop.is_set():
            procs = [subprocess.Popen(["/bin/sleep", "0.0%d" % (i % 5)]) for i in range(20)]
            spawned.extend(p.pid for p in procs)
            for p in procs:
                p.wait()

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(30):
            pids = scan.all_pids() + spawned[-40:] + [2**22 + 1]  # plus one that never existed
            scan.scan(pids, ("/dev/", "anon_inode:"), (1,), impl="c")
            scan.scan(pids, ("/dev/", "anon_inode:"), (1,), impl="python")
    finally:
        stop.set()
        t.join()
    assert len(spawned) > 40


def test_small_buffer_grows(sleepers: set[int]) -> None:
    """Every mapping and fd of the node (> 1 MiB of output on most nodes) comes back whole: the
    C helper's output buffer grows, and it agrees with the Python scanner on every quiet process."""
    pids = scan.all_pids()
    before = scan.scan_c(pids, ("/",), ())
    py = scan.scan(pids, ("/",), (), impl="python")
    after = scan.scan_c(pids, ("/",), ())
    quiet = _quiet_pids(before, after)
    assert sleepers <= quiet
    assert sorted(m for m in before if m.pid in quiet) == sorted(m for m in py if m.pid in quiet)


def test_fixture_proc_root(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "7" / "fd").mkdir(parents=True)
    (proc / "7" / "maps").write_text(
        "7f0000000000-7f0000001000 rw-s 00000000 00:05 12 /dev/nvidia0\n"
        "7f0000002000-7f0000003000 r-xp 00000000 08:01 99 /usr/lib/libcuda.so.580\n"
        "7f0000004000-7f0000005000 rw-p 00000000 00:00 0 \n")
    os.symlink("/dev/nvidiactl", proc / "7" / "fd" / "3")
    os.symlink("anon_inode:[io_uring]", proc / "7" / "fd" / "4")
    expect = {("m", "/dev/nvidia0"), ("f3", "/dev/nvidiactl"), ("f4", "anon_inode:[io_uring]")}
    for impl in ("c", "python"):
        got = scan.scan([7, 8], proc=str(proc), impl=impl)
        assert {(m.kind, m.path) for m in got} == expect, impl


def test_thread_count_does_not_change_results(sleepers: set[int]) -> None:
    pids = scan.all_pids()
    prefixes = ("/dev/", "anon_inode:", "socket:", "/usr/lib")
    one = scan.scan_c(pids, prefixes, (1, 136), threads=1)
    assert len(one) > 20
    runs = {threads: scan.scan_c(pids, prefixes, (1, 136), threads=threads) for threads in (2, 3, 7, len(pids) + 5)}
    quiet = _quiet_pids(one, scan.scan_c(pids, prefixes, (1, 136), threads=1))
    assert sleepers <= quiet
    for threads, many in runs.items():
        assert [m for m in many if m.pid in quiet] == [m for m in one if m.pid in quiet], threads
