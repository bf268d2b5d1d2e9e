"""The guarded verbs' common frame: config, argv, and turning every failure into a typed report."""

from __future__ import annotations

import os
import sys

from ..config import ConfigError, load
from ..config import check_pinned_binary
from ..files import write_private_json
from ..reasons import Failure, Reason, SnapguardError
from ._argv import ArgvError, GlobalOptions, parse_subcommand
from ._runclog import report_failure

__all__ = ["run_guarded"]


def run_guarded(args: list[str], opts: GlobalOptions) -> int:
    assert opts.subcommand in ("checkpoint", "restore")
    work_path = None
    try:
        sub = parse_subcommand(opts.subcommand, args[opts.subcommand_index + 1:])
        work_path = sub.work_path
        config = load()
        problem = check_pinned_binary(config.runc, "runc")
        if problem:
            raise SnapguardError(Reason.RUNC_UNUSABLE, problem, evidence={"path": config.runc})
        if opts.subcommand == "checkpoint":
            from .checkpoint import checkpoint as verb
        else:
            from .restore import restore as verb
        result = verb(config.runc, args, opts, sub, config)
    except SnapguardError as e:
        return report_failure(e.failure, opts.log, opts.log_format, work_path)
    except ArgvError as e:
        return report_failure(Failure(Reason.USAGE_ERROR, str(e)), opts.log, opts.log_format, None)
    except ConfigError as e:
        return report_failure(Failure(Reason[e.reason], str(e)), opts.log, opts.log_format, work_path)
    except OSError as e:
        # Anything the checks did not foresee (a full disk, a vanished directory) is still typed.
        failure = Failure(Reason.PREFLIGHT_FAILED, f"{e.strerror or e}: {e.filename or ''}".rstrip(": "))
        return report_failure(failure, opts.log, opts.log_format, work_path)
    try:
        write_private_json(os.path.join(sub.work_path, "snapguard-result.json"), result)
    except OSError as e:
        print(f"snapguard: cannot write result to {sub.work_path}: {e.strerror}", file=sys.stderr)
    return 0
