"""`snapguard metrics`: the node preflight as Prometheus textfile metrics (node-exporter)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config import load
from ._base import EXIT_USAGE, capabilities, seconds, unchecked_report

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    from ..metrics import DEFAULT_TEXTFILE_DIR

    met = sub.add_parser("metrics", help="the node preflight as Prometheus textfile metrics (node-exporter)",
                         description=("Run `snapguard preflight --node` and write its verdict, capabilities and "
                                      "checks to DIR/snapguard.prom with prometheus_client (extra `metrics`), with "
                                      "what the node's snapshots, restores and notices did (snapguard_snapshots_total, "
                                      "...). Exit 0 when written, whatever the verdict (it is in the metrics)."))
    met.add_argument("--textfile", default=DEFAULT_TEXTFILE_DIR, metavar="DIR",
                     help=f"node-exporter's textfile directory (default {DEFAULT_TEXTFILE_DIR})")
    met.add_argument("--require", type=capabilities, metavar="LIST", help="as preflight --node --require")
    met.add_argument("--interval", type=seconds, metavar="S", help="write again every S seconds, until stopped")


def run(args: argparse.Namespace) -> int:
    import time

    from .. import metrics, preflight

    while True:
        start = time.monotonic()
        state_dir = None
        try:
            config = load()
            state_dir = config.state_dir
            report = preflight.node_report(config, args.require)
        except Exception as e:  # unchecked, as preflight reports it: the metrics say so
            report = unchecked_report(e, "--node")
        try:
            path = metrics.write_textfile(report, args.textfile, time.monotonic() - start, state_dir=state_dir)
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
