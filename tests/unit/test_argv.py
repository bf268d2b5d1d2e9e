"""runc's argv, read as runc 1.1 reads it (urfave/cli v1 over Go's flag package).

The expectations were checked against runc itself: Debian's runc 1.1.5 (urfave/cli 1.22.9) and
two builds of runc 1.1's checkpoint/restore flag tables with urfave/cli 1.22.1 and 1.22.9.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from snapguard.shim import _argv
from snapguard.shim._argv import ArgvError, parse_subcommand, split_global

# What go-runc (containerd 1.6's runc shim) emits.
CHECKPOINT = ["--root", "/run/containerd/runc/k8s.io", "--log", "/x/log.json", "--log-format", "json",
              "checkpoint", "--image-path", "/img", "--work-path", "/work", "--leave-running",
              "--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks", "--empty-ns", "network", "c1"]
RESTORE = ["--root", "/r", "--log", "/l", "--log-format", "json", "--systemd-cgroup", "restore",
           "--image-path", "/img", "--work-path", "/w", "--detach", "--pid-file", "/p",
           "--console-socket", "/s", "--no-pivot", "-no-subreaper", "--bundle", "/b", "c1"]


def decide(args: list[str]) -> tuple[str, object]:
    from snapguard.shim.entry import decide

    return decide(args)


# --- the verb table


# runc 1.1's commands (main.go app.Commands; none has an alias) and urfave/cli's help command.
RUNC_1_1_PASS_THROUGH = ["create", "delete", "events", "exec", "kill", "list", "pause", "ps", "resume", "run", "spec",
                         "start", "state", "update", "features", "help", "h"]


def test_verb_table() -> None:
    assert _argv.GUARDED_VERBS == ("checkpoint", "restore")
    assert _argv.ENTRY_VERBS == ("resume",)
    assert sorted(_argv.PASS_THROUGH_VERBS) == sorted(RUNC_1_1_PASS_THROUGH)
    assert [verb for verb, _ in _argv.VERB_TABLE] == [*dict(_argv.VERB_TABLE)]  # no verb twice


@pytest.mark.parametrize("verb", RUNC_1_1_PASS_THROUGH)
def test_every_pass_through_verb_passes(verb: str) -> None:
    assert decide(["--root", "/r", verb, "x"]) == ("pass", None)


# --- global flags: split_global


@pytest.mark.parametrize("args, verb, index", [
    (["--", "checkpoint", "c1"], "checkpoint", 1),
    (["--root", "R", "--", "checkpoint", "c1"], "checkpoint", 3),
    (["--", "restore", "c1"], "restore", 1),
    (["--", "--", "c1"], "--", 1),  # after the `--` that ends the flags, even `--` is the command
])
def test_split_global_double_dash_ends_flags(args: list[str], verb: str, index: int) -> None:
    opts = split_global(args)
    assert (opts.subcommand, opts.subcommand_index) == (verb, index)


def test_split_global_finds_subcommand_and_flags() -> None:
    opts = split_global(CHECKPOINT)
    assert opts.subcommand == "checkpoint" and opts.subcommand_index == 6
    assert opts.root == "/run/containerd/runc/k8s.io" and opts.log == "/x/log.json" and opts.log_format == "json"


def test_split_global_equals_and_single_dash_forms() -> None:
    opts = split_global(["-root=/r", "--debug", "--criu=/c", "state", "x"])
    assert (opts.root, opts.criu, opts.subcommand) == ("/r", "/c", "state")
    assert "debug" in opts.bools


@pytest.mark.parametrize("args", [["--log-format=json", "checkpoint", "c"], ["-log-format", "json", "checkpoint", "c"]])
def test_split_global_log_format(args: list[str]) -> None:
    opts = split_global(args)
    assert opts.log_format == "json" and opts.subcommand == "checkpoint"


@pytest.mark.parametrize("flag, on", [("--debug=false", False), ("-debug=0", False), ("--debug=F", False),
                                      ("--debug=True", True), ("--debug=t", True), ("--debug", True)])
def test_split_global_bool_with_value(flag: str, on: bool) -> None:
    opts = split_global([flag, "checkpoint", "c"])
    assert opts.subcommand == "checkpoint" and ("debug" in opts.bools) is on


def test_split_global_bool_takes_no_separate_value() -> None:
    assert split_global(["--debug", "true", "checkpoint"]).subcommand == "true"


@pytest.mark.parametrize("value", ["yes", "no", "tRuE", "", "2"])  # not strconv.ParseBool's
def test_split_global_bad_bool(value: str) -> None:
    with pytest.raises(ArgvError, match=f'invalid boolean value "{value}" for -debug'):
        split_global([f"--debug={value}", "checkpoint", "c"])


def test_split_global_value_flag_takes_any_next_token() -> None:
    opts = split_global(["--root", "--", "checkpoint"])
    assert (opts.root, opts.subcommand) == ("--", "checkpoint")
    opts = split_global(["--rootless", "checkpoint", "c1"])  # --rootless takes a value: true, false or auto
    assert opts.values["rootless"] == "checkpoint" and opts.subcommand == "c1"


def test_split_global_lone_dash_and_empty_are_the_verb() -> None:
    assert split_global(["-", "checkpoint"]).subcommand == "-"
    assert split_global(["", "checkpoint"]).subcommand == ""
    assert split_global(["--root", "/r"]).subcommand is None


def test_split_global_missing_value() -> None:
    with pytest.raises(ArgvError, match="flag needs an argument: -root"):
        split_global(["--root"])


@pytest.mark.parametrize("args, message", [
    (["--bogus", "checkpoint", "c1"], "flag provided but not defined: --bogus"),
    (["---root", "/r", "checkpoint", "c1"], "bad flag syntax: ---root"),
    (["-=x", "checkpoint"], "bad flag syntax: -=x"),
    (["-h", "--help", "state"], "Cannot use two forms of the same flag: h help"),
    (["--root", "a\0b", "state"], "NUL byte"),
    (["state", "x\0"], "argument 2 contains a NUL byte"),
    (["--root", "/" + "x" * 4096, "checkpoint", "c"], "longer than 4096 bytes"),
])
def test_split_global_refuses_what_runc_would_not_parse(args: list[str], message: str) -> None:
    with pytest.raises(ArgvError, match=message):
        split_global(args)


def test_split_global_error_keeps_the_log_flags() -> None:
    with pytest.raises(ArgvError) as e:
        split_global(["--log", "/l.json", "--log-format", "json", "--bogus", "checkpoint", "c1"])
    assert e.value.opts is not None and (e.value.opts.log, e.value.opts.log_format) == ("/l.json", "json")


# --- the executor's decision


@pytest.mark.parametrize("args", [
    ["--", "checkpoint", "c1"], ["--root", "R", "--", "checkpoint", "c1"], ["--", "restore", "c1"],
    ["--debug=false", "checkpoint", "c1"], ["--log-format=json", "checkpoint", "c1"], CHECKPOINT, RESTORE,
    ["--criu", "--", "restore", "c1"],  # --criu's value is "--"
])
def test_decide_guards_checkpoint_and_restore(args: list[str]) -> None:
    action, opts = decide(args)
    assert action == "guard" and isinstance(opts, _argv.GlobalOptions)
    assert opts.subcommand in ("checkpoint", "restore") and args[opts.subcommand_index] == opts.subcommand


@pytest.mark.parametrize("args", [
    ["state", "id"],
    ["exec", "c1", "checkpoint"],  # a process named checkpoint
    ["--root"],  # runc prints its own error
    ["--bogus", "state", "c1"],
    ["chekpoint", "c1"],
    ["help", "checkpoint"],
    ["--help"], ["--version"], [],
])
def test_decide_passes_through(args: list[str]) -> None:
    assert decide(args) == ("pass", None)


@pytest.mark.parametrize("args, message", [
    (["--bogus", "checkpoint", "c1"], "flag provided but not defined: --bogus"),
    (["--rootless", "checkpoint", "c1"], "unknown command c1"),
    (["--debug=yes", "checkpoint", "c1"], "invalid boolean value"),
    (["--debug", "true", "checkpoint", "c1"], "unknown command true"),
    (["--help", "checkpoint", "c1"], "--help or --version"),
    (["--log-format=xml", "checkpoint", "c1"], "invalid log-format: xml"),
    (["state", "c\0"], "NUL byte"),
    (["--bo\ngus", "checkpoint", "c1"], "flag provided but not defined"),
])
def test_decide_refuses_when_runc_might_checkpoint(args: list[str], message: str) -> None:
    action, detail = decide(args)
    assert action == "refuse" and isinstance(detail, str)
    assert message in detail and "\n" not in detail


def test_main_refuses_unknown_global_flag_before_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from snapguard.shim import entry

    def no_exec(path: str, argv: list[str]) -> None:
        raise AssertionError(f"runc was exec'd: {argv}")

    monkeypatch.setattr(os, "execv", no_exec)
    monkeypatch.setenv("SNAPGUARD_RUNC", sys.executable)
    log = tmp_path / "log.json"
    rc = entry.main(["snapguard-runc", "--log", str(log), "--log-format", "json", "--bogus", "checkpoint", "c1"])
    assert rc == 2
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert msg.startswith("snapguard USAGE_ERROR: flag provided but not defined: --bogus") and "checkpoint" in msg


def test_main_guards_checkpoint_after_double_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    from snapguard.shim import entry

    calls: list[tuple[list[str], str | None, int]] = []

    def run_guarded(args: list[str], opts: _argv.GlobalOptions) -> int:
        calls.append((args, opts.subcommand, opts.subcommand_index))
        return 0

    fake = types.ModuleType("snapguard.shim.guarded")
    fake.run_guarded = run_guarded  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "snapguard.shim.guarded", fake)
    monkeypatch.setattr(os, "execv", lambda path, argv: pytest.fail(f"runc was exec'd: {argv}"))
    monkeypatch.setenv("SNAPGUARD_RUNC", sys.executable)
    args = ["--root", "R", "--", "checkpoint", "--image-path", "/img", "c1"]
    assert entry.main(["snapguard-runc", *args]) == 0
    assert calls == [(args, "checkpoint", 3)]


# --- checkpoint and restore flags: parse_subcommand


def test_parse_checkpoint() -> None:
    opts = split_global(CHECKPOINT)
    sub = parse_subcommand("checkpoint", CHECKPOINT[opts.subcommand_index + 1:])
    assert sub.container_id == "c1" and sub.image_path == "/img" and sub.work_path == "/work"
    assert sub.flag("leave-running") and sub.flag("tcp-established") and sub.multi["empty-ns"] == ["network"]


def test_parse_restore_with_go_single_dash_flag() -> None:
    opts = split_global(RESTORE)
    sub = parse_subcommand("restore", RESTORE[opts.subcommand_index + 1:])
    assert sub.flag("no-subreaper") and sub.flag("detach") and sub.value("bundle") == "/b"
    assert sub.value("pid-file") == "/p" and sub.container_id == "c1"
    assert parse_subcommand("restore", ["-no-subreaper", "-d", "-b=/b", "c1"]).bools == {"no-subreaper", "detach"}


def test_work_path_defaults_to_image_path() -> None:
    sub = parse_subcommand("checkpoint", ["--image-path=/img", "--leave-running=false", "c"])
    assert sub.work_path == "/img" and not sub.flag("leave-running")


@pytest.mark.parametrize("args, on", [
    (["--leave-running", "--leave-running=false", "c1"], False),  # the last one counts
    (["--leave-running=0", "--leave-running=T", "c1"], True),
    (["--leave-running=F", "c1"], False),
    (["-leave-running=TRUE", "c1"], True),
])
def test_bool_with_explicit_value(args: list[str], on: bool) -> None:
    assert parse_subcommand("checkpoint", args).flag("leave-running") is on


def test_flags_after_the_container_id_move_in_front() -> None:
    """urfave/cli's reorderArgs: `runc checkpoint c1 --image-path /img` checkpoints c1 into /img."""
    sub = parse_subcommand("checkpoint", ["c1", "--image-path", "/img", "--leave-running"])
    assert (sub.container_id, sub.image_path, sub.flag("leave-running")) == ("c1", "/img", True)


