"""`snapguard images`: the images in a store, one row each (kubectl get's columns), or --json."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..reasons import Reason, SnapguardError
from ._base import STORE_EPILOG, need_store
from ._show import image_row, table, text_row

__all__ = ["add_parser", "run"]

HEADER = ["JOB", "NAME", "EPOCH", "SIZE", "AGE", "HOST", "GPUS", "STATUS"]


def add_parser(sub: Any) -> None:
    im = sub.add_parser("images", help="list the images in a store",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=STORE_EPILOG + """\
STATUS: Whole (marker present, restorable), Superseded (whole, but the job was restored under a
newer epoch since: restoring it is ALREADY_RESTORED unless --force), Incomplete (no marker: an
upload under way or one that died; --all), Invalid (a store record or manifest snapguard did not
write: never restored). A store with nothing of --job (or no job at all) is STORE_JOB_NOT_FOUND,
exit 2: a mistyped URL is not an empty list.
""", description=("List the store's images (of --job, else of every job), oldest first: job, name, "
                  "the fencing epoch it was pushed under, size, age, the host it was taken on, the GPUs "
                  "its processes used, and its status. Every record is read as untrusted input."))
    im.add_argument("--store", required=True, metavar="URL", help="the store (file:// or s3://)")
    im.add_argument("--job", metavar="J", help="this job's images only")
    im.add_argument("--all", action="store_true", help="also the images without a completion marker")
    im.add_argument("--json", action="store_true", help="print the images as JSON (a list)")


def run(args: argparse.Namespace) -> int:
    from ..store import catalog, open_store

    url = need_store(args, "images")
    store = open_store(url)
    items = catalog(store, args.job, whole_only=not args.all)
    if not items and (args.job or not store.jobs()):
        what = f"no image of job {args.job}" if args.job else "no job at all"
        raise SnapguardError(Reason.STORE_JOB_NOT_FOUND, f"store {url} holds {what} (a mistyped URL or job?)",
                             evidence={"store": url, "job": args.job})
    if args.json:
        print(json.dumps([image_row(i) for i in items], indent=2, sort_keys=True))
    elif not items:  # jobs, but none with a whole image: said, as kubectl's "No resources found"
        print(f"snapguard images: no whole image in {url} (--all shows the incomplete ones)")
    else:
        now = time.time()
        print(table(HEADER, [text_row(i, now) for i in items]))
    return 0
