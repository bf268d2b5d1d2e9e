"""`snapguard`: the operator's CLI (preflight gates, snapshots, stores, the agent, install).

One module per command, each mapping its flags onto the record the layer below takes and calling
one function there: `add_parser(sub)` adds the command's parser, `run(args)` runs it and returns
the exit status. build_parser() returns the whole parser (every command, with its help, as the
CLI reference is generated from it); main() is the console script. Every failure leaves as one
typed line on stderr, never a traceback: exit 2 for usage and configuration, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..reasons import failure_from
from . import (agent, checkpoint, completion, drill, images, inspect, install, metrics, notice, plan, preflight,
               protect, prune, pull, push, reasons, restore, webhook)
from ._base import EXIT_USAGE, Parser, exit_code

__all__ = ["COMMANDS", "EXIT_USAGE", "build_parser", "main"]

# In the order `snapguard --help` lists them.
COMMANDS = {"preflight": preflight, "checkpoint": checkpoint, "restore": restore, "reasons": reasons,
            "drill": drill, "plan": plan, "install": install, "metrics": metrics, "push": push, "pull": pull,
            "prune": prune, "images": images, "inspect": inspect, "agent": agent, "notice": notice, "protect": protect,
            "webhook": webhook, "completion": completion}


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand's parser is in its `_subparsers` choices."""
    p = Parser(prog="snapguard", description=(
        "Operator CLI of snapguard, the guarded runc executor. containerd runs `snapguard-runc` in "
        "place of runc; this command checks nodes, workloads and images ahead of time and runs drills."))
    p.add_argument("--version", action="version", version=f"snapguard {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `snapguard` console script: the command's exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["drill"]:
        return drill.run(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # the boundary: one typed line, never a traceback
        failure = failure_from(e)
        print(failure.message, file=sys.stderr)
        return exit_code(failure, e)