def test_double_dash_and_values_that_look_like_flags() -> None:
    assert parse_subcommand("checkpoint", ["--image-path", "/i", "--", "c1"]).container_id == "c1"
    sub = parse_subcommand("checkpoint", ["--image-path", "--leave-running", "c1"])
    assert sub.value("image-path") == "--leave-running" and not sub.flag("leave-running")


def test_empty_ns_repeats_and_status_fd_is_an_integer() -> None:
    sub = parse_subcommand("checkpoint", ["--empty-ns=network", "--empty-ns", "network", "--status-fd", "0x3", "c1"])
    assert sub.multi["empty-ns"] == ["network", "network"] and sub.value("status-fd") == "0x3"


@pytest.mark.parametrize("args, message", [
    (["--bogus", "c"], "flag provided but not defined: --bogus"),
    (["--image-path", "/i"], "expected exactly one container id, got 0"),
    (["--image-path", "/i", "a", "b"], "expected exactly one container id, got 2"),
    (["--leave-running=maybe", "c"], "invalid boolean value"),
    (["--leave-running=yes", "c"], "invalid boolean value"),
    (["c", "--image-path"], "expected exactly one container id"),
    # Flags after the first positional that runc does not move: they stay positionals.
    (["--leave-running", "c1", "--image-path", "/img"], "expected exactly one container id, got 3"),
    (["c1", "--", "--leave-running"], "expected exactly one container id"),
    (["c1", "--bogus"], "checkpoint: "),
    # urfave/cli 1.22.1 (runc 1.1's vendored copy) sees two arguments, 1.22.2+ one.
    (["--image-path", "/img", "c1", "--"], "expected exactly one container id, got 2"),
    (["--help", "c1"], "--help given"),
    (["-h", "c1"], "--help given"),
    (["--status-fd", "1_0", "c1"], "invalid value"),
    (["--empty-ns", "pid", "c1"], 'namespace "pid" is not supported'),
    (["--empty-ns=", "--empty-ns=network", "c1"], 'namespace "" is not supported'),
    ([""], "container id cannot be empty"),
    (["a/b"], "invalid container ID format"),
    ([".."], "invalid container ID format"),
    (["--image-path", "/i\0x", "c1"], "NUL byte"),
    (["c1\0"], "NUL byte"),
    (["--image-path", "/" + "x" * 4096, "c1"], "longer than 4096 bytes"),
])
def test_bad_checkpoint_argv(args: list[str], message: str) -> None:
    with pytest.raises(ArgvError, match=re.escape(message)) as e:
        parse_subcommand("checkpoint", args)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--parent-path", "p", "c1"], "flag provided but not defined: --parent-path"),  # checkpoint's only
    (["-b", "/a", "--bundle", "/b", "c1"], "Cannot use two forms of the same flag: b bundle"),
    (["--detach=on", "c1"], "invalid boolean value"),
    (["--bo\ngus", "c1"], "flag provided but not defined"),
])
def test_bad_restore_argv(args: list[str], message: str) -> None:
    with pytest.raises(ArgvError, match=re.escape(message)) as e:
        parse_subcommand("restore", args)
    assert "\n" not in str(e.value)


