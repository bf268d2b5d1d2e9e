"""`snapguard restore`: restore a bare process tree from an image directory, or from a store (--store).

Its flags become one pipeline.Request (--images), or pipeline.restore_from's arguments (--store)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..config import load
from ..devicemap import DeviceMap
from ..reasons import Reason, SnapguardError, failure_from
from ..takepoint import protocol
from ._base import EXIT_FALLBACK, exit_code, print_result, progress, snapshot, store_flag, write_record

__all__ = ["RESTORE_EPILOG", "add_parser", "run"]


RESTORE_EPILOG = """\
restore --store URL: fetch the job's newest whole image (or --image NAME) into --images (default: a
new private directory in the state dir), verifying every byte against the manifest as it arrives,
then restore it as --images would. The job's next fencing epoch is taken right before CRIU runs,
after every check passed (one restore wins a race; the other is FENCED and starts nothing); a
restore that fails after taking it rolls it back, leaving the running copy unfenced. An image
pushed under an older epoch than the job's current one was restored since: ALREADY_RESTORED,
nothing started, unless --force.
exit codes:
  0  restored
  1  refused or failed (one typed line on stderr)
  2  usage or configuration error
  3  refused, and the job has a file checkpoint (--file-checkpoint, or the newest one registered
     in the store): stderr says why and FALLBACK_TO_FILE_CHECKPOINT, stdout is the checkpoint's
     path or URL alone: start the job from it
"""


def add_parser(sub: Any) -> None:
    rt = sub.add_parser("restore", help="restore a bare process tree from --images",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=RESTORE_EPILOG,
                        description=("Verify the image (completion marker, checksums, manifest), compare it with "
                                     "this host (CPU, driver, GPU model, count and memory, pids), restore it "
                                     "detached with CRIU and check its CUDA processes run."))
    rt.add_argument("--images", metavar="DIR", help="image directory (root-owned, root-only); with --store, where "
                    "the fetched image goes")
    rt.add_argument("--tcp-established", action="store_true", help="restore established TCP connections")
    rt.add_argument("--device-map", type=_device_map, metavar="OLD=NEW[,...]",
                    help="restore the image's GPUs onto others: OLD is the image's GPU (its index in the "
                         "manifest, or its UUID), NEW this host's (NVML index or UUID); name every GPU the "
                         "image used. Default: the same GPUs, or by index when they are not here")
    rt.add_argument("--rendezvous", type=_rendezvous, metavar="HOST:PORT",
                    default=os.environ.get(protocol.RENDEZVOUS_ENV) or None,
                    help="where the restored ranks' process groups rebuild their store: the address of the "
                         "node that restores rank 0, and a free port there (rank 0 hosts it, the others "
                         "connect); give every node of the job the same. Default: $SNAPGUARD_RENDEZVOUS, else "
                         "the address the job started with (a restore on the same addresses)")
    rt.add_argument("--json", action="store_true", help="print the result record as JSON")
    store_flag(rt, "--from", required=False, help="an image store (file:// or s3://): fetch, verify while reading "
               "and restore the job's newest whole image")
    rt.add_argument("--job", metavar="J", help="--store: the job (default: the store's only job)")
    rt.add_argument("--image", metavar="NAME", help="--store: this image instead of the newest whole one")
    rt.add_argument("--file-checkpoint", metavar="PATH_OR_URL",
                    help="--store: the job's file checkpoint, printed with exit 3 when the restore is refused "
                         "(default: the newest one registered in the store)")
    rt.add_argument("--force", action="store_true",
                    help="--store: restore even an image the job was restored from since (ALREADY_RESTORED "
                         "otherwise). Risk: if that copy still runs, two copies of the job run at once; the older "
                         "one is fenced (its pushes are refused) but not stopped. Use only once it is known gone")
    rt.add_argument("--progress", action="store_true", help="draw the transfer's progress on a terminal")


def run(args: argparse.Namespace) -> int:
    from .. import pipeline

    if args.store:
        return _restore_from(args)
    if not args.images:
        raise SnapguardError(Reason.USAGE_ERROR, "restore needs --images DIR or --store URL")
    config = load()
    req = pipeline.Request(os.path.abspath(args.images), tcp_established=args.tcp_established,
                           device_map=args.device_map, timeouts=pipeline.Timeouts.from_config(config),
                           rendezvous=args.rendezvous)
    return snapshot(args, req.work_dir, lambda: pipeline.restore(pipeline.CriuRunner(config.criu), req, config))


def _rendezvous(text: str) -> str:
    try:
        host, port = protocol.parse_rendezvous(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _device_map(text: str) -> DeviceMap:
    try:
        return DeviceMap.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _restore_from(args: argparse.Namespace) -> int:
    """restore --store: on a refusal with a file checkpoint known, FALLBACK_TO_FILE_CHECKPOINT and
    exit 3 with its path on stdout."""
    from .. import pipeline

    try:
        config = load()
        result = pipeline.restore_from(args.store, config, job=args.job, image=args.image, images=args.images,
                                       tcp_established=args.tcp_established, file_checkpoint=args.file_checkpoint,
                                       device_map=args.device_map, force=args.force,
                                       progress_stream=progress(args), rendezvous=args.rendezvous)
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
        return exit_code(failure, e)
    write_record(pipeline, result["image"], result)
    print_result(result, args.json)
    return 0
