"""`snapguard push`: upload a sealed image to an image store."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..config import ConfigError, load
from ..reasons import SnapguardError
from ._base import STORE_EPILOG, need_store, progress, store_failure, store_flag

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    ps = sub.add_parser("push", help="upload a sealed image to an image store",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=STORE_EPILOG,
                        description=("Upload the whole image in --images (marker present) to --store as an image of "
                                     "--job: every file verified against the manifest as it is read, then the "
                                     "manifest, then the marker. Refused with FENCED, writing nothing, when the "
                                     "job was restored elsewhere under a newer epoch than this node's."))
    ps.add_argument("--images", required=True, metavar="DIR", help="the sealed image directory")
    store_flag(ps, "--to", required=True)
    ps.add_argument("--job", metavar="J", help="the job (default: the image directory's name)")
    ps.add_argument("--name", metavar="NAME", help="the image's name in the store (default: UTC time, sortable)")
    ps.add_argument("--epoch", type=int, metavar="N", help="this node's fencing epoch of the job (default: the one "
                    "this node's last restore --store took, else the manifest's fence_epoch, else 0)")
    ps.add_argument("--progress", action="store_true", help="draw the transfer's progress on a terminal")
    ps.add_argument("--json", action="store_true", help="print what was pushed as JSON")


def run(args: argparse.Namespace) -> int:
    from .. import pipeline

    try:
        config = load()
    except ConfigError:
        config = None  # the node's epoch file is only one of the places the epoch comes from
    url = need_store(args, "push")
    try:
        out = pipeline.push_image(args.images, url, job=args.job, name=args.name, epoch=args.epoch,
                                  config=config, progress_stream=progress(args))
    except SnapguardError as e:
        return store_failure(args, e)
    print(json.dumps(out, indent=2, sort_keys=True) if args.json else
          f"snapguard push: ok, {out['url']} (epoch {out['epoch']})")
    return 0