# --- the C launcher (c_helpers/runc_launcher.c) reads argv from the same table, the same way

REPO = Path(__file__).resolve().parents[2]

# Command lines on which the launcher and the Python entry must pick the same route: runc, or
# snapguard's Python entry (checkpoint, restore, and what the entry refuses).
ROUTE_CASES: list[list[str]] = [
    [], ["--version"], ["-v"], ["--help"], ["-h"], ["help"], ["h"], ["h", "checkpoint"], ["help", "restore"],
    CHECKPOINT, RESTORE, ["checkpoint"], ["restore", "c1"], ["state", "c1"], ["features"],
    *[["--root", "/r", verb, "c1"] for verb in RUNC_1_1_PASS_THROUGH],
    ["--", "checkpoint", "c1"], ["--root", "R", "--", "checkpoint", "c1"], ["--", "--", "checkpoint"],
    ["--", "state", "checkpoint"], ["-", "checkpoint"], ["", "checkpoint"], [""], ["-"], ["--"],
    ["--root", "checkpoint", "state", "c1"], ["--root", "--log", "state"], ["--log", "restore"],
    ["--root"], ["--root", "checkpoint"], ["--root=", "checkpoint", "c"], ["-root=/r", "--criu=/c", "checkpoint", "c"],
    ["--bogus", "checkpoint", "c1"], ["--bogus", "state", "c1"], ["--bogus"], ["---root", "x", "restore"],
    ["-=x", "checkpoint"], ["--=x", "state"], ["---", "state"],
    ["--debug=maybe", "checkpoint"], ["--debug=maybe", "state"], ["--debug=false", "checkpoint", "c"],
    ["--debug=", "restore"], ["--debug", "true", "checkpoint"], ["--systemd-cgroup=T", "restore", "c"],
    ["--help", "-h", "state"], ["--help", "-h", "checkpoint"], ["--help", "--help", "checkpoint"],
    ["-v", "--version", "restore"], ["--version", "checkpoint", "c"], ["--help", "restore", "c"],
    ["--log-format=xml", "checkpoint", "c"], ["--log-format", "xml", "state"],
    ["--root", "a" * 4096, "checkpoint", "c"], ["--root", "a" * 4097, "checkpoint", "c"],
    ["--root=" + "a" * 4097, "state"], ["--root", "a" * 4097, "state"],
    ["checkpointx"], ["CHECKPOINT", "c"], ["unknown", "restore"], ["unknown"], ["unknown", "--", "x"],
    ["state", "--root", "x", "checkpoint"], ["spec", "checkpoint"], ["run", "restore"],
    ["é", "checkpoint"], ["-é", "checkpoint"], ["--é=1", "state"], ["--root", "\udcff\udcfe", "checkpoint", "c"],
    ["\udcff", "restore"], ["--log\udcff", "restore"], ["--\udcffroot", "state"],
    ["arg with space", "restore"], ["--root", "a b", "create", "--bundle", "/b", "c"], ["-debug", "-root", "/x", "kill"],
    ["--criu", "/usr/local/sbin/criu", "--rootless", "auto", "checkpoint", "--image-path", "/i", "c"],
    ["--rootless=true", "delete", "-f", "c"], ["-log-format", "json", "-log", "/l", "events", "--stats", "c"],
    ["--root", "/r", "resume", "c"], ["resume"], ["state", "resume"], ["--bogus", "resume", "c"], ["-root=/r", "resume"],
]


