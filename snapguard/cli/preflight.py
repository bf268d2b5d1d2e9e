"""`snapguard preflight`: can this node, process, container or image be snapshotted or restored.

A JUnit report (--junit) is written whole for a CI runner to read, 0644 (files.write_atomic: a
link planted at its path is replaced, never followed)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .. import __version__
from ..config import load
from ..files import write_atomic
from ..reasons import Reason, SnapguardError
from ._base import capabilities, unchecked_report

__all__ = ["PREFLIGHT_EPILOG", "add_parser", "run"]


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


def add_parser(sub: Any) -> None:
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
    pre.add_argument("--require", type=capabilities, metavar="LIST",
                     help="--node: comma-separated capabilities that decide the exit status, or `all` (default: "
                          "host-netns-containers,gpu where the node has an NVIDIA driver, else host-netns-containers)")
    pre.add_argument("--json", action="store_true", help="print the report as JSON")
    pre.add_argument("--junit", metavar="FILE",
                     help="also write the report as JUnit XML to FILE (one testcase per check and capability)")


def _preflight_target(args: argparse.Namespace) -> str:
    if args.node:
        return "--node"
    if args.pid is not None:
        return f"--pid {args.pid}"
    if args.container is not None:
        return f"--container {args.container}"
    return f"--manifest {args.manifest}"


def run(args: argparse.Namespace) -> int:
    if args.require is not None and not args.node:
        raise SnapguardError(Reason.USAGE_ERROR, "--require applies to --node only")
    from .. import preflight

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
        report = unchecked_report(e, _preflight_target(args))
    code = report.exit_code
    if args.junit:
        try:
            write_atomic(os.path.abspath(args.junit), report.to_junit(__version__), 0o644)
        except OSError as e:
            print(f"snapguard PREFLIGHT_FAILED: cannot write the JUnit report {args.junit}: {e.strerror or e}",
                  file=sys.stderr)
            code = code or preflight.EXIT_UNCHECKED
    print(report.to_json() if args.json else report.to_text())
    return code
