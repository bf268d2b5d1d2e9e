"""`snapguard`: the operator's CLI (preflight gates, snapshots, stores, the agent, install).

One module per command, each mapping its flags onto the record the layer below takes and calling
one function there: `add_parser(sub)` adds the command's parser, `run(args)` runs it and returns
the exit status. build_parser() returns the whole parser (every command, with its help, as the
CLI reference is generated from it); main() is the console script, which imports and builds only
the command it is asked for (a command's start is then its own imports: `snapguard notice` does
not load the agent, the installer or the webhook). Every failure leaves as one typed line on
stderr, never a traceback: exit 2 for usage and configuration, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

from .. import __version__
from ..reasons import failure_from
from ._base import EXIT_USAGE, Parser, exit_code

__all__ = ["COMMANDS", "EXIT_USAGE", "build_parser", "command", "main"]

# Each command, the name of its module in this package, in the order `snapguard --help` lists them.
COMMANDS = ("preflight", "checkpoint", "restore", "reasons", "drill", "plan", "install", "metrics", "push", "pull",
            "prune", "images", "inspect", "agent", "notice", "protect", "webhook", "completion")


def command(name: str) -> ModuleType:
    """The module of the command `name` (one of COMMANDS), imported."""
    if name not in COMMANDS:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line: every subcommand's parser is in its `_subparsers` choices. With
    `only` (one of COMMANDS), that command's alone: what main() parses a command line with."""
    p = Parser(prog="snapguard", description=(
        "Operator CLI of snapguard, the guarded runc executor. containerd runs `snapguard-runc` in "
        "place of runc; this command checks nodes, workloads and images ahead of time and runs drills."))
    p.add_argument("--version", action="version", version=f"snapguard {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS if only is None else (only,):
        command(name).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `snapguard` console script: the command's exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["drill"]:
        return int(command("drill").run(argv[1:]))
    # a command named first is parsed by its parser alone; anything else (--help, --version, a
    # mistyped command) by the whole one, which lists every command
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        return int(command(args.command).run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # the boundary: one typed line, never a traceback
        failure = failure_from(e)
        print(failure.message, file=sys.stderr)
        return exit_code(failure, e)

