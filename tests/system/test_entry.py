"""snapguard-runc's pass-through: argv reaches the real runc unchanged, and it costs little."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["RECORD_TO"], "w") as f:
    json.dump(sys.argv, f)
"""

GO_RUNC_ARGV = {
    "create": ["--root", "/r", "--log", "/l.json", "--log-format", "json", "create", "--bundle", "/b",
               "--pid-file", "/p", "--console-socket", "/s", "--no-pivot", "c1"],
    "start": ["--root", "/r", "--log", "/l.json", "--log-format", "json", "start", "c1"],
    "state": ["--root", "/r", "--log", "/l.json", "--log-format", "json", "state", "c1"],
    "kill": ["--root", "/r", "--log", "/l.json", "--log-format", "json", "kill", "--all", "c1", "9"],
    "delete": ["--root", "/r", "--log", "/l.json", "--log-format", "json", "delete", "--force", "c1"],
    "exec": ["--root", "/r", "--log", "/l.json", "--log-format", "json", "exec", "--process", "/p.json",
             "--detach", "--pid-file", "/x", "c1"],
    "ps": ["--root", "/r", "--log", "/l.json", "--log-format", "json", "ps", "--format", "json", "c1"],
    "events": ["--root", "/r", "events", "--stats", "--interval=5s", "c1"],
    "odd": ["-root=/r", "--systemd-cgroup", "update", "--resources", "-", "c1", "arg with space", ""],
}


@pytest.fixture
def recorder(tmp_path: Path) -> Path:
    path = tmp_path / "recording-runc"
    path.write_text(RECORDER.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("verb", sorted(GO_RUNC_ARGV))
def test_pass_through_argv_is_exact(verb: str, recorder: Path, tmp_path: Path, snapguard_runc: str) -> None:
    record = tmp_path / "argv.json"
    argv = GO_RUNC_ARGV[verb]
    env = {**os.environ, "SNAPGUARD_RUNC": str(recorder), "RECORD_TO": str(record)}
    out = subprocess.run([snapguard_runc, *argv], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(record.read_text()) == [str(recorder), *argv]


def test_unusable_runc_is_a_typed_one_line_error(tmp_path: Path, snapguard_runc: str) -> None:
    log = tmp_path / "log.json"
    env = {**os.environ, "SNAPGUARD_RUNC": str(tmp_path / "no-runc")}
    out = subprocess.run([snapguard_runc, "--log", str(log), "--log-format", "json", "state", "x"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    line = json.loads(log.read_text().splitlines()[-1])
    assert line["level"] == "error" and line["msg"].startswith("snapguard RUNC_UNUSABLE: runc ")


def test_bad_global_argv_naming_a_guarded_verb_is_refused(snapguard_runc: str) -> None:
    """Global flags snapguard cannot parse: when in doubt about the verb and checkpoint or restore
    is named, refuse instead of handing runc a checkpoint without the guards."""
    out = subprocess.run([snapguard_runc, "--bogus", "checkpoint", "c1"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "snapguard USAGE_ERROR: flag provided but not defined: --bogus" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_global_argv_without_a_guarded_verb_is_runcs_to_answer(snapguard_runc: str) -> None:
    out = subprocess.run([snapguard_runc, "--root"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "flag needs an argument: -root" in out.stderr and "snapguard" not in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_checkpoint_argv_is_typed(snapguard_runc: str, tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    out = subprocess.run([snapguard_runc, "--log", str(log), "--log-format", "json", "checkpoint",
                          "--no-such-flag", "c1"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    msg = json.loads(log.read_text())["msg"]
    assert msg == "snapguard USAGE_ERROR: checkpoint: flag provided but not defined: --no-such-flag"


def test_pass_through_imports_nothing_heavy(tmp_path: Path, recorder: Path) -> None:
    """The pass-through path must not load psutil, json, the reasons enum or the guarded verbs."""
    probe = (
        "import os, sys\n"
        "os.execv = lambda path, argv: (print(' '.join(sorted(sys.modules))), sys.exit(0))\n"
        "from snapguard.shim.entry import main\n"
        "main(['snapguard-runc', 'state', 'x'])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "SNAPGUARD_RUNC": str(recorder)},
                         capture_output=True, text=True, timeout=30)
    loaded = set(out.stdout.split())
    assert "snapguard.shim.entry" in loaded
    for heavy in ("psutil", "snapguard.reasons", "snapguard.shim.guarded", "subprocess", "tomllib"):
        assert heavy not in loaded, heavy


@pytest.fixture
def runc_bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle"
    rootfs = bundle / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", rootfs / "bin" / "busybox")
    for applet in ("sh", "sleep", "echo"):
        (rootfs / "bin" / applet).symlink_to("busybox")
    subprocess.run(["/usr/sbin/runc", "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["/bin/sleep", "1000"]
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


@pytest.mark.stack
def test_real_runc_lifecycle_through_executor(runc_bundle: Path, tmp_path: Path, snapguard_runc: str) -> None:
    """create, start, state, ps, exec, events, kill, delete with the real runc behind snapguard-runc."""
    root = tmp_path / "runc-root"
    via = [snapguard_runc, "--root", str(root)]
    direct = ["/usr/sbin/runc", "--root", str(root)]
    cid = f"sg-{os.getpid()}"

    def run(*args: str, argv: list[str] = via) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)

    # The container inherits create's stdio: no pipes that would wait for the container's exit.
    created = subprocess.run([*via, "create", "--bundle", str(runc_bundle), cid], timeout=30,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert created.returncode == 0
    try:
        assert json.loads(run("state", cid).stdout)["status"] == "created"
        assert run("start", cid).returncode == 0
        via_state, direct_state = json.loads(run("state", cid).stdout), json.loads(run("state", cid, argv=direct).stdout)
        assert via_state == direct_state and via_state["status"] == "running"
        assert json.loads(run("ps", "--format", "json", cid).stdout) == [via_state["pid"]]
        exec_out = run("exec", cid, "/bin/echo", "hello from exec")
        assert exec_out.returncode == 0 and exec_out.stdout.strip() == "hello from exec"
        stats = json.loads(run("events", "--stats", cid).stdout)
        assert stats["type"] == "stats" and stats["id"] == cid
        assert run("kill", cid, "KILL").returncode == 0
        deadline = time.monotonic() + 10
        while json.loads(run("state", cid).stdout)["status"] != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        assert run("delete", "--force", cid).returncode == 0
    gone = run("state", cid)
    assert gone.returncode != 0 and "does not exist" in gone.stderr
