"""`snapguard webhook`: the mutating admission webhook (snapguard.webhook) as a server, and the
take point's directory a node keeps for it (--lay-out-hook)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from ..reasons import Reason, SnapguardError
from ._base import STORE_EPILOG, positive_seconds

__all__ = ["WEBHOOK_EPILOG", "add_parser", "run"]

WEBHOOK_EPILOG = """\
what it changes (AdmissionReview v1 POSTed to /mutate over HTTPS; GET /healthz answers `ok`):
  A pod is opted in by --runtime-class (default snapguard) and the annotation snapguard.io/job.
  In each of its containers it injects the take point: --hook-dir put first on PYTHONPATH (the
  spec's own PYTHONPATH after it), SNAPGUARD_TAKE_DIR=--take-dir unless the spec sets it, and
  two hostPath volumes mounted at the same paths: --hook-dir read-only (the standard-library-only
  take point that --lay-out-hook writes on each node: no site-packages of the node's) and the
  node's spill tmpfs --spill-dir (default /run/snapguard-spill; another is also set as
  SNAPGUARD_TAKE_SPILL_DIR unless the spec sets it). A PYTHONPATH set only in the image's config is
  replaced: name it in the pod's spec to keep it.
  With --store, when the job's newest snapshot published as a checkpoint image (the agent's
  record in the store, put once the image is whole in the registry) is newer than its newest
  file checkpoint and not yet restored (the job's epoch is still the snapshot's), the container
  it was taken from (else snapguard.io/container, else the first) gets that image by digest and
  the pod the annotations snapguard.io/epoch (the restore attempt's epoch) and
  snapguard.io/original-image.

It never refuses a pod (use failurePolicy: Ignore): a pod it cannot or need not change is
admitted as it came, and what it skipped, and why, is in the answer's warnings (kubectl prints
them) and in its log, one line per review. A body that is not an AdmissionReview v1 is answered
400 with a Status (ADMISSION_REVIEW_INVALID); one larger than --max-body-bytes 413, unread. Each
connection's TLS handshake and reads have a deadline (--io-timeout), the store's answer another
(--lookup-timeout: past it the pod starts as written). The certificate and key are read again
when their files change (a Secret's rotation).

""" + STORE_EPILOG


def add_parser(sub: Any) -> None:
    from ..takepoint import SPILL_TMPFS
    from ..takepoint.hookdir import HOOK_DIR
    from ..webhook.mutate import TAKE_DIR

    wh = sub.add_parser("webhook", help="the mutating admission webhook: take point into opted-in pods, restores "
                                        "from checkpoint images",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=WEBHOOK_EPILOG,
                        description=("Serve the mutating admission webhook over HTTPS (a Deployment, its certificate "
                                     "and key mounted from a Secret): inject the take point into pods opted in to "
                                     "snapguard and point a job's replacement pod at its snapshot's checkpoint "
                                     "image. Runs until SIGTERM or SIGINT."))
    wh.add_argument("--tls-cert", metavar="FILE", help="the server's PEM certificate (chain), e.g. the Secret's "
                                                       "tls.crt; required to serve")
    wh.add_argument("--tls-key", metavar="FILE", help="its PEM private key, e.g. the Secret's tls.key; required to serve")
    wh.add_argument("--address", default="0.0.0.0", metavar="ADDR", help="the address to listen on (default 0.0.0.0; "
                                                                          ":: for IPv6)")
    wh.add_argument("--port", type=_port, default=8443, metavar="N", help="the port (default 8443; 0: any free one, "
                                                                          "printed)")
    wh.add_argument("--runtime-class", default="snapguard", metavar="NAME",
                    help="the RuntimeClass that opts a pod in, with the annotation snapguard.io/job (default snapguard)")
    wh.add_argument("--hook-dir", default=HOOK_DIR, metavar="DIR",
                    help=f"the node's take-point directory, mounted read-only at the same path (default {HOOK_DIR})")
    wh.add_argument("--take-dir", default=TAKE_DIR, metavar="DIR",
                    help=f"the take point's socket directory in the container (default {TAKE_DIR})")
    wh.add_argument("--spill-dir", default=SPILL_TMPFS, type=_abs_dir, metavar="DIR",
                    help=f"the node's spill tmpfs, mounted read-write at the same path (default {SPILL_TMPFS})")
    wh.add_argument("--no-take-point", action="store_true", help="do not inject the take point (restores only)")
    wh.add_argument("--store", metavar="URL", help="the image store the agent publishes snapshots to; without it "
                                                   "no pod is pointed at a checkpoint image")
    wh.add_argument("--lookup-timeout", type=positive_seconds, default=3.0, metavar="S",
                    help="seconds the store may take to answer for one pod (default 3; keep it below the "
                         "webhook's timeoutSeconds)")
    wh.add_argument("--io-timeout", type=positive_seconds, default=10.0, metavar="S",
                    help="seconds for a connection's TLS handshake and each read or write (default 10)")
    wh.add_argument("--max-body-bytes", type=_size, default=4 << 20, metavar="N",
                    help="the largest request body read (default 4194304)")
    wh.add_argument("--lay-out-hook", metavar="DIR", help="write the take point's directory into DIR (what each node "
                                                          "keeps at --hook-dir) and exit")


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}")
    return int(text)


def _abs_dir(text: str) -> str:
    import posixpath

    if not text.startswith("/") or "\0" in text or len(text) > 4096:
        raise argparse.ArgumentTypeError(f"must be an absolute path, not {text!r}")
    return posixpath.normpath(text)


def _size(text: str) -> int:
    if not text.isdigit() or not 1024 <= int(text) <= 1 << 30:
        raise argparse.ArgumentTypeError(f"must be a number of bytes from 1024 to {1 << 30}, not {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    if args.lay_out_hook:
        from ..takepoint.hookdir import lay_out

        names = lay_out(args.lay_out_hook)
        print(f"snapguard webhook: the take point laid out in {args.lay_out_hook} ({len(names)} files)")
        return 0
    from .. import webhook

    if not args.tls_cert or not args.tls_key:
        raise SnapguardError(Reason.WEBHOOK_TLS_UNUSABLE, "--tls-cert and --tls-key are required: the API server "
                             "calls webhooks over HTTPS only")
    source = None
    if args.store:
        from ..store import open_store

        source = webhook.StoreSnapshots(open_store(args.store))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="snapguard webhook: %(message)s")
    server = webhook.Webhook(
        webhook.ServerConfig(args.tls_cert, args.tls_key, address=args.address, port=args.port,
                             max_body_bytes=args.max_body_bytes, io_timeout_s=args.io_timeout,
                             lookup_timeout_s=args.lookup_timeout),
        webhook.WebhookConfig(runtime_class=args.runtime_class, hook_dir=args.hook_dir, take_dir=args.take_dir,
                              spill_dir=args.spill_dir, inject=not args.no_take_point), source)

    def stop(signum: int, _frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = server.server_address[:2]
    print(f"snapguard webhook: listening on https://{host}:{port}{webhook.MUTATE_PATH}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0
