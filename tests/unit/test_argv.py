import pytest

from snapguard.shim._argv import ArgvError, parse_subcommand, split_global

# What go-runc (containerd 1.6's runc shim) emits.
CHECKPOINT = ["--root", "/run/containerd/runc/k8s.io", "--log", "/x/log.json", "--log-format", "json",
              "checkpoint", "--image-path", "/img", "--work-path", "/work", "--leave-running",
              "--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks", "--empty-ns", "network", "c1"]
RESTORE = ["--root", "/r", "--log", "/l", "--log-format", "json", "--systemd-cgroup", "restore",
           "--image-path", "/img", "--work-path", "/w", "--detach", "--pid-file", "/p",
           "--console-socket", "/s", "--no-pivot", "-no-subreaper", "--bundle", "/b", "c1"]


def test_split_global_finds_subcommand_and_flags() -> None:
    opts = split_global(CHECKPOINT)
    assert opts.subcommand == "checkpoint" and opts.subcommand_index == 6
    assert opts.root == "/run/containerd/runc/k8s.io" and opts.log == "/x/log.json" and opts.log_format == "json"


def test_split_global_equals_and_single_dash_forms() -> None:
    opts = split_global(["-root=/r", "--debug", "--criu=/c", "state", "x"])
    assert (opts.root, opts.criu, opts.subcommand) == ("/r", "/c", "state")
    assert "debug" in opts.bools


def test_split_global_missing_value() -> None:
    with pytest.raises(ArgvError, match="flag needs an argument: -root"):
        split_global(["--root"])


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


def test_work_path_defaults_to_image_path() -> None:
    sub = parse_subcommand("checkpoint", ["--image-path=/img", "--leave-running=false", "c"])
    assert sub.work_path == "/img" and not sub.flag("leave-running")


@pytest.mark.parametrize("args, message", [
    (["--bogus", "c"], "flag provided but not defined: --bogus"),
    (["--image-path", "/i"], "expected exactly one container id, got 0"),
    (["--image-path", "/i", "a", "b"], "expected exactly one container id, got 2"),
    (["--leave-running=maybe", "c"], "invalid boolean value"),
    (["c", "--image-path"], "expected exactly one container id"),
])
def test_bad_subcommand_argv(args: list[str], message: str) -> None:
    with pytest.raises(ArgvError, match=message):
        parse_subcommand("checkpoint", args)
