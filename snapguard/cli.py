"""`snapguard`: the operator's CLI (preflight gates, the reason catalogue, the drill)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from . import __version__
from .config import ConfigError, load
from .reasons import Reason, SnapguardError, failure_from

EXIT_USAGE = 2


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
    ck.add_argument("--take-wait", type=float, default=None, metavar="S",
                    help="seconds to wait for the workload's step boundary (default: take_wait_s of the "
                         "config, 10); then go on without")
    ck.add_argument("--network-lock", choices=("auto", "iptables", "nftables", "skip"), default="auto",
                    help="how CRIU keeps the network still: auto (default) skips it when nothing outside the "
                         "tree can reach it, else iptables")
    ck.add_argument("--json", action="store_true", help="print the result record as JSON")
    rt = sub.add_parser("restore", help="restore a bare process tree from --images",
                        description=("Verify the image (completion marker, checksums, manifest), compare it with "
                                     "this host (CPU, driver, GPU model, count and memory, pids), restore it "
                                     "detached with CRIU and check its CUDA processes run."))
    rt.add_argument("--images", required=True, metavar="DIR", help="image directory (root-owned, root-only)")
    rt.add_argument("--tcp-established", action="store_true", help="restore established TCP connections")
    rt.add_argument("--json", action="store_true", help="print the result record as JSON")

    rs = sub.add_parser("reasons", help="list the typed failure reasons",
                        description="The stable failure reason names with meaning, phase and remedy.")
    rs.add_argument("--json", action="store_true", help="print as JSON")

    sub.add_parser("drill", help="a real snapshot drill (runs snapguard-lab drill)", add_help=False,
                        description="Hands over to `snapguard-lab drill` (the lab package, installed beside "
                                    "snapguard by packaging/setup.sh); see `snapguard-lab drill --help`.")
    return p


def _cmd_preflight(args: argparse.Namespace) -> int:
    from . import preflight

    config = load()
    if args.node:
        report = preflight.node_report(config)
    elif args.pid is not None:
        report = preflight.pid_report(args.pid, config, args.tcp_established)
    elif args.container is not None:
        if not args.container:
            raise SnapguardError(Reason.USAGE_ERROR, "--container needs a container id")
        report = preflight.container_report(args.container, args.root, config)
    else:
        report = preflight.manifest_report(os.path.abspath(args.manifest), config)
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


def _snapshot(args: argparse.Namespace, work_dir: str, run) -> int:
    """Run a checkpoint or restore; its record goes to stdout (--json) and into the work dir."""
    from . import pipeline

    try:
        result = run()
    except SnapguardError as e:
        print(e.failure.message, file=sys.stderr)
        if args.json:
            print(json.dumps(e.failure.to_dict(), indent=2, sort_keys=True, default=str))
        _write_record(pipeline, work_dir, e.failure.to_dict())
        return 1
    _write_record(pipeline, work_dir, result)
    _print_result(result, args.json)
    return 0


def _write_record(pipeline, work_dir: str, record: dict) -> None:
    try:
        pipeline.write_record(work_dir, record)
    except OSError as e:
        print(f"snapguard: cannot write the record into {work_dir}: {e.strerror}", file=sys.stderr)


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from . import pipeline

    config = load()
    req = pipeline.Request(os.path.abspath(args.images), leave_running=args.leave_running,
                           tcp_established=args.tcp_established, network_lock=args.network_lock,
                           timeouts=pipeline.Timeouts.from_config(config, args.take_wait))
    runner = pipeline.CriuRunner(config.criu, args.pid)
    return _snapshot(args, req.work_dir, lambda: pipeline.checkpoint(runner, req, config))


def _cmd_restore(args: argparse.Namespace) -> int:
    from . import pipeline

    config = load()
    req = pipeline.Request(os.path.abspath(args.images), tcp_established=args.tcp_established,
                           timeouts=pipeline.Timeouts.from_config(config))
    return _snapshot(args, req.work_dir, lambda: pipeline.restore(pipeline.CriuRunner(config.criu), req, config))


def _cmd_drill(lab_args: list[str]) -> int:
    """The drills live in the lab package, which the product never imports: hand over to its
    command, installed beside this one (argv untouched, so its --help and errors are its own)."""
    lab = os.path.join(os.path.dirname(sys.executable), "snapguard-lab")
    if not os.path.exists(lab):
        print(f"snapguard USAGE_ERROR: the drills need snapguard-lab, not installed at {lab} "
              "(packaging/setup.sh installs it; or pip install ./lab)", file=sys.stderr)
        return EXIT_USAGE
    os.execv(lab, [lab, "drill", *lab_args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["drill"]:
        return _cmd_drill(argv[1:])
    args = _parser().parse_args(argv)
    commands = {"preflight": _cmd_preflight, "reasons": _cmd_reasons,
                "checkpoint": _cmd_checkpoint, "restore": _cmd_restore}
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the boundary: one typed line, never a traceback
        failure = failure_from(e)
        print(failure.message, file=sys.stderr)
        return EXIT_USAGE if failure.reason.phase.value == "usage" or isinstance(e, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
