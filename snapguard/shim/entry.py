"""`snapguard-runc`: the executor containerd runs in place of runc.

Every subcommand but checkpoint and restore replaces this process with the real runc, argv
unchanged but argv[0]; that path imports only os, sys and the two small modules below, because
its cost is added to every container operation on the node.
"""

from __future__ import annotations

import os
import sys

from ..config import ConfigError, pinned_runc
from ._argv import ArgvError, split_global

GUARDED = ("checkpoint", "restore")


def _fail(reason: str, message: str, args: list[str]) -> int:
    # Rare path: now the heavier modules may load.
    from ..reasons import Failure, Reason
    from ._runclog import report_failure

    try:
        opts = split_global(args)
        log, log_format = opts.log, opts.log_format
    except ArgvError:
        log, log_format = None, "text"
    return report_failure(Failure(Reason[reason], message), log, log_format, None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    args = argv[1:]
    try:
        opts = split_global(args)
    except ArgvError as e:
        return _fail("USAGE_ERROR", str(e), args)
    if opts.subcommand not in GUARDED:
        try:
            runc = pinned_runc()
        except ConfigError as e:
            return _fail(e.reason, str(e), args)
        os.execv(runc, [runc, *args])
    from .guarded import run_guarded

    return run_guarded(args, opts)


if __name__ == "__main__":
    sys.exit(main())
