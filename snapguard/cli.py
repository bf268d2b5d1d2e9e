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
                            "stop at a step boundary, move its optimizer's tensors off the GPU and release "
                            "PyTorch's free reserve), CRIU with its CUDA plugin, and on failure every CUDA "
                            "process brought back to running. A trainer in this mount namespace moves those "
                            "bytes into a tmpfs file of its own (its spill), which snapguard writes into the "
                            "image apart from CRIU and passes back at the release: in SNAPGUARD_TAKE_SPILL_DIR "
                            "of its environment, else /run/snapguard-spill where a tmpfs is mounted there (with "
                            "huge pages: `snapguard preflight --node` says), else /dev/shm; "
                            "SNAPGUARD_TAKE_SPILL=0 keeps them in its memory. Exit 0 done, "
                            "1 refused or failed (one typed line on stderr)."))
    ck.add_argument("--pid", type=int, required=True, help="root of the process tree")
    ck.add_argument("--images", required=True, metavar="DIR", help="image directory (created 0700)")
    ck.add_argument("--leave-running", action="store_true", help="keep the tree running after the snapshot")
    ck.add_argument("--tcp-established", action="store_true", help="carry established TCP connections")
    ck.add_argument("--take-wait", type=float, default=None, metavar="S",
                    help="seconds to wait for the workload's step boundary (default: take_wait_s of the "
                         "config, 10); then go on without")
    ck.add_argument("--job", metavar="J", help="the job this tree runs: its fencing epoch on this node (taken by "
                    "`restore --from`) is sealed into the manifest, so a stale node's push is refused")
    ck.add_argument("--network-lock", choices=("auto", "iptables", "nftables", "skip"), default="auto",
                    help="how CRIU keeps the network still: auto (default) skips it when nothing outside the "
                         "tree can reach it, else iptables")
    ck.add_argument("--json", action="store_true", help="print the result record as JSON")
    rt = sub.add_parser("restore", help="restore a bare process tree from --images",
                        description=("Verify the image (completion marker, checksums, manifest), compare it with "
                                     "this host (CPU, driver, GPU model, count and memory, pids), restore it "
                                     "detached with CRIU and check its CUDA processes run."))
    rt.add_argument("--images", metavar="DIR", help="image directory (root-owned, root-only); with --from, where "
                    "the fetched image goes")
    rt.add_argument("--tcp-established", action="store_true", help="restore established TCP connections")
    rt.add_argument("--device-map", type=_device_map, metavar="OLD=NEW[,...]",
                    help="restore the image's GPUs onto others: OLD is the image's GPU (its index in the "
                         "manifest, or its UUID), NEW this host's (NVML index or UUID); name every GPU the "
                         "image used. Default: the same GPUs, or by index when they are not here")
    rt.add_argument("--json", action="store_true", help="print the result record as JSON")

    rs = sub.add_parser("reasons", help="list the typed failure reasons",
                        description="The stable failure reason names with meaning, phase and remedy.")
    rs.add_argument("--json", action="store_true", help="print as JSON")

    sub.add_parser("drill", help="a real snapshot drill (runs snapguard-lab drill)", add_help=False,
                        description="Hands over to `snapguard-lab drill` (the lab package, installed beside "
                                    "snapguard by packaging/setup.sh); see `snapguard-lab drill --help`.")
    _add_plan_parser(sub)
    _add_install_parsers(sub)
    _add_store_parsers(sub)
    from . import notice  # agent, notice, protect

    notice.add_parsers(sub)
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
                           timeouts=pipeline.Timeouts.from_config(config, args.take_wait),
                           fence_epoch=pipeline.node_epoch(config, args.job, "") if args.job else None)
    runner = pipeline.CriuRunner(config.criu, args.pid)
    return _snapshot(args, req.work_dir, lambda: pipeline.checkpoint(runner, req, config))


def _cmd_restore(args: argparse.Namespace) -> int:
    from . import pipeline

    if args.from_url:
        return _cmd_restore_from(args)
    if not args.images:
        raise SnapguardError(Reason.USAGE_ERROR, "restore needs --images DIR or --from URL")
    config = load()
    req = pipeline.Request(os.path.abspath(args.images), tcp_established=args.tcp_established,
                           device_map=args.device_map, timeouts=pipeline.Timeouts.from_config(config))
    return _snapshot(args, req.work_dir, lambda: pipeline.restore(pipeline.CriuRunner(config.criu), req, config))


