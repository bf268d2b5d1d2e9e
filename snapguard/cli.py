"""`snapguard`: the operator's CLI (preflight gates, the reason catalogue, the drill)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from . import __version__
from .config import ConfigError, load
from .reasons import Failure, Reason, SnapguardError, failure_from

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
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=PREFLIGHT_EPILOG,
                         description=(
                             "Run the checks the executor runs before a checkpoint or restore. Exit 0: ready; "
                             "1: blocked (the reasons say why); 2: could not check. Warnings never block. "
                             "--node reports per capability; its exit status follows --require."))
    what = pre.add_mutually_exclusive_group(required=True)
    what.add_argument("--node", action="store_true",
                      help="this host, per capability: privileges, CRIU, runc, network lock, CUDA plugin, driver")
    what.add_argument("--pid", type=int, metavar="PID", help="a process tree rooted at PID")
    what.add_argument("--container", metavar="ID", help="a runc container (its init's process tree)")
    what.add_argument("--manifest", metavar="PATH", help="an image directory or its manifest: can it restore here")
    pre.add_argument("--root", metavar="DIR", help="runc --root for --container (containerd: /run/containerd/runc/NS)")
    pre.add_argument("--tcp-established", action="store_true",
                     help="the snapshot will carry established TCP connections (a warning, not a blocker)")
    pre.add_argument("--require", type=_capabilities, metavar="LIST",
                     help="--node: comma-separated capabilities that decide the exit status, or `all` (default: "
                          "host-netns-containers,gpu where the node has an NVIDIA driver, else host-netns-containers)")
    pre.add_argument("--json", action="store_true", help="print the report as JSON")
    pre.add_argument("--junit", metavar="FILE",
                     help="also write the report as JUnit XML to FILE (one testcase per check and capability)")

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
    _add_plan_parser(sub)
    return p


PREFLIGHT_EPILOG = """\
exit codes:
  0  READY      every required capability (--node) or every check (--pid, --container,
                --manifest) is ready; warnings never block
  1  BLOCKED    a required capability, or the target, is blocked: each blocker is a typed
                reason with its detail and remedy
  2  UNCHECKED  a check that decides the verdict could not run (PREFLIGHT_FAILED, or
                PROCESS_NOT_FOUND / CONTAINER_NOT_FOUND, with the underlying message), or
                the command line or configuration is unusable (USAGE_ERROR, CONFIG_INVALID,
                UNTRUSTED_PATH)

capabilities (--node; --require LIST decides the exit status, default:
host-netns-containers,gpu where the node has an NVIDIA driver, else host-netns-containers):
  host-netns-containers  runc containers in the host's network namespace, no TCP carried
                         needs: privileges, criu, runc
  own-netns-containers   runc containers with a network namespace of their own
                         needs: privileges, criu, runc, network-lock
  bare-processes         process trees outside containers (snapguard checkpoint --pid)
                         needs: privileges, criu
  gpu                    CUDA state (no NVIDIA driver: DRIVER_TOO_OLD)
                         needs: privileges, criu, cuda-plugin, nvidia-driver
  tcp-carry              established TCP connections carried (--tcp-established)
                         needs: privileges, criu, network-lock

node checks and the reasons they report:
  privileges     INSUFFICIENT_PRIVILEGE
  criu           CRIU_MISSING, CRIU_BROKEN, CRIU_TOO_OLD, CRIU_CHECK_FAILED
  runc           RUNC_UNUSABLE
  network-lock   NETWORK_LOCK_UNAVAILABLE
  cuda-plugin    CUDA_PLUGIN_UNAVAILABLE
  nvidia-driver  DRIVER_TOO_OLD, MIG_UNSUPPORTED, PERSISTENCE_MODE_OFF (warning)
  gpu-handles    STRAY_GPU_DEVICE_HANDLE (warning)
  any check      PREFLIGHT_FAILED with the underlying message when it cannot run
