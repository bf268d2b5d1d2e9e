"""`snapguard prune`: delete a job's older images from an image store."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..reasons import Reason, SnapguardError
from ._base import exit_code, store_failure

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
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


def run(args: argparse.Namespace) -> int:
    from ..store import open_store

    try:
        store = open_store(args.store)
        if not store.images(args.job, whole_only=False):  # a typo'd store or job is not "0 deleted"
            raise SnapguardError(Reason.STORE_JOB_NOT_FOUND, f"store {args.store} holds no image of job {args.job}"
                                 + ("" if store.jobs() else " (it holds no job at all: does it exist?)"),
                                 evidence={"store": args.store, "job": args.job})
        gone = store.prune(args.job, args.keep)
    except SnapguardError as e:
        return store_failure(args, e) and exit_code(e.failure, e)
    print(json.dumps({"ok": True, "job": args.job, "deleted": gone}, indent=2) if args.json else
          f"snapguard prune: {len(gone)} image(s) of {args.job} deleted" + (f": {', '.join(gone)}" if gone else ""))
    return 0
