"""The guarded verbs' boundary: config, argv, and every failure turned into one typed report.

This is where snapguard-runc's errors become reasons (psutil's `wrap_exceptions` is the model):
below it, code raises SnapguardError; what else escapes is typed here, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

from .. import pipeline
from ..config import ConfigError, check_pinned_binary, load
from ..reasons import Failure, Reason, SnapguardError, failure_from
from ._argv import ArgvError, GlobalOptions, parse_subcommand
from ._records import keep
from ._runclog import report_failure

__all__ = ["run_guarded"]


def _failure(e: BaseException) -> Failure:
    if isinstance(e, ArgvError):
        return Failure(Reason.USAGE_ERROR, str(e))
    return failure_from(e)


def run_guarded(args: list[str], opts: GlobalOptions) -> int:
    assert opts.subcommand in ("checkpoint", "restore")
    work_path: str | None = None
    container_id, state_dir = "", ""
    try:
        sub = parse_subcommand(opts.subcommand, args[opts.subcommand_index + 1:])
        work_path, container_id = sub.work_path, sub.container_id
        config = load()
        state_dir = config.state_dir
        problem = check_pinned_binary(config.runc, "runc")
        if problem:
            raise SnapguardError(Reason.RUNC_UNUSABLE, problem, evidence={"path": config.runc})
        if opts.subcommand == "checkpoint":
            from .checkpoint import checkpoint as verb
        else:
            from .restore import restore as verb
        result: dict[str, Any] = verb(config, args, opts, sub)
    except KeyboardInterrupt:
        return report_failure(Failure(Reason.INTERNAL_ERROR, "interrupted"), opts.log, opts.log_format, work_path)
    except Exception as e:  # the boundary: every failure is one typed line, never a traceback
        failure = _failure(e)
        if state_dir:
            keep(state_dir, opts.subcommand, container_id, failure.to_dict())
        unusable = isinstance(e, ConfigError) or failure.reason.phase.value == "usage"
        return report_failure(failure, opts.log, opts.log_format, work_path, 2 if unusable else 1)
    keep(state_dir, opts.subcommand, container_id, result)
    try:
        pipeline.write_record(sub.work_path, result, create=True, follow_link=True)
    except OSError as e:
        print(f"snapguard: cannot write result to {sub.work_path}: {e.strerror}", file=sys.stderr)
    return 0