def _device_map(text: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for part in text.split(","):
        old, sep, new = part.strip().partition("=")
        if not sep or not old or not new or not all(c.isalnum() or c == "-" for c in old + new):
            raise argparse.ArgumentTypeError(f"{part!r} is not OLD=NEW (a GPU index or UUID on each side)")
        pairs.append((old, new))
    return tuple(pairs)


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


def _add_install_parsers(sub) -> None:
    from .install import (DEFAULT_CC, DEFAULT_CONTAINERD_CONFIG, DEFAULT_RUNTIME_NAME, DEFAULT_SNAPGUARD_CONFIG,
                          DEFAULT_STATE_FILE, LAUNCHER_NAME)
    from .metrics import DEFAULT_TEXTFILE_DIR

    ins = sub.add_parser("install", help="add the snapguard runtime to containerd and write /etc/snapguard/config.toml",
                         description=(
                             "Put snapguard on this node (as root): a containerd drop-in adding the CRI runtime "
                             "NAME (runc v2 shim, BinaryName this install's snapguard-runc, SystemdCgroup as the "
                             "default runtime has it), the main config's imports where it lacks the drop-in, and "
                             "/etc/snapguard/config.toml with the pinned paths found here (`runc` = NVIDIA's runtime "
                             "where that is containerd's default). Prints the RuntimeClass. A second run changes "
                             "nothing; --uninstall reverses what it recorded. Restart containerd afterwards."))
    ins.add_argument("--dry-run", action="store_true", help="print the change as a diff and write nothing")
    ins.add_argument("--uninstall", action="store_true", help="reverse what snapguard install wrote")
    ins.add_argument("--containerd-config", default=DEFAULT_CONTAINERD_CONFIG, metavar="PATH",
                     help=f"containerd's main config (default {DEFAULT_CONTAINERD_CONFIG}); its `version` decides "
                          "the drop-in's (2: containerd 1.6/1.7, 3: 2.x)")
    ins.add_argument("--dropin-dir", metavar="DIR", help="where the drop-in goes (default: conf.d beside PATH)")
    ins.add_argument("--runtime-name", default=DEFAULT_RUNTIME_NAME, metavar="NAME",
                     help=f"the runtime, and the RuntimeClass handler (default {DEFAULT_RUNTIME_NAME})")
    ins.add_argument("--config", default=DEFAULT_SNAPGUARD_CONFIG, metavar="PATH",
                     help=f"snapguard's config to write (default {DEFAULT_SNAPGUARD_CONFIG})")
    ins.add_argument("--state-file", default=DEFAULT_STATE_FILE, metavar="PATH",
                     help=f"where what was written is recorded, root-only (default {DEFAULT_STATE_FILE})")
    ins.add_argument("--containerd", metavar="PATH",
                     help="the containerd binary whose version is read (default /usr/bin/containerd, /usr/local/bin/containerd)")
    ins.add_argument("--snapguard-runc", metavar="PATH",
                     help="the Python snapguard-runc (default: the one beside this snapguard); given without "
                          "--launcher, it is BinaryName as given and the launcher is not built")
    launcher = ins.add_argument_group(
        "snapguard-runc's C launcher",
        "A small C program, compiled here from the sources installed with snapguard (snapguard/_c_helpers/ in a "
        "wheel or the Debian package, c_helpers/ in a source or editable install) and made containerd's "
        "BinaryName: it execs runc for every verb but checkpoint and restore without starting Python, and the "
        "Python snapguard-runc for those two. By default it is built where its sources are found (and "
        "--snapguard-runc is not given); otherwise BinaryName is the Python snapguard-runc.")
    choice = launcher.add_mutually_exclusive_group()
    choice.add_argument("--launcher", dest="launcher", action="store_const", const=True, default=None,
                        help="require the launcher: fail where its sources or the compiler are missing")
    choice.add_argument("--no-launcher", dest="launcher", action="store_const", const=False,
                        help="do not build it: BinaryName is the Python snapguard-runc (a launcher an earlier run "
                             "installed is removed)")
    launcher.add_argument("--launcher-path", metavar="PATH",
                          help=f"where the launcher is installed, an absolute path (default: {LAUNCHER_NAME} beside "
                               "snapguard-runc)")
    launcher.add_argument("--cc", default=DEFAULT_CC, metavar="PATH",
                          help=f"the pinned C compiler that builds it, root's alone, run with a PATH of root's "
                               f"directories only (default {DEFAULT_CC})")
    ins.add_argument("--json", action="store_true", help="print the plan as JSON")

    met = sub.add_parser("metrics", help="the node preflight as Prometheus textfile metrics (node-exporter)",
                         description=("Run `snapguard preflight --node` and write its verdict, capabilities and "
                                      "checks to DIR/snapguard.prom with prometheus_client (extra `metrics`). Exit 0 "
                                      "when written, whatever the verdict (it is in the metrics)."))
    met.add_argument("--textfile", default=DEFAULT_TEXTFILE_DIR, metavar="DIR",
                     help=f"node-exporter's textfile directory (default {DEFAULT_TEXTFILE_DIR})")
    met.add_argument("--require", type=_capabilities, metavar="LIST", help="as preflight --node --require")
    met.add_argument("--interval", type=_seconds, metavar="S", help="write again every S seconds, until stopped")


def _cmd_install(args: argparse.Namespace) -> int:
    from . import install

    if args.launcher is False and args.launcher_path is not None and not args.uninstall:
        raise SnapguardError(Reason.USAGE_ERROR,
                             "--launcher-path names where the launcher goes: not with --no-launcher")
    opts = install.Options(containerd_config=args.containerd_config, dropin_dir=args.dropin_dir,
                           snapguard_config=args.config, state_file=args.state_file, runtime_name=args.runtime_name,
                           containerd=args.containerd, snapguard_runc=args.snapguard_runc, launcher=args.launcher,
                           launcher_path=args.launcher_path, cc=args.cc)
    plan = install.plan_uninstall(opts) if args.uninstall else install.plan_install(opts)
    if not args.dry_run:
        install.apply(plan)
    print(json.dumps(plan.to_dict(), indent=2, sort_keys=True, default=str) if args.json
          else plan.to_text(args.dry_run), end="" if not args.json else "\n")
    return 0


def _cmd_metrics(args: argparse.Namespace) -> int:
    import time

    from . import metrics, preflight

    while True:
        start = time.monotonic()
        try:
            report = preflight.node_report(load(), args.require)
        except Exception as e:  # unchecked, as preflight reports it: the metrics say so
            failure = failure_from(e)
            if failure.reason is Reason.INTERNAL_ERROR:
                failure = Failure(Reason.PREFLIGHT_FAILED, preflight.check_error_message(e))
            print(failure.message, file=sys.stderr)
            report = preflight.Report("--node", checks=[preflight.CheckResult(
                "preflight", error=failure.detail, error_reason=failure.reason)])
        try:
            path = metrics.write_textfile(report, args.textfile, time.monotonic() - start)
        except metrics.MetricsUnavailable as e:
            print(f"snapguard USAGE_ERROR: {e}", file=sys.stderr)
            return EXIT_USAGE
        except OSError as e:
            print(f"snapguard PREFLIGHT_FAILED: cannot write the metrics to {args.textfile}: {e.strerror or e}",
                  file=sys.stderr)
            return EXIT_USAGE
        print(f"snapguard metrics: {report.verdict} (preflight --node exit {report.exit_code}) in {path}", flush=True)
        if args.interval is None:
            return 0
        time.sleep(args.interval)


def _cmd_drill(lab_args: list[str]) -> int:
    """The drills live in the lab package, which the product never imports: hand over to its
    command, installed beside this one (argv untouched, so its --help and errors are its own)."""
    lab = os.path.join(os.path.dirname(sys.executable), "snapguard-lab")
    if not os.path.exists(lab):
        print(f"snapguard USAGE_ERROR: the drills need snapguard-lab, not installed at {lab} "
              "(packaging/setup.sh installs it; or pip install ./lab)", file=sys.stderr)
        return EXIT_USAGE
    os.execv(lab, [lab, "drill", *lab_args])


EXIT_FALLBACK = 3  # restore --from refused and the job has a file checkpoint: its path is on stdout

STORE_EPILOG = """\
store URLs: file:///shared/dir (a directory every node mounts) or s3://bucket/prefix (boto3, the
`s3` extra; endpoint from $S3_ENDPOINT_URL / $AWS_ENDPOINT_URL_S3, keys from boto3's usual chain).
An image counts in a store only once its completion marker, put last, is there.
"""

RESTORE_EPILOG = """\
restore --from URL: fetch the job's newest whole image (or --image NAME) into --images (default: a
new private directory in the state dir), verifying every byte against the manifest as it arrives,
take the job's next fencing epoch (one restore wins a race; the other is FENCED and changes
nothing), then restore it as --images would.
exit codes:
  0  restored
  1  refused or failed (one typed line on stderr)
  2  usage or configuration error
  3  refused, and the job has a file checkpoint (--file-checkpoint, or the newest one registered
     in the store): stderr says why and FALLBACK_TO_FILE_CHECKPOINT, stdout is the checkpoint's
     path or URL alone: start the job from it
"""


def _add_store_parsers(sub) -> None:
    rt = sub.choices["restore"]
    rt.formatter_class = argparse.RawDescriptionHelpFormatter
    rt.epilog = RESTORE_EPILOG
    rt.add_argument("--from", dest="from_url", metavar="URL", help="an image store (file:// or s3://): fetch, "
                    "verify while reading and restore the job's newest whole image")
    rt.add_argument("--job", metavar="J", help="--from: the job (default: the store's only job)")
    rt.add_argument("--image", metavar="NAME", help="--from: this image instead of the newest whole one")
    rt.add_argument("--file-checkpoint", metavar="PATH_OR_URL",
                    help="--from: the job's file checkpoint, printed with exit 3 when the restore is refused "
                         "(default: the newest one registered in the store)")
    rt.add_argument("--progress", action="store_true", help="draw the transfer's progress on a terminal")

    ps = sub.add_parser("push", help="upload a sealed image to an image store",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=STORE_EPILOG,
                        description=("Upload the whole image in --images (marker present) to --to as an image of "
                                     "--job: every file verified against the manifest as it is read, then the "
                                     "manifest, then the marker. Refused with FENCED, writing nothing, when the "
                                     "job was restored elsewhere under a newer epoch than this node's."))
    ps.add_argument("--images", required=True, metavar="DIR", help="the sealed image directory")
    ps.add_argument("--to", required=True, metavar="URL", help="the store")
    ps.add_argument("--job", metavar="J", help="the job (default: the image directory's name)")
    ps.add_argument("--name", metavar="NAME", help="the image's name in the store (default: UTC time, sortable)")
    ps.add_argument("--epoch", type=int, metavar="N", help="this node's fencing epoch of the job (default: the one "
                    "this node's last restore --from took, else the manifest's fence_epoch, else 0)")
    ps.add_argument("--progress", action="store_true", help="draw the transfer's progress on a terminal")
    ps.add_argument("--json", action="store_true", help="print what was pushed as JSON")

    pl = sub.add_parser("pull", help="fetch an image from a store, verifying it while reading",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=STORE_EPILOG,
                        description=("Fetch the job's newest whole image (or --image) into --images, a new or "
                                     "empty directory made root-only; every byte is checked against the manifest "
                                     "as it arrives and the local marker is written last."))
    pl.add_argument("--from", dest="from_url", required=True, metavar="URL", help="the store")
    pl.add_argument("--images", required=True, metavar="DIR", help="where the image goes (new or empty)")
    pl.add_argument("--job", metavar="J", help="the job (default: the store's only job)")
    pl.add_argument("--image", metavar="NAME", help="this image instead of the newest whole one")
    pl.add_argument("--progress", action="store_true", help="draw the transfer's progress on a terminal")
    pl.add_argument("--json", action="store_true", help="print what was pulled as JSON")


    pr = sub.add_parser("prune", help="delete a job's older images from an image store",
                        description=("Keep the job's --keep newest whole images in the store and delete the older "
                                     "ones (each marker first, so a reader never sees half an image as whole), and "
                                     "every unmarked image older than the newest whole one (an upload that "
                                     "died). An unmarked image newer than all whole ones may be an upload under "
                                     "way and is kept."))
    pr.add_argument("--store", required=True, metavar="URL", help="the store (file:// or s3://)")
    pr.add_argument("--job", required=True, metavar="J", help="the job")
    pr.add_argument("--keep", type=int, default=2, metavar="N", help="whole images to keep (default 2)")
    pr.add_argument("--json", action="store_true", help="print what was deleted as JSON")


def _cmd_prune(args: argparse.Namespace) -> int:
    from .store import open_store

    try:
        gone = open_store(args.store).prune(args.job, args.keep)
    except SnapguardError as e:
        return _store_failure(args, e)
    print(json.dumps({"ok": True, "job": args.job, "deleted": gone}, indent=2) if args.json else
          f"snapguard prune: {len(gone)} image(s) of {args.job} deleted" + (f": {', '.join(gone)}" if gone else ""))
    return 0


def _progress(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from .store import terminal_progress

    return terminal_progress(args.progress)


def _store_failure(args: argparse.Namespace, e: SnapguardError) -> int:
    print(e.failure.message, file=sys.stderr)
    if args.json:
        print(json.dumps(e.failure.to_dict(), indent=2, sort_keys=True, default=str))
    return 1


def _cmd_push(args: argparse.Namespace) -> int:
    from . import pipeline

    try:
        config = load()
    except ConfigError:
        config = None  # the node's epoch file is only one of the places the epoch comes from
    try:
        out = pipeline.push_image(args.images, args.to, job=args.job, name=args.name, epoch=args.epoch,
                                  config=config, progress_stream=_progress(args))
    except SnapguardError as e:
        return _store_failure(args, e)
    print(json.dumps(out, indent=2, sort_keys=True) if args.json else
          f"snapguard push: ok, {out['url']} (epoch {out['epoch']})")
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    from . import pipeline

    try:
        out = pipeline.pull_image(args.from_url, args.images, job=args.job, image=args.image,
                                  progress_stream=_progress(args))
    except SnapguardError as e:
        return _store_failure(args, e)
    print(json.dumps(out, indent=2, sort_keys=True) if args.json else
          f"snapguard pull: ok, {out['images']} ({out['bytes']} bytes in {out['seconds']:.2f} s, verified)")
    return 0


def _cmd_restore_from(args: argparse.Namespace) -> int:
    """restore --from: on a refusal with a file checkpoint known, FALLBACK_TO_FILE_CHECKPOINT and
    exit 3 with its path on stdout."""
    from . import pipeline

    try:
        config = load()
        result = pipeline.restore_from(args.from_url, config, job=args.job, image=args.image, images=args.images,
                                       tcp_established=args.tcp_established, file_checkpoint=args.file_checkpoint,
                                       device_map=args.device_map, progress_stream=_progress(args))
    except Exception as e:
        failure = failure_from(e)
        fallback = failure.evidence.get("file_checkpoint") or args.file_checkpoint
        print(failure.message, file=sys.stderr)
        if args.json and not fallback:  # with a fallback, stdout is its path alone
            print(json.dumps(failure.to_dict(), indent=2, sort_keys=True, default=str))
        if fallback:
            print(f"snapguard {Reason.FALLBACK_TO_FILE_CHECKPOINT.name}: {failure.reason.name}; start job "
                  f"{failure.evidence.get('job') or args.job or '?'} from its file checkpoint {fallback}",
                  file=sys.stderr)
            print(fallback)
            return EXIT_FALLBACK
        return EXIT_USAGE if failure.reason.phase.value == "usage" or isinstance(e, ConfigError) else 1
    _write_record(pipeline, result["image"], result)
    _print_result(result, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["drill"]:
        return _cmd_drill(argv[1:])
    args = _parser().parse_args(argv)
    commands = {"preflight": _cmd_preflight, "reasons": _cmd_reasons,
                "checkpoint": _cmd_checkpoint, "restore": _cmd_restore, "plan": _cmd_plan,
                "install": _cmd_install, "metrics": _cmd_metrics, "push": _cmd_push, "pull": _cmd_pull,
                "prune": _cmd_prune}
    if args.command in ("agent", "notice", "protect"):
        from . import notice

        commands[args.command] = notice.COMMANDS[args.command]
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # the boundary: one typed line, never a traceback
        failure = failure_from(e)
        print(failure.message, file=sys.stderr)
        return EXIT_USAGE if failure.reason.phase.value == "usage" or isinstance(e, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
