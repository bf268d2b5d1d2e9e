"""One CLI vocabulary and no silent success: every command's --help (snapguard and
snapguard-runc), --store/--job with the old spellings as deprecated aliases, and the cases that
used to look like success (a store that does not exist, an unknown reason, no agent, an empty
registry, no NVIDIA driver)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from snapguard import cli
from snapguard.shim._argv import parse_subcommand

BIN = os.path.dirname(sys.executable)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse's --help and usage errors
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


# --- the help walk ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in cli.COMMANDS if n != "drill"])
def test_every_command_help_exits_0_and_names_its_own_flags(name: str, capsys) -> None:
    code, out, _ = run_cli(capsys, name, "--help")
    assert code == 0 and out.startswith(f"usage: snapguard {name}")
    for action in _subparsers()[name]._actions:
        if action.help == argparse.SUPPRESS:  # a deprecated alias: kept, not shown
            assert not any(o in out.split() for o in action.option_strings), (name, action.option_strings)
            continue
        assert any(o in out for o in action.option_strings or [action.metavar or action.dest]), (name, action)


def test_drill_help_says_it_is_snapguard_drill() -> None:
    out = subprocess.run([os.path.join(BIN, "snapguard"), "drill", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: snapguard drill"), out.stdout[:200]
    assert "--out PATH" in out.stdout and "snapguard-lab" not in out.stdout.splitlines()[0]


@pytest.mark.parametrize("argv, ours, runcs", [
    (["--help"], "the guarded runc executor", "checkpoint"),
    (["restore", "--help"], "--store URL", "--image-path"),
    (["--root", "/run/x", "restore", "-h"], "--job J", "--image-path"),
    (["checkpoint", "--help"], "snapguard's guards", "--leave-running"),
])
def test_snapguard_runc_help_is_snapguards_then_runcs(argv: list[str], ours: str, runcs: str) -> None:
    out = subprocess.run([os.path.join(BIN, "snapguard-runc"), *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ours in out.stdout
    if "runc's own help cannot be shown" not in out.stdout:  # a node without runc still gets snapguard's part
        assert out.stdout.index(ours) < out.stdout.index("runc's own") < out.stdout.rindex(runcs)


# --- one vocabulary ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, old", [
    (["push", "--images", "/i", "--to", "file:///s"], "--to"),
    (["pull", "--images", "/i", "--from", "file:///s"], "--from"),
    (["restore", "--from", "file:///s"], "--from"),
])
def test_old_store_spellings_are_deprecated_aliases_of_store(argv: list[str], old: str, capsys) -> None:
    args = cli.build_parser().parse_args(argv)
    assert args.store == "file:///s"
    assert capsys.readouterr().err == f"snapguard: {old} is deprecated, use --store (the old spelling goes in a " \
                                      "later release)\n"
    new = cli.build_parser().parse_args([("--store" if a == old else a) for a in argv])
    assert new.store == "file:///s" and capsys.readouterr().err == ""


def test_push_without_a_store_is_a_usage_error(capsys) -> None:
    code, _, err = run_cli(capsys, "push", "--images", "/nonexistent")
    assert code == 2 and err == "snapguard USAGE_ERROR: push needs --store URL\n"


def test_snapguard_runc_restore_takes_store_job_image_and_the_old_spellings(capfd) -> None:
    new = parse_subcommand("restore", ["--store", "file:///s", "--job", "j", "--image", "n", "--bundle", "/b", "c1"])
    assert capfd.readouterr().err == ""
    old = parse_subcommand("restore", ["--from", "file:///s", "--from-job", "j", "--from-image", "n", "--bundle",
                                       "/b", "c1"])
    assert old.values == new.values and old.value("from") == "file:///s" and old.value("from-job") == "j"
    assert capfd.readouterr().err.splitlines() == [
        "snapguard-runc: --from is deprecated, use --store", "snapguard-runc: --from-job is deprecated, use --job",
        "snapguard-runc: --from-image is deprecated, use --image"]


# --- no silent success ---------------------------------------------------------------------------

def test_prune_of_a_store_that_does_not_exist_is_refused_and_creates_nothing(tmp_path: Path, capsys) -> None:
    code, out, err = run_cli(capsys, "prune", "--store", f"file://{tmp_path}/typo", "--job", "train")
    assert code == 2 and out == ""
    assert err.startswith("snapguard STORE_JOB_NOT_FOUND: ") and "does it exist?" in err and err.count("\n") == 1
    assert not (tmp_path / "typo").exists()


def test_reasons_name_explains_one_reason_with_its_remedy(capsys) -> None:
    code, out, _ = run_cli(capsys, "reasons", "criu-missing")
    assert code == 0 and out.splitlines()[0] == "CRIU_MISSING" and "remedy:" in out and "install CRIU" in out
    code, _, err = run_cli(capsys, "reasons", "CRIU_MISING")
    assert code == 2 and err.startswith("snapguard USAGE_ERROR: no reason named 'CRIU_MISING'; did you mean "
                                        "CRIU_MISSING")


def test_preflight_says_absent_not_ok_without_a_driver() -> None:
    from snapguard.preflight import CheckResult, Report

    report = Report("--node")
    report.host.update({"gpu": None})
    report.checks.append(CheckResult("nvidia-driver"))
    line = next(x for x in report.to_text().splitlines() if x.startswith("nvidia-driver"))
    assert line.split()[1] == "absent" and "GPU_DRIVER_MISSING" in line
    checks = {c["name"]: c["status"] for c in report.to_dict()["checks"]}
    assert checks["nvidia-driver"] == "absent"  # --json says what the text says


def test_drill_json_is_a_switch_and_the_old_path_form_an_alias(capsys) -> None:
    from snapguard_lab import cli as lab

    assert lab.main(["drill", "--json", "/tmp/a.json", "--out", "/tmp/b.json"]) == 2
    err = capsys.readouterr().err
    assert "`drill --json PATH` is deprecated, use `--json --out PATH`" in err
    assert "snapguard-lab USAGE_ERROR: --json PATH and --out PATH: give the path once, to --out" in err
    args = lab._parser("snapguard").parse_args(["drill", "--json", "--workdir", "/w"])
    assert args.json is True and args.out is None and args.workdir == "/w"


def _complete(tmp_path: Path, *words: str) -> list[str]:
    script = tmp_path / "snapguard.bash"
    script.write_text(subprocess.run([os.path.join(BIN, "snapguard"), "completion", "bash"], capture_output=True,
                                     text=True, timeout=60, check=True).stdout)
    line = " ".join(words)
    out = subprocess.run(["bash", "-c", f'source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; '
                          '_snapguard; printf "%s\\n" "${COMPREPLY[@]}"'], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_bash_completion_completes_commands_flags_and_paths(tmp_path: Path) -> None:
    assert _complete(tmp_path, "snapguard", "i") == ["install", "images", "inspect"]
    assert _complete(tmp_path, "snapguard", "push", "--s") == ["--store"]  # --to is hidden
    assert "--queue" in _complete(tmp_path, "snapguard", "notice", "--")
    (tmp_path / "imgdir").mkdir()
    assert _complete(tmp_path, "snapguard", "push", "--images", str(tmp_path / "imgd")) == [str(tmp_path / "imgdir")]
    zsh = subprocess.run([os.path.join(BIN, "snapguard"), "completion", "zsh"], capture_output=True, text=True,
                         timeout=60).stdout
    assert zsh.startswith("autoload -U +X bashcompinit && bashcompinit\n") and "complete -F _snapguard" in zsh


@pytest.mark.parametrize("argv, absent", [
    (["notice", "--help"], ("snapguard.notice._agent", "snapguard.install", "snapguard.webhook", "snapguard.pipeline")),
    (["reasons", "--help"], ("snapguard.notice", "snapguard.install", "snapguard.webhook", "snapguard.pipeline")),
    (["restore", "--help"], ("snapguard.notice", "snapguard.install", "snapguard.webhook")),
])
def test_a_command_loads_only_its_own_modules(argv: list[str], absent: tuple[str, ...]) -> None:
    """main() builds the parser of the command it is asked for alone: a command's start is its own
    imports, not every command's (the agent's sources, the installer, the webhook)."""
    code = ("import sys\nfrom snapguard.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in sys.modules if m.startswith({absent!r})), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith(f"usage: snapguard {argv[0]}"), out.stdout[:200] + out.stderr[-2000:]
    assert out.stderr.strip() == "[]", out.stderr[-2000:]


def test_the_whole_parser_answers_what_names_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and all(name in out for name in cli.COMMANDS if name != "drill")
    code, _, err = run_cli(capsys, "notic")  # mistyped: the whole parser's error, every choice listed
    assert code == 2 and "invalid choice" in err and "notice" in err, err
