"""snapguard-runc's C launcher (c_helpers/runc_launcher.c), built and installed by `snapguard
install`, with the real runc: a container's life through it never starts Python, checkpoint and
restore reach snapguard's Python entry, argv reaches runc unchanged, and a pinned file that is
missing or not root's alone is one line on stderr, with nothing run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from snapguard import config, install
from snapguard.shim import entry
from snapguard.shim._help import HELP

RUNC = "/usr/sbin/runc"
SNAPGUARD_RUNC = os.path.join(os.path.dirname(sys.executable), "snapguard-runc")

MARKER_ENTRY = """#!/bin/sh
echo "$@" >> {log}
exit 99
"""
RECORDER = """#!{python}
import json, os, sys
with open(os.environ["RECORD_TO"], "w") as f:
    json.dump(sys.argv, f)
"""


@dataclass
class Installed:
    tmp: Path
    launcher: Path
    config: Path
    pin: Path
    env: dict[str, str]

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        # stdout and stderr through files: a container created keeps the ones it inherits open
        with open(self.tmp / "out", "w+") as out, open(self.tmp / "err", "w+") as err:
            done = subprocess.run([str(self.launcher), *args], env=env or self.env, stdout=out, stderr=err,
                                  timeout=120, cwd=self.tmp, stdin=subprocess.DEVNULL)
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(done.args, done.returncode, out.read(), err.read())

    def repin(self, **fields: str) -> None:
        """The pinned file with some fields replaced (as root writes it)."""
        lines = self.pin.read_text().splitlines()
        old = dict(line.partition(" ")[::2] for line in lines[1:])
        old.update(fields)
        text = config.render_launcher_pin(old["config"], old["stamp"], old["runc"], old["entry"])
        assert config.write_pin_file(str(self.pin), text)


@pytest.fixture
def installed(tmp_path: Path) -> Installed:
    if os.geteuid() != 0:
        pytest.fail("the launcher's system tests need root (CI and the README's test command run as root)")
    if not os.path.exists("/usr/bin/containerd"):
        pytest.fail("no /usr/bin/containerd: run packaging/install-deps.sh")
    etc = tmp_path / "etc"
    launcher = tmp_path / "libexec" / "snapguard-runc"
    opts = install.Options(containerd_config=str(etc / "containerd" / "config.toml"), containerd="/usr/bin/containerd",
                           snapguard_config=str(etc / "snapguard" / "config.toml"),
                           state_file=str(tmp_path / "var" / "install.json"), launcher=True,
                           launcher_path=str(launcher),
                           candidates={**install.CANDIDATES, "runc": (RUNC,)})
    (tmp_path / "var").mkdir()
    plan = install.plan_install(opts)
    install.apply(plan)
    assert plan.facts["binary_name"] == str(launcher)
    conf = etc / "snapguard" / "config.toml"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SNAPGUARD_CONFIG": str(conf),
           "SNAPGUARD_STATE_DIR": str(tmp_path / "sgstate")}
    return Installed(tmp_path, launcher, conf, etc / "snapguard" / "runc-launcher.pin", env)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs" / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", bundle / "rootfs" / "bin" / "busybox")
    for applet in ("sh", "sleep"):
        (bundle / "rootfs" / "bin" / applet).symlink_to("busybox")
    subprocess.run([RUNC, "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"].update(terminal=False, args=["/bin/sleep", "3600"])
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def _state(out: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_containers_life_goes_to_runc_and_checkpoint_to_snapguard(installed: Installed, bundle: Path) -> None:
    """create, start, state, ps, pause, kill, delete through the launcher run the real runc and never
    the Python entry (here a marker script that would log its call); checkpoint and resume go to the
    entry."""
    calls = installed.tmp / "entry-calls"
    marker = installed.tmp / "libexec" / "marker-entry"
    marker.write_text(MARKER_ENTRY.format(log=calls))
    marker.chmod(0o755)
    installed.repin(entry=str(marker))
    root = installed.tmp / "runc-root"
    via = ["--root", str(root), "--log", str(installed.tmp / "runc.log"), "--log-format", "json"]
    cid = "launcher-life"
    try:
        out = installed.run(*via, "create", "--bundle", str(bundle), cid)
        assert out.returncode == 0, out.stderr
        assert _state(installed.run(*via, "state", cid))["status"] == "created"
        assert installed.run(*via, "start", cid).returncode == 0
        state = _state(installed.run(*via, "state", cid))
        assert state["status"] == "running" and state["id"] == cid
        assert state == _state(subprocess.run([RUNC, "--root", str(root), "state", cid], capture_output=True, text=True))
        ps = installed.run(*via, "ps", "--format", "json", cid)
        assert ps.returncode == 0 and json.loads(ps.stdout) == [state["pid"]]
        assert installed.run("--version").stdout.startswith("runc version")
        assert not calls.exists(), calls.read_text()  # Python was never started

        out = installed.run(*via, "checkpoint", "--image-path", str(installed.tmp / "img"), cid)
        assert out.returncode == 99 and calls.read_text().split() == [*via, "checkpoint", "--image-path",
                                                                       str(installed.tmp / "img"), cid]
        out = installed.run("--bogus", "restore", "x")  # unclear, names restore: the entry refuses it
        assert out.returncode == 99

        # pause goes to runc; resume to the entry, which puts back a pause a killed executor lifted
        # before it passes the resume on (the marker entry only logs it: runc resumes it here)
        assert installed.run(*via, "pause", cid).returncode == 0
        assert _state(installed.run(*via, "state", cid))["status"] == "paused"
        assert len(calls.read_text().splitlines()) == 2
        assert installed.run(*via, "resume", cid).returncode == 99
        assert calls.read_text().splitlines()[-1].split() == [*via, "resume", cid]
        assert subprocess.run([RUNC, "--root", str(root), "resume", cid], capture_output=True).returncode == 0

        assert installed.run(*via, "kill", cid, "KILL").returncode == 0
        assert installed.run(*via, "delete", "--force", cid).returncode == 0
        assert len(calls.read_text().splitlines()) == 3
    finally:
        subprocess.run([RUNC, "--root", str(root), "delete", "--force", cid], capture_output=True)


def test_checkpoint_reaches_snapguard(installed: Installed) -> None:
    """The real entry: a checkpoint of a container runc does not know is snapguard's typed refusal,
    written to --log as runc's log contract has it."""
    log = installed.tmp / "log.json"
    root = installed.tmp / "runc-root"
    root.mkdir(mode=0o700)
    out = installed.run("--root", str(root), "--log", str(log), "--log-format", "json", "checkpoint",
                        "--image-path", str(installed.tmp / "img"), "no-such-container")
    assert out.returncode == 1
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["level"] == "error" and last["msg"].startswith("snapguard CONTAINER_NOT_FOUND: "), last


