"""`snapguard metrics`: the node preflight as Prometheus textfile metrics.

node-exporter's textfile collector reads `*.prom` files from a directory (Debian's
prometheus-node-exporter: /var/lib/prometheus/node-exporter). The file is written with
prometheus_client's `write_to_textfile` (a temporary file renamed over it, so the collector never
reads half a file). prometheus_client is the optional extra `metrics` (`pip install
'snapguard[metrics]'`); the Debian package has it in its venv.

The series, for alerting on nodes that lost the ability to snapshot:

    snapguard_node_ready                       1 when `snapguard preflight --node` would exit 0
    snapguard_preflight_exit_code              0 ready, 1 blocked, 2 could not check
    snapguard_capability_ready{capability,required}
    snapguard_capability_blocked{capability,reason}   1 per typed reason that blocks it
    snapguard_check_ok{check}                  1 ok or warning only, 0 blocked or could not run
    snapguard_check_finding{check,reason,severity}    1 per finding (blockers and warnings)
    snapguard_preflight_duration_seconds, snapguard_preflight_timestamp_seconds
    snapguard_info{version}
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from . import __version__

if TYPE_CHECKING:
    from .preflight import Report

__all__ = ["TEXTFILE_NAME", "DEFAULT_TEXTFILE_DIR", "write_textfile"]

TEXTFILE_NAME = "snapguard.prom"
DEFAULT_TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"


class MetricsUnavailable(Exception):
    """prometheus_client is not installed."""


def write_textfile(report: Report, directory: str, duration_s: float, name: str = TEXTFILE_NAME) -> str:
    """Write `report` (a node report) as `directory/name`; returns the path."""
    try:
        from prometheus_client import CollectorRegistry, Gauge, write_to_textfile
    except ImportError:
        raise MetricsUnavailable("prometheus_client is not installed: pip install 'snapguard[metrics]' "
                                 "(the Debian package has it)") from None
    registry = CollectorRegistry()

    def gauge(metric: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(metric, doc, labels, registry=registry)

    gauge("snapguard_info", "snapguard's version", ("version",)).labels(__version__).set(1)
    gauge("snapguard_node_ready", "1 when `snapguard preflight --node` is READY (exit 0)").set(
        1 if report.exit_code == 0 else 0)
    gauge("snapguard_preflight_exit_code", "exit status of the node preflight: 0 ready, 1 blocked, 2 unchecked").set(
        report.exit_code)
    gauge("snapguard_preflight_duration_seconds", "how long the node preflight took").set(round(duration_s, 3))
    gauge("snapguard_preflight_timestamp_seconds", "when the node preflight ran (Unix time)").set(round(time.time()))
    ready = gauge("snapguard_capability_ready", "1 when the capability is ready", ("capability", "required"))
    blocked = gauge("snapguard_capability_blocked", "1 per typed reason that blocks the capability",
                    ("capability", "reason"))
    for cap in report.capabilities:
        ready.labels(cap.name, str(cap.required).lower()).set(1 if cap.status == "ready" else 0)
        for reason in sorted({f.reason.name for f in cap.blockers}):
            blocked.labels(cap.name, reason).set(1)
    ok = gauge("snapguard_check_ok", "1 when the check passed (warnings allowed)", ("check",))
    finding = gauge("snapguard_check_finding", "1 per typed finding of the check", ("check", "reason", "severity"))
    for check in report.checks:
        ok.labels(check.name).set(1 if check.status in ("ok", "warning") else 0)
        if check.reason is not None:
            finding.labels(check.name, check.reason.name, "error").set(1)
        for f in check.findings:
            finding.labels(check.name, f.reason.name, f.severity.value).set(1)
    os.makedirs(directory, mode=0o755, exist_ok=True)  # node-exporter may come later
    path = os.path.join(directory, name)
    write_to_textfile(path, registry)
    os.chmod(path, 0o644)
    return path