def _random_cases(count: int, seed: int = 12) -> list[list[str]]:
    import random

    rng = random.Random(seed)
    pool = ["--root", "-root", "--root=/r", "--log", "--log=/l", "--log-format", "json", "--debug", "--debug=t",
            "--debug=x", "-debug=0", "--systemd-cgroup", "--criu", "--rootless", "--help", "-h", "--version", "-v",
            "--", "-", "", "---x", "-=x", "--bogus", "checkpoint", "restore", "resume", "state", "create", "help", "h",
            "c1", "/x", "--image-path", "--leave-running", "=", "-x=y", "--log=", "checkpoint=1"]
    return [[rng.choice(pool) for _ in range(rng.randint(0, 6))] for _ in range(count)]


def _python_route(args: list[str]) -> str:
    """Where the launcher must send `args`: to runc where the entry would pass them on as they are,
    to the entry where it refuses, guards, or passes them on after a step of its own (resume)."""
    action, _ = decide(args)
    try:
        verb = split_global(args).subcommand
    except _argv.ArgvError:
        verb = None
    return "runc" if action == "pass" and verb not in _argv.ENTRY_VERBS else "snapguard"


@pytest.fixture(scope="module")
def route_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The launcher's parser compiled into its test program (-DSG_ROUTE_TEST): it prints the route."""
    from snapguard.install import build_launcher

    path = tmp_path_factory.mktemp("launcher") / "route"
    path.write_bytes(build_launcher("/etc/snapguard/config.toml", route_test=True,
                                    source_dir=str(REPO / "c_helpers")))
    path.chmod(0o755)
    return path


def test_the_launchers_table_is_generated_from_this_one() -> None:
    """c_helpers/runc_argv_table.h is what build_launcher.py generates from VERB_TABLE and GLOBAL_FLAGS."""
    spec = importlib.util.spec_from_file_location("build_launcher", REPO / "c_helpers" / "build_launcher.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (REPO / "c_helpers" / "runc_argv_table.h").read_text() == module.render_header(), (
        "c_helpers/runc_argv_table.h is stale: run python c_helpers/build_launcher.py --write")


def test_the_launcher_routes_as_the_python_entry_decides(route_program: Path) -> None:
    cases = ROUTE_CASES + _random_cases(400)
    wrong = []
    for args in cases:
        out = subprocess.run([route_program, *map(os.fsencode, args)], capture_output=True, timeout=30)
        assert out.returncode == 0, out.stderr
        got, want = out.stdout.decode().strip(), _python_route(args)
        if got != want:
            wrong.append((args if len(repr(args)) < 200 else repr(args)[:200], got, want))
    assert not wrong, wrong
    routes = {_python_route(args) for args in ROUTE_CASES}
    assert routes == {"runc", "snapguard"}  # both routes exercised