def test_argv_reaches_runc_unchanged(installed: Installed) -> None:
    recorder = installed.tmp / "libexec" / "recording-runc"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    text = installed.config.read_text()
    installed.config.write_text(text.replace(f'runc = "{RUNC}"', f'runc = "{recorder}"'))
    assert config.load(installed.env).runc == str(recorder)  # the loader syncs the pinned file
    record = installed.tmp / "argv.json"
    env = {**installed.env, "RECORD_TO": str(record)}
    for argv in (["--root", "/r", "--log", "/l.json", "--log-format", "json", "state", "c1"],
                 ["-root=/r", "--systemd-cgroup", "update", "--resources", "-", "c1", "arg with space", ""],
                 ["--", "exec", "--", "c1", "checkpoint"], ["spec", "restore"], []):
        out = installed.run(*argv, env=env)
        assert out.returncode == 0, out.stderr
        assert json.loads(record.read_text()) == [str(recorder), *argv]
    # SNAPGUARD_RUNC names another runc: the Python entry honours it, as without the launcher
    other = installed.tmp / "libexec" / "other-runc"
    shutil.copy(recorder, other)
    out = installed.run("state", "c1", env={**env, "SNAPGUARD_RUNC": str(other)})
    assert out.returncode == 0, out.stderr
    assert json.loads(record.read_text()) == [str(other), "state", "c1"]


def _one_line_refusal(out: subprocess.CompletedProcess[str], pin: Path) -> None:
    assert out.returncode == 2 and out.stdout == "", out  # the install cannot be used, nothing was tried
    assert out.stderr.startswith(f"snapguard-runc: pinned file {pin}: ") and out.stderr.count("\n") == 1, out.stderr