--pid and --container add the workload checks; `snapguard reasons` lists every reason
with its meaning and remedy. --json and --junit FILE can be given together.
"""


def _capabilities(text: str) -> tuple[str, ...]:
    from .preflight import CAPABILITY_NAMES

    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names == ("all",):
        return CAPABILITY_NAMES
    unknown = [n for n in names if n not in CAPABILITY_NAMES]
    if unknown or not names:
        what = f"unknown capability {', '.join(unknown)}" if unknown else "no capability named"
        raise argparse.ArgumentTypeError(f"{what}; known: {', '.join(CAPABILITY_NAMES)}, or all")
    return names


def _preflight_target(args: argparse.Namespace) -> str:
    if args.node:
        return "--node"
    if args.pid is not None:
        return f"--pid {args.pid}"
    if args.container is not None:
        return f"--container {args.container}"
    return f"--manifest {args.manifest}"


def _cmd_preflight(args: argparse.Namespace) -> int:
    if args.require is not None and not args.node:
        raise SnapguardError(Reason.USAGE_ERROR, "--require applies to --node only")
    from . import preflight

    try:
        config = load()
        if args.node:
            report = preflight.node_report(config, args.require)
        elif args.pid is not None:
            report = preflight.pid_report(args.pid, config, args.tcp_established)
        elif args.container is not None:
            if not args.container:
                raise SnapguardError(Reason.USAGE_ERROR, "--container needs a container id")
            report = preflight.container_report(args.container, args.root, config)
        else:
            report = preflight.manifest_report(os.path.abspath(args.manifest), config)
    except Exception as e:  # the gate could not check: one typed line, and the reports CI reads
        failure = failure_from(e)
        if failure.reason is Reason.INTERNAL_ERROR:  # an unknown here is a check that could not run
            failure = Failure(Reason.PREFLIGHT_FAILED, preflight.check_error_message(e))
        print(failure.message, file=sys.stderr)
        report = preflight.Report(_preflight_target(args), checks=[preflight.CheckResult(
            "preflight", error=failure.detail, error_reason=failure.reason)])
    code = report.exit_code
    if args.junit:
        try:
            _write_public_file(args.junit, report.to_junit(__version__))
        except OSError as e:
            print(f"snapguard PREFLIGHT_FAILED: cannot write the JUnit report {args.junit}: {e.strerror or e}",
                  file=sys.stderr)
            code = code or preflight.EXIT_UNCHECKED
    print(report.to_json() if args.json else report.to_text())
    return code


def _write_public_file(path: str, data: bytes) -> None:
    """Write a report a CI runner reads (0644), whole or not at all: a temporary file beside it,
    renamed over it (a link planted at `path` is replaced, never followed)."""
    import tempfile

    path = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".snapguard-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and value != float("inf")):  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def _lead(text: str) -> tuple[str, tuple[float, ...]]:
    """--lead S, LO-HI or S:W,S:W,...: a fixed lead, a uniform range or weighted points."""
    try:
        if ":" in text:
            points = [part.split(":") for part in text.split(",")]
            if any(len(pt) != 2 for pt in points):
                raise argparse.ArgumentTypeError("each point is LEAD:WEIGHT")
            return "points", tuple(_seconds(x) for pt in points for x in pt)
        try:
            float(text)
        except ValueError:
            lo, sep, hi = text.rpartition("-")
            if sep and lo:
                return "range", (_seconds(lo), _seconds(hi))
        return "fixed", (_seconds(text),)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--lead {text}: {e} (give S, LO-HI or S:W,S:W)") from None


def _add_plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="file-checkpoint cadence and GPU time lost per protection strategy",
                        description=(
                            "The recovery economics of a job (Young/Daly, notice-aware): from its measured costs "
                            "and a failure mix, the file-checkpoint cadence and the expected share of GPU time "
                            "lost with periodic file checkpoints, periodic snapshots, a snapshot on notice, and a "
                            "snapshot on notice plus files at the cadence the uncovered failures set. A notice "
                            "covers a reclaim only when its lead exceeds the snapshot's lag. All costs in seconds."))
    for flag, what in (("--file-stall", "training time one file checkpoint takes"),
                       ("--file-lag", "file checkpoint start to its copy being usable by a replacement"),
                       ("--file-restore", "file resume start to its first new step"),
                       ("--cold-start", "what a replacement pays around a file resume and a snapshot restore "
                                        "skips (start, copy in, compile); a file recovery costs it plus "
                                        "--file-restore"),
                       ("--snapshot-stall", "training time one leave-running snapshot takes"),
                       ("--snapshot-lag", "snapshot request to the image being whole for the replacement"),
                       ("--snapshot-restore", "snapshot restore start to the first new step"),
                       ("--notice-downtime", "freeze to first new step of one snapshot on notice (default: "
                                             "snapshot lag + restore)")):
        pl.add_argument(flag, type=_seconds, metavar="S", help=what)
    pl.add_argument("--noticed-per-hour", type=_seconds, default=0.0, metavar="R",
                    help="reclaims that come with a notice, per hour")
    pl.add_argument("--lead", type=_lead, metavar="S|LO-HI",
                    help="the notice's lead before the reclaim: S seconds, uniform LO-HI, or S:W,S:W weighted")
    pl.add_argument("--unannounced-per-hour", type=_seconds, default=0.0, metavar="R",
                    help="losses without a notice (crashes, heartbeat loss), per hour")
    pl.add_argument("--from-result", action="append", default=[], metavar="PATH",
                    help="fill costs from a snapguard-result.json or a torch drill JSON (repeatable; later files "
                         "win, flags win over files)")
    pl.add_argument("--daly", action="store_true", help="periods by Daly's higher-order estimate (default: Young)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")


def _cmd_plan(args: argparse.Namespace) -> int:
    from . import plan

    measured: dict[str, float] = {}
    sources: dict[str, str] = {}
    for path in args.from_result:
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError) as e:
            raise SnapguardError(Reason.USAGE_ERROR, f"--from-result {path}: {getattr(e, 'strerror', None) or e}")
        try:
            values, found_in = plan.costs_from_record(record)
        except SnapguardError as e:
            raise SnapguardError(Reason.USAGE_ERROR, f"--from-result {path}: {e.failure.detail}") from None
        measured.update(values)
        sources.update({k: f"{path}: {v}" for k, v in found_in.items()})
    for name in ("file_stall", "file_lag", "file_restore", "cold_start", "snapshot_stall", "snapshot_lag",
                 "snapshot_restore", "notice_downtime"):
        if getattr(args, name) is not None:
            measured[name] = getattr(args, name)
            sources[name] = "flag"
    lead = None
    if args.lead is not None:
        kind, v = args.lead
        lead = (plan.LeadTime.fixed(v[0]) if kind == "fixed" else plan.LeadTime.between(v[0], v[1])
                if kind == "range" else plan.LeadTime(points=tuple(zip(v[::2], v[1::2]))))
    mix = plan.FailureMix(args.noticed_per_hour, args.unannounced_per_hour, lead)
    result = plan.plan(plan.Costs(**measured), mix, "daly" if args.daly else "young")
    if args.json:
        print(json.dumps({**result.to_dict(), "sources": sources}, indent=2))
        return 0
    cover = ""
    if result.covered_share is not None and lead is not None:
        cover = (f", {result.covered_share:.0%} covered (lead {lead.describe()} vs "
                 f"{measured['snapshot_lag']:g} s snapshot lag)")
    print(f"snapguard plan ({'Daly' if args.daly else 'Young'}): noticed {mix.noticed_per_hour:g}/h{cover}; "
          f"unannounced {mix.unannounced_per_hour:g}/h")
    best = result.best.name
    for s in result.strategies:
        every = f"every {round(s.period_s)} s" if s.period_s is not None else ""
        cadence = {"files": f"files {every}", "snapshots": f"snapshots {every}", "notice": "-",
                   "notice+files": f"files {every}" if every else "no files needed"}[s.name]
        lost = f"{s.lost_share:6.1%}" if s.bounded else "  100% (no progress)"
        print(f"  {s.title:<28}{cadence:<22}{lost}{'   <- best' if s.name == best else ''}")
    for name, why in result.skipped.items():
        print(f"  not planned: {dict(plan.STRATEGIES)[name]}: {why}")
    if result.assumed_zero:
        print(f"  taken as 0 s (not given): {', '.join(result.assumed_zero)}")
    for name, where in sources.items():
        if where != "flag":
            print(f"  {name} {measured[name]:.2f} s from {where}")
    return 0


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
                "checkpoint": _cmd_checkpoint, "restore": _cmd_restore, "plan": _cmd_plan}
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
