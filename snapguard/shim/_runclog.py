"""Reporting a failure the way runc does, so containerd shows it.

containerd's shim reads the last error line of runc's `--log` file and shows the first line of its
message; so the message is one self-contained line, and the full record goes to
`<work-path>/snapguard-result.json`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

from ..reasons import Failure

__all__ = ["report_failure", "write_log_line"]


def _rfc3339_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def write_log_line(log_path: str | None, log_format: str, level: str, msg: str) -> None:
    """Append one line in runc's format to --log; stderr when no log file was given."""
    if log_format == "json":
        line = json.dumps({"level": level, "msg": msg, "time": _rfc3339_now()})
    else:
        line = f'time="{_rfc3339_now()}" level={level} msg={json.dumps(msg)}'
    if not log_path:
        print(line, file=sys.stderr)
        return
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(line + "\n")
    except OSError as e:
        print(f"snapguard: cannot write to --log {log_path}: {e.strerror}", file=sys.stderr)
        print(line, file=sys.stderr)


def report_failure(failure: Failure, log_path: str | None, log_format: str, work_path: str | None,
                   code: int = 1) -> int:
    """Write the failure to --log, stderr and the result file; return `code`: 1 (refused or
    failed, as runc's), or 2 (the command line, the configuration or the install is unusable:
    nothing was tried), the exit codes `snapguard` keeps too."""
    write_log_line(log_path, log_format, "error", failure.message)
    if log_path:
        print(failure.message, file=sys.stderr)
    if work_path:
        from ..pipeline import write_record

        try:
            write_record(work_path, failure.to_dict(), create=True, follow_link=True)
        except Exception as e:  # called from the boundary's own handler: nothing may escape it
            print(f"snapguard: cannot write result to {work_path}: {e}", file=sys.stderr)
    return code
