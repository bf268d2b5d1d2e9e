"""`snapguard-lab`: the drills of snapguard's lab (the product's CLI is `snapguard`)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import NoReturn

from . import __version__
from .arms import DEFAULT_TORCH_ARMS, TORCH_ARMS

PROG = "snapguard-lab"
EXIT_USAGE = 2


def _usage_error(message: str) -> int:
    """One typed line, as snapguard's own CLI writes them: CI logs and scripts read the first line."""
    print(f"{PROG} USAGE_ERROR: {message}", file=sys.stderr)
    return EXIT_USAGE


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One typed line instead of argparse's usage dump.
        sys.exit(_usage_error(f"{message} (see {self.prog} --help)"))


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=(
        "The lab of snapguard, the guarded runc executor: drills that snapshot real workloads through "
        "snapguard and show they continued where they stopped. Installed apart from the product "
        "(`snapguard` never imports it); its example workloads are package data."))
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    dr = sub.add_parser("drill", help="a real snapshot drill through containerd, runc and CRIU",
                        description=(
                            "Start containerd (own root, BinaryName snapguard-runc) if needed, run a counter "
                            "container built locally from the lab's counter workload, checkpoint it through "
                            "ctr (leave-running and exit variants), restore it, and show that it continued "
                            "where it stopped. Exit 0: every variant continued; 1: one did not or the drill "
                            "failed; 2: usage or configuration error."))
    dr.add_argument("--workload", choices=("counter", "torch"), default="counter",
                    help="counter: the CPU container drill (default); torch: snapshots of a live PyTorch "
                         "trainer on the GPU, compared bit for bit with an uninterrupted run")
    dr.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    dr.add_argument("--workdir", metavar="DIR", help="keep containerd's root and the images here")
    dr.add_argument("--steps", type=int, default=200, help="torch: training steps per run (default 200)")
    dr.add_argument("--at", type=int, default=80, help="torch: snapshot after this step (default 80)")
    dr.add_argument("--arms", default=",".join(DEFAULT_TORCH_ARMS), metavar="LIST",
                    help="torch: comma-separated arms among " + ", ".join(TORCH_ARMS) +
                         f" (default {','.join(DEFAULT_TORCH_ARMS)}; compile takes minutes of compiling)")
    return p


def _cmd_drill(args: argparse.Namespace) -> int:
    if args.workload == "torch":
        # checked before the drill (and snapguard's snapshot pipeline behind it) is imported
        if not 0 < args.at < args.steps:
            return _usage_error("--at must be between 0 and --steps")
        arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
        unknown = [a for a in arms if a not in TORCH_ARMS]
        if unknown or not arms:
            return _usage_error(f"--arms: unknown {', '.join(unknown) or '(empty)'}; choose among "
                                f"{', '.join(TORCH_ARMS)}")
        from snapguard.config import load

        from .torch_drill import run_torch_drill

        return run_torch_drill(load(), args.workdir or tempfile.mkdtemp(prefix="snapguard-torch-"),
                               steps=args.steps, at=args.at, json_path=args.json, arms=arms)
    from .drill import run_drill

    return run_drill(json_path=args.json, workdir=args.workdir)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from snapguard.config import ConfigError

    try:
        return {"drill": _cmd_drill}[args.command](args)
    except ConfigError as e:
        print(f"{PROG} {e.reason}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
