"""Parsing the argv that go-runc (containerd's runc shim) emits.

Global flags come before the subcommand, then the subcommand's own flags and the container id.
Like runc's CLI library, flags may be written with one or two dashes and as `--flag value` or
`--flag=value` (go-runc writes `-no-subreaper` with one dash). This module imports only the
standard library's lightest parts: the pass-through path uses `split_global`.
"""

from __future__ import annotations

import os

__all__ = ["ArgvError", "GlobalOptions", "SubcommandArgs", "split_global", "parse_subcommand"]

# runc's global flags: those that take a value, and booleans.
GLOBAL_VALUE_FLAGS = frozenset({"root", "log", "log-format", "criu", "rootless"})
GLOBAL_BOOL_FLAGS = frozenset({"debug", "systemd-cgroup", "help", "h", "version", "v"})

CHECKPOINT_VALUE_FLAGS = frozenset({
    "image-path", "work-path", "parent-path", "page-server", "status-fd", "manage-cgroups-mode", "empty-ns",
})
CHECKPOINT_BOOL_FLAGS = frozenset({
    "leave-running", "tcp-established", "tcp-skip-in-flight", "link-remap", "ext-unix-sk", "shell-job",
    "lazy-pages", "file-locks", "pre-dump", "auto-dedup",
})
RESTORE_VALUE_FLAGS = frozenset({
    "image-path", "work-path", "parent-path", "console-socket", "bundle", "b", "pid-file", "manage-cgroups-mode",
    "empty-ns", "lsm-profile", "lsm-mount-context",
})
RESTORE_BOOL_FLAGS = frozenset({
    "tcp-established", "ext-unix-sk", "shell-job", "file-locks", "detach", "d", "no-subreaper", "no-pivot",
    "auto-dedup", "lazy-pages",
})
_FLAGS = {
    "checkpoint": (CHECKPOINT_VALUE_FLAGS, CHECKPOINT_BOOL_FLAGS),
    "restore": (RESTORE_VALUE_FLAGS, RESTORE_BOOL_FLAGS),
}
_ALIASES = {"b": "bundle", "d": "detach"}
_TRUE = {"true", "1", "t", "yes"}
_FALSE = {"false", "0", "f", "no"}


class ArgvError(Exception):
    """The command line is not one runc would accept; the message is one line."""


class GlobalOptions:
    """runc's global flags, with the index of the subcommand in argv."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.bools: set[str] = set()
        self.subcommand: str | None = None
        self.subcommand_index = 0

    @property
    def root(self) -> str | None:
        return self.values.get("root")

    @property
    def log(self) -> str | None:
        return self.values.get("log")

    @property
    def log_format(self) -> str:
        return self.values.get("log-format", "text")

    @property
    def criu(self) -> str | None:
        return self.values.get("criu")


def _flag_name(token: str) -> tuple[str, str | None] | None:
    """('name', inline value or None) for a flag token, None for a positional one."""
    if len(token) < 2 or not token.startswith("-") or token == "--":
        return None
    name = token[2:] if token.startswith("--") else token[1:]
    if "=" in name:
        name, value = name.split("=", 1)
        return name, value
    return name, None


def _flag_value(args: list[str], i: int, name: str, inline: str | None, where: str) -> tuple[str, int]:
    """The value of the value flag at args[i]: written inline (`--f=v`) or as the next token."""
    if inline is not None:
        return inline, i
    if i + 1 >= len(args):
        raise ArgvError(f"{where}flag needs an argument: -{name}")
    return args[i + 1], i + 1


def split_global(args: list[str]) -> GlobalOptions:
    """Parse the global flags in args (argv without argv[0]) up to the subcommand."""
    opts = GlobalOptions()
    i = 0
    while i < len(args):
        parsed = _flag_name(args[i])
        if parsed is None:
            opts.subcommand = args[i]
            opts.subcommand_index = i
            return opts
        name, value = parsed
        if name in GLOBAL_VALUE_FLAGS:
            value, i = _flag_value(args, i, name, value, "")
            opts.values[name] = value
        elif name in GLOBAL_BOOL_FLAGS:
            opts.bools.add(name)
        else:
            # Unknown global flags are runc's to reject: stop here and pass everything through.
            opts.subcommand_index = i
            return opts
        i += 1
    opts.subcommand_index = len(args)
    return opts


class SubcommandArgs:
    """The flags and container id of a checkpoint or restore command line."""

    def __init__(self, subcommand: str) -> None:
        self.subcommand = subcommand
        self.values: dict[str, str] = {}
        self.multi: dict[str, list[str]] = {}
        self.bools: set[str] = set()
        self.container_id = ""

    def value(self, name: str) -> str | None:
        return self.values.get(name)

    def flag(self, name: str) -> bool:
        return name in self.bools

    @property
    def image_path(self) -> str:
        # runc's defaults: ./checkpoint for images, the image directory for logs and work files.
        return os.path.abspath(self.values.get("image-path") or "checkpoint")

    @property
    def work_path(self) -> str:
        return os.path.abspath(self.values.get("work-path") or self.image_path)


def parse_subcommand(subcommand: str, args: list[str]) -> SubcommandArgs:
    """Parse the arguments after `checkpoint` or `restore`; the container id is required."""
    value_flags, bool_flags = _FLAGS[subcommand]
    parsed = SubcommandArgs(subcommand)
    positional: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        flag = _flag_name(token)
        if flag is None or positional:
            positional.append(token)
            i += 1
            continue
        name, value = flag
        canonical = _ALIASES.get(name, name)
        if name in value_flags:
            value, i = _flag_value(args, i, name, value, f"{subcommand}: ")
            if canonical == "empty-ns":
                parsed.multi.setdefault(canonical, []).append(value)
            parsed.values[canonical] = value
        elif name in bool_flags:
            if value is None or value.lower() in _TRUE:
                parsed.bools.add(canonical)
            elif value.lower() not in _FALSE:
                raise ArgvError(f"{subcommand}: invalid boolean value {value!r} for -{name}")
        else:
            raise ArgvError(f"{subcommand}: flag provided but not defined: {token}")
        i += 1
    if len(positional) != 1:
        raise ArgvError(f"{subcommand}: expected exactly one container id, got {len(positional)}")
    parsed.container_id = positional[0]
    return parsed
