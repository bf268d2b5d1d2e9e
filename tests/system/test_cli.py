"""`snapguard` CLI: exit codes, JSON, typed one-line usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from snapguard import image
from snapguard.procfs import host_facts
from snapguard_lab.planted import IO_URING, planted


def snapguard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "snapguard")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_node_ready_here(tmp_path: Path) -> None:
    out = snapguard("preflight", "--node", "--json", env={"SNAPGUARD_STATE_DIR": str(tmp_path)})
    report = json.loads(out.stdout)
    assert out.returncode == 0, out.stdout
    assert report["verdict"] == "ready" and report["facts"]["criu_version"].startswith("4.")
    assert {c["name"] for c in report["checks"]} >= {"privileges", "criu", "network-lock", "cuda-plugin"}


def test_node_blocked_by_missing_criu(tmp_path: Path) -> None:
    out = snapguard("preflight", "--node", env={"SNAPGUARD_CRIU": str(tmp_path / "criu")})
    assert out.returncode == 1
    assert out.stdout.splitlines()[0] == "snapguard preflight --node: BLOCKED"
    assert "CRIU_MISSING" in out.stdout and "remedies:" in out.stdout


def test_pid_blocked_with_reason_and_evidence() -> None:
    with planted(IO_URING) as pid:
        out = snapguard("preflight", "--pid", str(pid), "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 1
    assert [b["reason"] for b in report["blockers"]] == ["IO_URING_PRESENT"]
    assert report["blockers"][0]["evidence"]["pid"] == pid


def test_pid_that_does_not_exist_is_unchecked() -> None:
    out = snapguard("preflight", "--pid", str(2**22 + 7), "--json")
    assert out.returncode == 2 and json.loads(out.stdout)["verdict"] == "unchecked"


def test_manifest_checks(tmp_path: Path) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / "pages-1.img").write_bytes(b"x" * 100)
    image.seal(str(d), {"criu_version": "4.2.1", "host": host_facts(), "processes": []})
    ok = snapguard("preflight", "--manifest", str(d / image.MANIFEST_NAME), "--json")
    assert ok.returncode == 0, ok.stdout
    (d / "pages-1.img").write_bytes(b"y" * 100)
    bad = snapguard("preflight", "--manifest", str(d), "--json")
    assert bad.returncode == 1 and json.loads(bad.stdout)["blockers"][0]["reason"] == "IMAGE_CORRUPT"


@pytest.mark.parametrize("args", [["preflight"], ["preflight", "--pid", "abc"], ["nope"],
                                  ["preflight", "--node", "--pid", "1"]])
def test_usage_errors_are_one_typed_line(args: list[str]) -> None:
    out = snapguard(*args)
    assert out.returncode == 2
    assert out.stderr.startswith("snapguard USAGE_ERROR: ") and out.stderr.count("\n") == 1


def test_bad_config_is_typed(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("criu = 3\n")
    out = snapguard("preflight", "--node", env={"SNAPGUARD_CONFIG": str(cfg)})
    assert out.returncode == 2 and out.stderr.startswith("snapguard CONFIG_INVALID: `criu` must be an absolute path")
    assert "Traceback" not in out.stderr


def test_reasons_catalogue() -> None:
    rows = json.loads(snapguard("reasons", "--json").stdout)
    names = {r["reason"] for r in rows}
    assert {"STRAY_GPU_DEVICE_HANDLE", "IMAGE_CORRUPT", "CRIU_MISSING", "GPU_MODEL_MISMATCH"} <= names
    assert snapguard("--help").stdout.count("preflight") >= 1


def test_build_parser_reaches_every_command_with_its_help() -> None:
    """The CLI reference is generated from build_parser(): every command's parser, help and flags."""
    import argparse

    from snapguard import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(cli.COMMANDS)
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, command in sub.choices.items():
        assert helps[name] and command.description, name
        assert command.prog == f"snapguard {name}"
        if name != "drill":  # hands its argv to snapguard-lab drill
            assert all(a.help for a in command._actions), name


# --- no silent success (the agent's commands: root) ----------------------------------------------

def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from snapguard import cli

    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def agent_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    monkeypatch.setenv("SNAPGUARD_CONFIG", str(cfg))
    monkeypatch.setenv("SNAPGUARD_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state" / "agent"


@pytest.mark.root
def test_notice_with_no_agent_is_refused_unless_queued(agent_env: Path, capsys) -> None:
    code, out, err = run_cli(capsys, "notice", "--id", "n1")
    assert code == 1 and out == "" and err.startswith("snapguard AGENT_NOT_RUNNING: no agent holds ")
    assert not list((agent_env / "inbox").glob("*.json")) if (agent_env / "inbox").exists() else True
    code, out, _ = run_cli(capsys, "notice", "--id", "n1", "--queue")
    assert code == 0 and (agent_env / "inbox" / "n1.json").exists()
    import fcntl  # an agent holding its lock: posted without --queue

    fd = os.open(agent_env / "agent.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        code, out, _ = run_cli(capsys, "notice", "--id", "n2")
        assert code == 0 and "snapguard notice n2 posted" in out
    finally:
        os.close(fd)


@pytest.mark.root
def test_protect_list_of_an_empty_registry_says_so(agent_env: Path, capsys) -> None:
    code, out, err = run_cli(capsys, "protect", "--list")
    assert code == 0 and out == "" and err.startswith("snapguard protect: nothing is protected")
    code, out, _ = run_cli(capsys, "protect", "--list", "--json")
    assert code == 0 and out.strip() == "{}"
