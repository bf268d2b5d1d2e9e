"""`snapguard pull`: fetch an image from a store, verifying it while reading."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..reasons import SnapguardError
from ._base import STORE_EPILOG, need_store, progress, store_failure, store_flag

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    pl = sub.add_parser("pull", help="fetch an image from a store, verifying it while reading",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=STORE_EPILOG,
                        description=("Fetch the job's newest whole image (or --image) into --images, a new or "
                                     "empty directory made root-only; every byte is checked against the manifest "
                                     "as it arrives and the local marker is written last."))
    store_flag(pl, "--from", required=True)
    pl.add_argument("--images", required=True, metavar="DIR", help="where the image goes (new or empty)")
    pl.add_argument("--job", metavar="J", help="the job (default: the store's only job)")
    pl.add_argument("--image", metavar="NAME", help="this image instead of the newest whole one")
    pl.add_argument("--progress", action="store_true", help="draw the transfer's progress on a terminal")
    pl.add_argument("--json", action="store_true", help="print what was pulled as JSON")


def run(args: argparse.Namespace) -> int:
    from .. import pipeline

    url = need_store(args, "pull")
    try:
        out = pipeline.pull_image(url, args.images, job=args.job, image=args.image,
                                  progress_stream=progress(args))
    except SnapguardError as e:
        return store_failure(args, e)
    print(json.dumps(out, indent=2, sort_keys=True) if args.json else
          f"snapguard pull: ok, {out['images']} ({out['bytes']} bytes in {out['seconds']:.2f} s, verified)")
    return 0
