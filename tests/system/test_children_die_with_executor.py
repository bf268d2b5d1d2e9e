"""A killed executor ends what it started: a stand-in executor (a real Python process) runs a real
child through snapguard.children, is killed with SIGKILL, and the child (in a process group of its
own, so no group kill reaches it) is gone within a second. And the real thing: `snapguard-runc
checkpoint` of a real runc container, SIGKILLed while runc's CRIU dumps it; neither runc nor CRIU
(runc's own child, which no parent-death signal of ours reaches, and which would go on dumping for
seconds) is left half a second later. And a container CRIU froze (it freezes the cgroup while it
seizes the tree) when the executor was killed runs again at once: the watchdog thaws it; killed
with its watchdog and runc's group too, the next checkpoint's sweep thaws it from the record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXECUTOR = """
from snapguard import children
from snapguard.reasons import Reason
children.run(["/bin/sleep", "60"], timeout_s=60, what="a stand-in child", reason=Reason.INTERNAL_ERROR)
"""


def _children(pid: int) -> list[int]:
    """Every thread's children: runc is Go, and it starts CRIU from whichever thread runs the call
    (a tree walk that read the main thread's alone missed the dumping CRIU now and then)."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):  # gone, or exiting (ESRCH while it is reaped)
        return []
    for tid in tids:
        try:
            kids += [int(p) for p in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone, or exiting (ESRCH while it is reaped)
        return False


def test_a_child_dies_with_its_killed_executor() -> None:
    executor = subprocess.Popen([sys.executable, "-c", EXECUTOR], cwd=str(Path(__file__).resolve().parents[2]))
    child = None
    try:
        deadline = time.monotonic() + 20
        while child is None:
            assert time.monotonic() < deadline and executor.poll() is None, "the stand-in did not start its child"
            kids = _children(executor.pid)
            child = kids[0] if kids else None
            time.sleep(0.02)
        time.sleep(0.2)  # exec'd
        os.kill(executor.pid, signal.SIGKILL)
        executor.wait()
        deadline = time.monotonic() + 1.0
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child), f"child {child} outlived its killed executor"
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
        if executor.poll() is None:
            executor.kill()


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for kid in _children(todo.pop()):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _run_container(runc: str, root: Path, bundle: Path, cid: str, ready: Path) -> None:
    """`runc run --detach` the bundle, then wait for the workload to touch `ready`."""
    assert subprocess.run([runc, "--root", str(root), "run", "--detach", "--bundle", str(bundle), cid],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=60).returncode == 0
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "the container did not start"
        time.sleep(0.05)


@pytest.mark.root
@pytest.mark.parametrize("runc", ["/usr/sbin/runc", "/opt/snapguard/compat/bin/runc"], ids=["runc-1.1", "runc-1.3"])
def test_runc_and_criu_die_with_a_killed_snapguard_runc(tmp_path: Path, runc: str) -> None:
    if not os.path.exists(runc):
        pytest.fail(f"{runc} is missing: packaging/install-deps.sh installs it")
    if os.geteuid() != 0:
        pytest.fail("runc containers need root")
    # an attempt whose checkpoint ended before its dump was seen tells nothing: another, with more
    # memory to dump (a longer dump); three that tell nothing fail
    tried = []
    for attempt, gib in enumerate((2, 3, 4)):
        seen = _kill_executor_while_runc_dumps(tmp_path / f"try{attempt}", runc, gib)
        if seen is None:
            return
        tried.append(seen)
    pytest.fail(f"no CRIU of runc's seen dumping under the executor in {len(tried)} attempts: {tried}")


def _kill_executor_while_runc_dumps(tmp_path: Path, runc: str, gib: int) -> dict[int, str] | None:
    """SIGKILL snapguard-runc while runc's CRIU dumps a container with `gib` GiB of touched memory;
    asserts that runc and CRIU died with it. None when it was so; what was seen under the executor
    when its checkpoint ended before the dump could be seen."""
    from snapguard_lab.bundles import host_bundle, release_mounts

    tmp_path.mkdir()
    args = ["/usr/bin/python3", "-c", f"import time; a = b'x' * ({gib} << 30); open('/out/ready', 'w').close(); "
            "time.sleep(600)"]
    out = tmp_path / "out"
    out.mkdir()
    bundle = host_bundle(tmp_path / "bundle", args, ["PATH=/usr/bin:/bin"], ["/usr", "/lib", "/lib64", "/bin", "/etc"],
                         writable={"/out": str(out)}, runc=runc)
    root, cid = tmp_path / "runc", f"die-{os.getpid()}-{gib}"
    env = {**os.environ, "SNAPGUARD_STATE_DIR": str(tmp_path / "state"), "SNAPGUARD_RUNC": runc}
    executor_argv = [os.path.join(os.path.dirname(sys.executable), "snapguard-runc"), "--root", str(root)]
    seen: dict[int, str] = {}

    def dumping(seen: dict[int, str]) -> bool:
        return any(c == "criu" and seen.get(_ppid(p)) == "runc" and _alive(p) for p, c in seen.items()) and \
            any((tmp_path / "image").glob("*.img"))

    try:
        _run_container(runc, root, bundle, cid, out / "ready")
        executor = subprocess.Popen([*executor_argv, "checkpoint", "--image-path", str(tmp_path / "image"),
                                     "--work-path", str(tmp_path / "work"), cid], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not dumping(seen):  # runc's own CRIU (not a probe of the executor's), its image begun
            if executor.poll() is not None:
                assert executor.returncode == 0, f"the checkpoint failed (exit {executor.returncode}, saw {seen})"
                return seen  # done before its dump was seen
            assert time.monotonic() < deadline, f"no CRIU of runc's seen dumping under the executor (saw {seen})"
            seen.update({p: _comm(p) for p in _descendants(executor.pid)})
            time.sleep(0.002)
        seen.update({p: _comm(p) for p in _descendants(executor.pid)})
        os.kill(executor.pid, signal.SIGKILL)
        executor.wait()
        ours = {p: c for p, c in seen.items() if c in ("runc", "criu", "runc:[2:INIT]") or c.startswith("runc")}
        deadline = time.monotonic() + 0.5  # CRIU left alone would go on dumping for seconds
        while any(_alive(p) for p in ours) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {p: c for p, c in ours.items() if _alive(p)}
        assert not left, f"left behind a killed snapguard-runc: {left}"
        return None
    finally:
        for p in seen:
            if _alive(p) and _comm(p) in ("criu", "runc"):
                os.kill(p, signal.SIGKILL)
        subprocess.run([runc, "--root", str(root), "delete", "--force", cid], capture_output=True, timeout=60)
        release_mounts(bundle)


LEAVER = """
import sys
from snapguard import children
from snapguard.reasons import Reason
children.keep_records(sys.argv[1])
# a child that starts a grandchild in its group, as runc starts CRIU
children.run([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['/bin/sleep', '60']); time.sleep(60)"],
             timeout_s=60, what="a stand-in runc", reason=Reason.INTERNAL_ERROR)
"""


def test_the_next_run_ends_what_an_executor_killed_with_its_watchdog_left(tmp_path: Path) -> None:
    """The executor and its watchdog killed together (as an OOM kill of both would): the
    grandchild stays, recorded; a sweep while the executor lives leaves it; the next run's sweep
    ends it and removes the record."""
    from snapguard import children

    records = tmp_path / "children"
    records.mkdir(mode=0o700)
    executor = subprocess.Popen([sys.executable, "-c", LEAVER, str(records)],
                                cwd=str(Path(__file__).resolve().parents[2]))
    grandchild = None
    try:
        deadline = time.monotonic() + 20
        while grandchild is None or not list(records.iterdir()):
            assert time.monotonic() < deadline and executor.poll() is None, "the stand-in did not start its tree"
            sleeps = [p for p in _descendants(executor.pid) if _comm(p) == "sleep"]
            grandchild = sleeps[0] if sleeps else None
            time.sleep(0.02)
        watchdog = [p for p in _children(executor.pid) if b"-I" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
        assert len(watchdog) == 1
        assert children.sweep(str(records)) == [] and _alive(grandchild)  # its executor runs: left alone
        os.kill(watchdog[0], signal.SIGKILL)
        os.kill(executor.pid, signal.SIGKILL)
        executor.wait()
        time.sleep(0.3)
        assert _alive(grandchild), "the grandchild should outlive an executor killed with its watchdog"
        ended = children.sweep(str(records))
        assert [r["ended"] for r in ended] == [True]
        deadline = time.monotonic() + 2
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(grandchild) and list(records.iterdir()) == []
    finally:
        if grandchild is not None and _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        if executor.poll() is None:
            executor.kill()


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # a child that ended between the listing and the read
        return []


def _watchdog(executor: int) -> int:
    (found,) = [p for p in _children(executor) if b"-I" in _cmdline(p)]
    return found


def _counting(out: Path, within: float) -> bool:
    """The container's counter advances within `within` seconds."""
    def now() -> str:
        try:
            return (out / "count").read_text()
        except OSError:
            return ""
    first, deadline = now(), time.monotonic() + within
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if now() not in ("", first):
            return True
    return False


@pytest.mark.root
@pytest.mark.parametrize("all_at_once", [False, True], ids=["executor-killed", "watchdog-killed-too"])
def test_a_container_criu_froze_runs_again_after_a_killed_snapguard_runc(tmp_path: Path, all_at_once: bool) -> None:
    """runc 1.1's CRIU freezes the container's cgroup (v1 freezer) while it seizes the tree, some
    100 ms for 300 processes, then thaws it; snapguard-runc is SIGKILLed inside that window."""
    from snapguard_lab.bundles import RUNC, host_bundle, release_mounts

    out = tmp_path / "out"
    out.mkdir()
    script = ("for i in $(seq 300); do sleep 3600 & done; : > /out/ready; i=0; "
              "while :; do i=$((i+1)); echo $i > /out/count; sleep 0.02; done")
    bundle = host_bundle(tmp_path / "bundle", ["/bin/sh", "-c", script], ["PATH=/usr/bin:/bin"],
                         ["/usr", "/lib", "/lib64", "/bin", "/etc"], writable={"/out": str(out)}, runc=RUNC)
    root, cid = tmp_path / "runc", f"thaw-{os.getpid()}-{int(all_at_once)}"
    env = {**os.environ, "SNAPGUARD_STATE_DIR": str(tmp_path / "state"), "SNAPGUARD_RUNC": RUNC}
    executor_argv = [os.path.join(os.path.dirname(sys.executable), "snapguard-runc"), "--root", str(root)]
    freezer = Path(f"/sys/fs/cgroup/freezer/{cid}/freezer.state")
    try:
        _run_container(RUNC, root, bundle, cid, out / "ready")
        for attempt in range(3):  # on a loaded machine this test's poll can miss the window: again
            assert freezer.read_text().strip() == "THAWED"
            executor = subprocess.Popen([*executor_argv, "checkpoint", "--leave-running", "--image-path",
                                         str(tmp_path / f"image{attempt}"), "--work-path", str(tmp_path / "work"),
                                         cid], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while freezer.read_text().strip() == "THAWED" and executor.poll() is None:
                assert time.monotonic() < deadline, "CRIU never froze the container"
            if executor.poll() is None:
                break
        else:
            pytest.fail("CRIU's freeze was not seen in three snapshots")
        if all_at_once:  # as the OOM killer would take them: runc's group with its CRIU, the watchdog
            (group,) = {os.getpgid(p) for p in _children(executor.pid) if _comm(p) == "runc"}
            os.killpg(group, signal.SIGKILL)
            os.kill(_watchdog(executor.pid), signal.SIGKILL)
        os.kill(executor.pid, signal.SIGKILL)
        executor.wait()
        if all_at_once:
            time.sleep(0.3)
            assert freezer.read_text().strip() != "THAWED" and not _counting(out, 0.3), "nothing should thaw it yet"
            swept = subprocess.run([*executor_argv, "checkpoint", "--image-path", str(tmp_path / "image2"),
                                    "--work-path", str(tmp_path / "work2"), f"{cid}-absent"], env=env,
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
            assert "CONTAINER_NOT_FOUND" in swept.stderr, swept.stderr  # its preflight swept first
            assert not [n for n in os.listdir(tmp_path / "state" / "children") if n.startswith("freezer-")]
        assert _counting(out, 2.0), f"the container CRIU froze does not run (freezer {freezer.read_text().strip()})"
    finally:
        if freezer.exists() and freezer.read_text().strip() != "THAWED":
            freezer.write_text("THAWED")
        subprocess.run([RUNC, "--root", str(root), "delete", "--force", cid], capture_output=True, timeout=60)
        release_mounts(bundle)


# A stand-in for CRIU: `--version` and `check` go to the real one (preflight passes); run by runc
# (`swrk`, the dump), it SIGKILLs the executor that started runc, and with the word "all" in its
# `.mode` file the executor's watchdog first: an executor killed between its thaw of a paused
# container and the pause it owes containerd.
KILLER = """#!{python} -I
import os, signal, sys, time
real, here = {real!r}, sys.argv[0]
if sys.argv[1:2] != ["swrk"]:
    os.execv(real, [real, *sys.argv[1:]])
def ppid(pid):
    with open(f"/proc/{{pid}}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[1])
executor = ppid(os.getppid())
with open(here + ".mode") as f:
    mode = f.read().strip()
if mode == "all":
    for kid in open(f"/proc/{{executor}}/task/{{executor}}/children").read().split():
        if b"-I" in open(f"/proc/{{kid}}/cmdline", "rb").read().split(b"\\0"):
            os.kill(int(kid), signal.SIGKILL)
os.kill(executor, signal.SIGKILL)
time.sleep(30)
"""


@pytest.mark.root
def test_a_paused_container_thawed_by_a_killed_snapguard_runc_is_paused_again(tmp_path: Path) -> None:
    """containerd pauses a task before it asks for a checkpoint and its shim holds it paused;
    snapguard-runc thaws it for the take point. Killed there: the watchdog pauses it again at
    once. Killed with its watchdog: the container runs while the shim holds it paused, and
    containerd's resume that follows (`snapguard-runc resume`) pauses it first, from the record,
    so that the resume succeeds and the container runs as the shim then believes."""
    from snapguard_lab.targets import CRIU, RuncTarget

    stand_in = tmp_path / "criu-killer"
    stand_in.write_text(KILLER.format(python=sys.executable, real=CRIU))
    os.chmod(stand_in, 0o700)
    with RuncTarget(tmp_path / "t", hook=True) as target:
        target.configure(criu=str(stand_in))
        target.start()
        runc_argv = ["/usr/sbin/runc", "--root", str(target.root)]

        def status() -> str:
            return str((target.state() or {}).get("status"))
        assert subprocess.run([*runc_argv, "pause", target.container_id], timeout=30).returncode == 0
        for mode in ("executor", "all"):
            Path(f"{stand_in}.mode").write_text(mode)
            ck = target.checkpoint(tmp_path / f"image-{mode}", tmp_path / f"work-{mode}")
            assert ck.returncode == -signal.SIGKILL, (ck.returncode, ck.stderr)
            deadline = time.monotonic() + 5
            while status() != "paused" and time.monotonic() < deadline:
                time.sleep(0.05)
            if mode == "executor":
                assert status() == "paused", "the watchdog did not pause again the container the executor thawed"
                continue
            assert status() == "running"  # nothing of it was left to pause it again
            resumed = subprocess.run([*target._executor(), "resume", target.container_id], capture_output=True,
                                     text=True, timeout=60, env=target.env())
            assert resumed.returncode == 0, resumed.stderr
            assert status() == "running" and target.advancing()
            assert not [n for n in os.listdir(target.state_dir / "children") if n.startswith("freezer-")]
