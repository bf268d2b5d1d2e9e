"""What the commands share: the parser that prints one typed line, exit codes, argument types,
the record a snapshot writes, and a store failure's report."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn

from ..config import ConfigError
from ..reasons import Failure, Reason, SnapguardError, failure_from

__all__ = ["EXIT_FALLBACK", "EXIT_USAGE", "STORE_EPILOG", "Deprecated", "Parser", "capabilities", "exit_code",
           "need_store", "store_flag",
           "positive_seconds", "print_result", "progress", "root_only", "seconds", "seconds_or_off",
           "snapshot", "store_failure", "unchecked_report", "write_record"]

EXIT_USAGE = 2
EXIT_FALLBACK = 3  # restore --store refused and the job has a file checkpoint: its path is on stdout

STORE_EPILOG = """\
store URLs: file:///shared/dir (a directory every node mounts) or s3://bucket/prefix (boto3, the
`s3` extra; endpoint from $S3_ENDPOINT_URL / $AWS_ENDPOINT_URL_S3, keys from boto3's usual chain).
An image counts in a store only once its completion marker, put last, is there.
"""


class Deprecated(argparse.Action):
    """An old spelling kept for a release: hidden from --help, stores into the new flag's dest
    and says once on stderr which flag replaces it."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kw: Any) -> None:
        kw.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"snapguard: {option_string} is deprecated, use {self.new} (the old spelling goes in a later "
              "release)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def store_flag(parser: argparse.ArgumentParser, old: str, *, required: bool, help: str = "the store") -> None:
    """--store URL, with the command's old spelling `old` (--to, --from) as a hidden alias."""
    # a required flag with an alias is checked after parsing (need_store), so either spelling counts
    parser.add_argument("--store", dest="store", metavar="URL", help=help + (" (required)" if required else ""))
    parser.add_argument(old, dest="store", action=Deprecated, new="--store", metavar="URL")


def need_store(args: argparse.Namespace, command: str) -> str:
    """The --store a command requires (USAGE_ERROR without it)."""
    if not getattr(args, "store", None):
        raise SnapguardError(Reason.USAGE_ERROR, f"{command} needs --store URL")
    return str(args.store)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one typed line (exit 2)."""

    def error(self, message: str) -> NoReturn:
        # One typed line instead of argparse's usage dump: CI logs and scripts read the first line.
        print(f"snapguard USAGE_ERROR: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def exit_code(failure: Failure, e: BaseException) -> int:
    """2 for a usage or configuration error, else 1."""
    return EXIT_USAGE if failure.reason.phase.value == "usage" or isinstance(e, ConfigError) else 1


def capabilities(text: str) -> tuple[str, ...]:
    """--require LIST: capability names, or `all`."""
    from ..preflight import CAPABILITY_NAMES

    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names == ("all",):
        return CAPABILITY_NAMES
    unknown = [n for n in names if n not in CAPABILITY_NAMES]
    if unknown or not names:
        what = f"unknown capability {', '.join(unknown)}" if unknown else "no capability named"
        raise argparse.ArgumentTypeError(f"{what}; known: {', '.join(CAPABILITY_NAMES)}, or all")
    return names


def seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and value != float("inf")):  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text}")
    return value


def seconds_or_off(text: str) -> float:
    """Seconds > 0, or 0: off."""
    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass
    return positive_seconds(text)


def unchecked_report(e: Exception, target: str) -> Any:
    """The report of a gate that could not check: its typed line on stderr, one failed check."""
    from .. import preflight

    failure = failure_from(e)
    if failure.reason is Reason.INTERNAL_ERROR:  # an unknown here is a check that could not run
        failure = Failure(Reason.PREFLIGHT_FAILED, preflight.check_error_message(e))
    print(failure.message, file=sys.stderr)
    return preflight.Report(target, checks=[preflight.CheckResult(
        "preflight", error=failure.detail, error_reason=failure.reason)])


def print_result(result: dict, as_json: bool) -> None:
    """A checkpoint's or restore's result record: JSON, or its timings and warnings."""
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
        return
    t = result.get("timings", {})
    print(f"snapguard {result['operation']}: ok, " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
    for w in result.get("warnings", []):
        print(f"  warning {w['reason']}: {w['detail']}")


def snapshot(args: argparse.Namespace, work_dir: str, run) -> int:
    """Run a checkpoint or restore; its record goes to stdout (--json) and into the work dir."""
    from .. import pipeline

    try:
        result = run()
    except SnapguardError as e:
        print(e.failure.message, file=sys.stderr)
        if args.json:
            print(json.dumps(e.failure.to_dict(), indent=2, sort_keys=True, default=str))
        write_record(pipeline, work_dir, e.failure.to_dict())
        return 1
    write_record(pipeline, work_dir, result)
    print_result(result, args.json)
    return 0


def write_record(pipeline, work_dir: str, record: dict) -> None:
    """The result record into the work dir; a failure to write it is said, not raised."""
    try:
        pipeline.write_record(work_dir, record)
    except OSError as e:
        print(f"snapguard: cannot write the record into {work_dir}: {e.strerror}", file=sys.stderr)


def progress(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ..store import terminal_progress

    return terminal_progress(args.progress)


def store_failure(args: argparse.Namespace, e: SnapguardError) -> int:
    """The stream a transfer draws its progress on (--progress), or None."""
    print(e.failure.message, file=sys.stderr)
    if args.json:
        print(json.dumps(e.failure.to_dict(), indent=2, sort_keys=True, default=str))
    return 1



def root_only(what: str) -> None:
    """The agent's commands need root: INSUFFICIENT_PRIVILEGE otherwise."""
    if os.geteuid() != 0:
        raise SnapguardError(Reason.INSUFFICIENT_PRIVILEGE, f"{what} needs root (the agent's state is root's alone)")
