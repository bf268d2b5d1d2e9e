"""`snapguard-lab`: the drills of snapguard's lab (the product's CLI is `snapguard`)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import NoReturn

from . import __version__
from .arms import DEFAULT_TORCH_ARMS, GOODPUT_ARMS, TORCH_ARMS

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


def _parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=(
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
    dr.add_argument("--json", nargs="?", const=True, default=None, metavar="PATH",
                    help="the results as JSON: into --out PATH, else on stdout at the end (`--json PATH`, "
                         "without --out, is the old spelling of `--json --out PATH`)")
    dr.add_argument("--out", metavar="PATH", help="write the results as JSON to PATH")
    dr.add_argument("--workdir", metavar="DIR", help="keep containerd's root and the images here")
    dr.add_argument("--steps", type=int, default=200, help="torch: training steps per run (default 200)")
    dr.add_argument("--at", type=int, default=80, help="torch: snapshot after this step (default 80)")
    dr.add_argument("--arms", default=",".join(DEFAULT_TORCH_ARMS), metavar="LIST",
                    help="torch: comma-separated arms among " + ", ".join(TORCH_ARMS) +
                         f" (default {','.join(DEFAULT_TORCH_ARMS)}; compile takes minutes of compiling); "
                         "or goodput: the goodput drill, a seeded reclaim schedule against arms A-D")
    gp = dr.add_argument_group("goodput (--workload torch --arms goodput)", (
        "A seeded schedule of noticed reclaims (with leads) and unannounced kills, in the reference's seconds "
        "(notices every 300 s, leads 30-120 s, unannounced every 1800 s, files every 60 s, a 1500 s window), "
        "each divided by --compress, replayed against the trainer for A: files + urgent file on notice, cold "
        "start; B: A + the snapshot on notice through the agent and a file:// store; C: the snapshot on notice + "
        "files at the planner's cadence; D: the snapshot on notice, no files."))
    gp.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    gp.add_argument("--compress", type=float, default=1.0, metavar="K",
                    help="divide every time of the schedule by K (default 1: the reference's seconds)")
    gp.add_argument("--window", type=float, metavar="S", help="window per arm, reference seconds (default 1500)")
    gp.add_argument("--notice-every", type=float, metavar="S", help="mean gap between notices (default 300)")
    gp.add_argument("--lead", metavar="LO-HI", help="notice lead range, reference seconds (default 30-120)")
    gp.add_argument("--unannounced-every", type=float, metavar="S",
                    help="mean gap between unannounced kills (default 1800; 0: none)")
    gp.add_argument("--file-every", type=float, metavar="S", help="arms A and B: file cadence (default 60)")
    gp.add_argument("--goodput-arms", default="".join(GOODPUT_ARMS), metavar="LETTERS",
                    help="which of the arms A, B, C, D to run (default ABCD)")
    gp.add_argument("--concurrent", action="store_true",
                    help="run the uninterrupted run and the arms at once (one GPU, as the reference did); "
                         "default one after another")
    gp.add_argument("--no-context-parity", dest="context_parity", action="store_false",
                    help="skip the in-place CUDA checkpoint + restore of every launched trainer after its first "
                         "step (on a time-sliced GPU a restored context gets a smaller share than a fresh one; "
                         "parity puts every trainer in the same class; only on CUDA)")
    gp.add_argument("--trainer-args", default="", metavar="ARGS",
                    help="extra arguments for train.py, e.g. '--device cpu --width 48 --layers 1 --batch 1'")
    return p


def _goodput(args: argparse.Namespace) -> int:
    import shlex

    from .goodput import shape_with

    lead_lo = lead_hi = None
    if args.lead:
        lo, sep, hi = args.lead.partition("-")
        try:
            lead_lo, lead_hi = float(lo), float(hi if sep else lo)
        except ValueError:
            return _usage_error(f"--lead {args.lead!r}: LO-HI in seconds")
        if not 0 < lead_lo <= lead_hi:
            return _usage_error(f"--lead {args.lead!r}: 0 < LO <= HI")
    for name in ("compress", "window", "notice_every", "file_every"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            return _usage_error(f"--{name.replace('_', '-')} must be > 0")
    if args.unannounced_every is not None and args.unannounced_every < 0:
        return _usage_error("--unannounced-every must be >= 0")
    letters = args.goodput_arms.upper()
    if not letters or any(c not in GOODPUT_ARMS for c in letters):
        return _usage_error(f"--goodput-arms {args.goodput_arms!r}: letters among {''.join(GOODPUT_ARMS)}")
    unannounced = args.unannounced_every
    shape = shape_with(window_s=args.window, notice_every_s=args.notice_every, lead_lo_s=lead_lo, lead_hi_s=lead_hi,
                       unannounced_every_s=(float("inf") if unannounced == 0 else unannounced),
                       file_every_s=args.file_every)
    from .goodput import run_goodput_drill

    return run_goodput_drill(args.workdir or tempfile.mkdtemp(prefix="snapguard-goodput-"), seed=args.seed,
                             compress=args.compress, shape=shape, trainer_args=tuple(shlex.split(args.trainer_args)),
                             concurrent=args.concurrent, json_path=args.json, arms=letters,
                             context_parity=args.context_parity)


def _cmd_drill(args: argparse.Namespace) -> int:
    """--json [--out PATH]: the drills write their results into one file (args.json becomes its
    path); with --json alone a temporary one, printed on stdout at the end."""
    if isinstance(args.json, str):
        print(f"{PROG}: `drill --json PATH` is deprecated, use `--json --out PATH`", file=sys.stderr)
        if args.out:
            return _usage_error("--json PATH and --out PATH: give the path once, to --out")
        args.out = args.json
    to_stdout = bool(args.json) and not args.out
    if to_stdout:
        fd, args.out = tempfile.mkstemp(prefix="snapguard-drill-", suffix=".json")
        os.close(fd)
    args.json = args.out
    try:
        code = _run_drill(args)
        if to_stdout and os.path.getsize(args.out):
            with open(args.out, encoding="utf-8") as f:
                sys.stdout.write(f.read())
        return code
    finally:
        if to_stdout:
            os.unlink(args.out)


def _run_drill(args: argparse.Namespace) -> int:
    if args.workload == "torch" and args.arms.strip() == "goodput":
        return _goodput(args)
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
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = PROG
    if argv[:1] and argv[0].startswith("--prog="):  # `snapguard drill` hands over as itself
        prog = argv.pop(0)[len("--prog="):] or PROG
    args = _parser(prog).parse_args(argv)
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
