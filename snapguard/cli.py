"""`snapguard`: the operator's CLI (preflight gates, the reason catalogue, the drill)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from . import __version__
from .config import ConfigError, load
from .reasons import Reason

EXIT_USAGE = 2
TORCH_ARMS = ("snapshots", "expandable", "file", "container", "compile")
DEFAULT_TORCH_ARMS = ("snapshots", "file", "container")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One typed line instead of argparse's usage dump: CI logs and scripts read the first line.
        print(f"snapguard USAGE_ERROR: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="snapguard", description=(
        "Operator CLI of snapguard, the guarded runc executor. containerd runs `snapguard-runc` in "
        "place of runc; this command checks nodes, workloads and images ahead of time and runs drills."))
    p.add_argument("--version", action="version", version=f"snapguard {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pre = sub.add_parser("preflight", help="can this node, process, container or image be snapshotted/restored",
                         description=(
                             "Run the checks the executor runs before a checkpoint or restore. Exit 0: ready; "
                             "1: blocked (the reasons say why); 2: could not check. Warnings never block."))
    what = pre.add_mutually_exclusive_group(required=True)
    what.add_argument("--node", action="store_true", help="this host: CRIU, plugin, privileges, network lock")
    what.add_argument("--pid", type=int, metavar="PID", help="a process tree rooted at PID")
    what.add_argument("--container", metavar="ID", help="a runc container (its init's process tree)")
    what.add_argument("--manifest", metavar="PATH", help="an image directory or its manifest: can it restore here")
    pre.add_argument("--root", metavar="DIR", help="runc --root for --container (containerd: /run/containerd/runc/NS)")
    pre.add_argument("--tcp-established", action="store_true",
                     help="the snapshot will carry established TCP connections (a warning, not a blocker)")
    pre.add_argument("--json", action="store_true", help="print the report as JSON")

    ck = sub.add_parser("checkpoint", help="snapshot a bare process tree (not in a container) with CRIU",
                        description=(
                            "Snapshot the process tree rooted at --pid into --images with the executor's guards: "
                            "preflight, the take point (a workload started with snapguard's hook is asked to "
                            "stop at a step boundary and release PyTorch's free reserve), CRIU with its CUDA "
                            "plugin, and on failure every CUDA process brought back to running. Exit 0 done, "
                            "1 refused or failed (one typed line on stderr)."))
    ck.add_argument("--pid", type=int, required=True, help="root of the process tree")
    ck.add_argument("--images", required=True, metavar="DIR", help="image directory (created 0700)")
    ck.add_argument("--leave-running", action="store_true", help="keep the tree running after the snapshot")
    ck.add_argument("--tcp-established", action="store_true", help="carry established TCP connections")
    ck.add_argument("--take-wait", type=float, default=10.0, metavar="S",
                    help="seconds to wait for the workload's step boundary (default 10); then go on without")
    ck.add_argument("--json", action="store_true", help="print the result record as JSON")
    rt = sub.add_parser("restore", help="restore a bare process tree from --images",
                        description=("Verify the image (completion marker, checksums, manifest), compare it with "
                                     "this host (CPU, driver, GPU model, count and memory, pids), restore it "
                                     "detached with CRIU and check its CUDA processes run."))
    rt.add_argument("--images", required=True, metavar="DIR")
    rt.add_argument("--tcp-established", action="store_true")
    rt.add_argument("--json", action="store_true")

    rs = sub.add_parser("reasons", help="list the typed failure reasons",
                        description="The stable failure reason names with meaning, phase and remedy.")
    rs.add_argument("--json", action="store_true", help="print as JSON")

    dr = sub.add_parser("drill", help="a real snapshot drill through containerd, runc and CRIU",
                        description=(
                            "Start containerd (own root, BinaryName snapguard-runc) if needed, run a counter "
                            "container built from examples/ locally, checkpoint it through ctr (leave-running "
                            "and exit variants), restore it, and show that it continued where it stopped."))
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


def _cmd_preflight(args: argparse.Namespace) -> int:
    from . import preflight

    config = load()
    if args.node:
        report = preflight.node_report(config)
    elif args.pid is not None:
        report = preflight.pid_report(args.pid, config, args.tcp_established)
    elif args.container:
        report = preflight.container_report(args.container, args.root, config)
    else:
        report = preflight.manifest_report(args.manifest, config)
    print(report.to_json() if args.json else report.to_text())
    return report.exit_code


def _cmd_reasons(args: argparse.Namespace) -> int:
    rows = [{"reason": r.name, "phase": r.phase.value, "workload_intact": r.workload_intact,
             "meaning": r.meaning, "remedy": r.remedy} for r in Reason]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max(len(r.name) for r in Reason)
        for r in Reason:
            print(f"{r.name:<{width}}  {r.phase.value:<10}  {r.meaning}")
    return 0


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
        return
    t = result.get("timings", {})
    print(f"snapguard {result['operation']}: ok, " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
    for w in result.get("warnings", []):
        print(f"  warning {w['reason']}: {w['detail']}")


def _guarded(args: argparse.Namespace, run) -> int:
    from .reasons import SnapguardError

    try:
        result = run()
    except SnapguardError as e:
        print(e.failure.message, file=sys.stderr)
        if args.json:
            print(json.dumps(e.failure.to_dict(), indent=2, sort_keys=True, default=str))
        return 1
    _print_result(result, args.json)
    return 0


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from .bare import checkpoint_pid

    config = load()
    return _guarded(args, lambda: checkpoint_pid(args.pid, os.path.abspath(args.images), config,
                                                 leave_running=args.leave_running,
                                                 tcp_established=args.tcp_established, take_wait_s=args.take_wait))


def _cmd_restore(args: argparse.Namespace) -> int:
    from .bare import restore_images

    config = load()
    return _guarded(args, lambda: restore_images(os.path.abspath(args.images), config,
                                                 tcp_established=args.tcp_established))


def _cmd_drill(args: argparse.Namespace) -> int:
    if args.workload == "torch":
        import tempfile

        from .torch_drill import run_torch_drill

        if not 0 < args.at < args.steps:
            print("snapguard USAGE_ERROR: --at must be between 0 and --steps", file=sys.stderr)
            return EXIT_USAGE
        arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
        unknown = [a for a in arms if a not in TORCH_ARMS]
        if unknown or not arms:
            print(f"snapguard USAGE_ERROR: --arms: unknown {', '.join(unknown) or '(empty)'}; choose among "
                  f"{', '.join(TORCH_ARMS)}", file=sys.stderr)
            return EXIT_USAGE
        return run_torch_drill(load(), args.workdir or tempfile.mkdtemp(prefix="snapguard-torch-"),
                               steps=args.steps, at=args.at, json_path=args.json, arms=arms)
    from .drill import run_drill

    return run_drill(json_path=args.json, workdir=args.workdir)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        commands = {"preflight": _cmd_preflight, "reasons": _cmd_reasons, "drill": _cmd_drill,
                    "checkpoint": _cmd_checkpoint, "restore": _cmd_restore}
        return commands[args.command](args)
    except ConfigError as e:
        print(f"snapguard {e.reason}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