def test_a_pinned_file_not_roots_alone_is_refused(installed: Installed) -> None:
    pin = installed.pin
    good = pin.read_bytes()
    for verb in ("state", "checkpoint"):
        pin.chmod(0o664)  # group-writable
        _one_line_refusal(installed.run(verb, "c1"), pin)
        pin.chmod(0o644)
        os.chown(pin, 1000, 0)  # not root's
        _one_line_refusal(installed.run(verb, "c1"), pin)
        os.chown(pin, 0, 0)
        pin.parent.chmod(0o777)  # a directory on the way others can write (not sticky)
        _one_line_refusal(installed.run(verb, "c1"), pin)
        pin.parent.chmod(0o755)
        elsewhere = installed.tmp / "elsewhere.pin"  # a link, even to a good file
        elsewhere.write_bytes(good)
        pin.unlink()
        pin.symlink_to(elsewhere)
        _one_line_refusal(installed.run(verb, "c1"), pin)
        pin.unlink()
        _one_line_refusal(installed.run(verb, "c1"), pin)  # missing
        pin.write_bytes(good[:-1])  # torn
        _one_line_refusal(installed.run(verb, "c1"), pin)
        pin.write_bytes(good)
        assert installed.run("--version").stdout.startswith("runc version")


def test_the_apps_help_is_snapguards_then_runcs_and_nothing_else_starts_python(installed: Installed) -> None:
    """`snapguard-runc --help` through the launcher: snapguard's own part first, then the real
    runc's help; `--version`, `help`, `--help=false` and `state --help` stay runc's alone, with no
    Python started (the marker entry would log it)."""
    for argv in (["--help"], ["-h"], ["--help=true"], ["--root", "/r", "--log-format", "json", "-help"],
                 ["--help", "state", "c1"]):
        out = installed.run(*argv)
        assert out.returncode == 0, (argv, out.stderr)
        assert out.stdout.startswith(HELP[None]), (argv, out.stdout[:200])
        runcs = out.stdout[len(HELP[None]):]
        assert f"runc's own help ({RUNC}):" in runcs and "USAGE:" in runcs and "checkpoint" in runcs, runcs
    out = installed.run("restore", "--help")  # a guarded verb's help: its own part, then runc's flags
    assert out.returncode == 0 and out.stdout.startswith(HELP["restore"]) and "--image-path" in out.stdout, out
    calls = installed.tmp / "entry-calls"
    marker = installed.tmp / "libexec" / "marker-entry"
    marker.write_text(MARKER_ENTRY.format(log=calls))
    marker.chmod(0o755)
    installed.repin(entry=str(marker))
    assert installed.run("--help").returncode == 99 and calls.read_text().split() == ["--help"]
    calls.unlink()
    for argv in (["--version"], ["help"], ["--help=false"], ["state", "--help"], ["--help", "-h"], []):
        out = installed.run(*argv)
        assert out.returncode != 99 and not calls.exists(), (argv, out)
    assert "snapguard" not in installed.run("state", "--help").stdout


def test_the_launchers_help_test_agrees_with_the_python_entry(tmp_path: Path) -> None:
    """The launcher's reading of `--help` among runc's global flags (built with -DSG_HELP_TEST) is
    the Python entry's (`_help_asked` is None) on every command line of a random pool."""
    import random

    program = tmp_path / "help-test"
    program.write_bytes(install.build_launcher("/etc/snapguard/config.toml", help_test=True))
    program.chmod(0o755)
    rng = random.Random(32)
    pool = ["--help", "-h", "--h", "-help", "--help=true", "--help=false", "-h=1", "-h=0", "--help=x", "--help=",
            "--version", "--root", "/r", "--root=/r", "--debug", "--bogus", "--", "-", "", "state", "checkpoint",
            "restore", "help", "c1"]
    cases = [["--help"], ["-h"], ["--help", "--help=false"], ["--help=false", "--help"], ["--help", "-h"]]
    cases += [[rng.choice(pool) for _ in range(rng.randint(0, 5))] for _ in range(300)]
    wrong = []
    for args in cases:
        out = subprocess.run([str(program), *args], capture_output=True, text=True, timeout=30)
        got, want = out.stdout.strip(), "help" if entry._help_asked(args) is None else "-"
        if got != want:
            wrong.append((args, got, want))
    assert not wrong, wrong
    assert {entry._help_asked(args) is None for args in cases} == {True, False}
