"""`snapguard-runc`: the executor containerd runs in place of runc.

Every command line on which runc would run neither checkpoint nor restore replaces this process
with the real runc, argv unchanged but argv[0]; that path imports only os, sys and the two small
modules below, because its cost is added to every container operation on the node. `decide`
reads argv as runc does (see _argv); where it cannot tell which command runc would run and the
command line names checkpoint or restore, it refuses rather than let runc run unguarded.
"""

from __future__ import annotations

import os
import sys

from ..config import ConfigError, pinned_runc
from ._argv import ENTRY_VERBS, GUARDED_VERBS, PASS_THROUGH_VERBS, ArgvError, GlobalOptions, one_line, split_global


def decide(args: list[str]) -> tuple[str, GlobalOptions | str | None]:
    """What to do with runc's argv (without argv[0]), decided as runc would read it.

    ("guard", opts): runc would run checkpoint or restore; opts are the global options.
    ("pass", None): runc would run another command, or fail on its own: exec it unchanged.
    ("refuse", message): runc might checkpoint or restore, but not as snapguard can tell; or
    it would run neither as written: fail with a one-line USAGE_ERROR.
    """
    for i, arg in enumerate(args):
        if "\0" in arg:  # exec could not even pass it on
            return "refuse", f"argument {i + 1} contains a NUL byte"
    try:
        opts = split_global(args)
    except ArgvError as e:
        return _unsure(args, str(e))
    verb = opts.subcommand
    if verb in GUARDED_VERBS:
        if opts.help_or_version:
            return "refuse", f"{verb} with --help or --version: runc would print them instead"
        if opts.log_format not in ("", "text", "json"):
            return "refuse", f"invalid log-format: {one_line(opts.log_format)}"
        return "guard", opts
    if verb in PASS_THROUGH_VERBS:
        return "pass", None
    return _unsure(args, "no command" if verb is None else f"unknown command {one_line(verb)}")


def _unsure(args: list[str], why: str) -> tuple[str, str | None]:
    """The verb runc would run is unknown: refuse if the command line names a guarded verb
    anywhere, else let runc run and print its own error."""
    named = [verb for verb in GUARDED_VERBS if verb in args]
    if named:
        return "refuse", f"{why}; refusing a command line that names {named[0]}"
    return "pass", None


def _help_asked(args: list[str]) -> str | None | bool:
    """The command whose help is asked: None for the app's (`--help` among the global flags),
    checkpoint or restore for theirs; False when no help of snapguard's is asked (runc's other
    commands print their own)."""
    try:
        opts = split_global(args)
    except ArgvError:
        return False
    if "help" in opts.bools:
        return None
    if opts.subcommand in GUARDED_VERBS:
        from ._help import asks_help

        if asks_help(args[opts.subcommand_index + 1:]):
            return opts.subcommand
    return False


def _fail(reason: str, message: str, args: list[str]) -> int:
    # Rare path: now the heavier modules may load.
    from ..reasons import Failure, Reason
    from ._runclog import report_failure

    try:
        opts = split_global(args)
    except ArgvError as e:
        opts = e.opts or GlobalOptions()  # the flags before the error: --log is usually among them
    # a command line or a configuration it cannot use: exit 2, as `snapguard` does
    return report_failure(Failure(Reason[reason], message), opts.log, opts.log_format, None, 2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    args = argv[1:]
    verb = _help_asked(args) if any(a.lstrip("-").split("=")[0] in ("h", "help") for a in args) else False
    if verb is not False:  # snapguard's own help first, then the real runc's
        from ._help import help_text

        sys.stdout.write(help_text(verb))
        return 0
    action, detail = decide(args)
    if action == "refuse":
        assert isinstance(detail, str)
        return _fail("USAGE_ERROR", detail, args)
    if action == "guard":
        assert isinstance(detail, GlobalOptions)
        from .guarded import run_guarded

        return run_guarded(args, detail)
    try:
        runc = pinned_runc()
    except ConfigError as e:
        return _fail(e.reason, str(e), args)
    if any(verb in args for verb in ENTRY_VERBS):  # resume: a pause a killed executor lifted goes back first
        from ._resume import before_resume

        before_resume(args)
    os.execv(runc, [runc, *args])
    return 1  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main())
