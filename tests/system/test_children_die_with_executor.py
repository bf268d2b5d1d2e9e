"""A killed executor ends what it started: a stand-in executor (a real Python process) runs a real
child through snapguard.children, is killed with SIGKILL, and the child (in a process group of its
own, so no group kill reaches it) is gone within a second. And the real thing: `snapguard-runc
checkpoint` of a real runc container, SIGKILLed while runc's CRIU dumps it; neither runc nor CRIU
(runc's own child, which no parent-death signal of ours reaches, and which would go on dumping for
seconds) is left half a second later."""

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
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
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


@pytest.mark.root
@pytest.mark.parametrize("runc", ["/usr/sbin/runc", "/opt/snapguard/compat/bin/runc"], ids=["runc-1.1", "runc-1.3"])
def test_runc_and_criu_die_with_a_killed_snapguard_runc(tmp_path: Path, runc: str) -> None:
    from snapguard_lab.bundles import host_bundle, release_mounts

    RUNC = runc
    if not os.path.exists(RUNC):
        pytest.fail(f"{RUNC} is missing: packaging/install-deps.sh installs it")
    if os.geteuid() != 0:
        pytest.fail("runc containers need root")
    # a container whose dump takes a while: 1 GiB of touched memory
    args = ["/usr/bin/python3", "-c", "import time; a = b'x' * (1 << 30); open('/out/ready', 'w').close(); "
            "time.sleep(600)"]
    out = tmp_path / "out"
    out.mkdir()
    bundle = host_bundle(tmp_path / "bundle", args, ["PATH=/usr/bin:/bin"], ["/usr", "/lib", "/lib64", "/bin", "/etc"],
                         writable={"/out": str(out)}, runc=RUNC)
    root, cid = tmp_path / "runc", f"die-{os.getpid()}"
    env = {**os.environ, "SNAPGUARD_STATE_DIR": str(tmp_path / "state"), "SNAPGUARD_RUNC": RUNC}
    executor_argv = [os.path.join(os.path.dirname(sys.executable), "snapguard-runc"), "--root", str(root)]
    seen: dict[int, str] = {}

    def dumping(seen: dict[int, str]) -> bool:
        return any(c == "criu" and seen.get(_ppid(p)) == "runc" and _alive(p) for p, c in seen.items()) and \
            any((tmp_path / "image").glob("*.img"))

    try:
        assert subprocess.run([RUNC, "--root", str(root), "run", "--detach", "--bundle", str(bundle), cid],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=60).returncode == 0
        deadline = time.monotonic() + 30
        while not (out / "ready").exists():
            assert time.monotonic() < deadline, "the container did not start"
            time.sleep(0.05)
        executor = subprocess.Popen([*executor_argv, "checkpoint", "--image-path", str(tmp_path / "image"),
                                     "--work-path", str(tmp_path / "work"), cid], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not dumping(seen):  # runc's own CRIU (not a probe of the executor's), its image begun
            assert executor.poll() is None and time.monotonic() < deadline, \
                f"no CRIU of runc's seen dumping under the executor (exit {executor.returncode}, saw {seen})"
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
    finally:
        for p in seen:
            if _alive(p) and _comm(p) in ("criu", "runc"):
                os.kill(p, signal.SIGKILL)
        subprocess.run([RUNC, "--root", str(root), "delete", "--force", cid], capture_output=True, timeout=60)
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
