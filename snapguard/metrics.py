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

And what the node's snapshots, restores and notices did (snapguard.tally's file under the state
directory, which every executor run and the agent add to), in the textfile and on the agent's
`--metrics-port` (loopback unless told):

    snapguard_snapshots_total{outcome,reason}  outcome ok or failed, reason the typed one (none when ok)
    snapguard_restores_total{outcome,reason}
    snapguard_snapshot_duration_seconds, snapguard_restore_duration_seconds    histograms
    snapguard_snapshot_bytes, snapguard_restore_bytes                          histograms (image bytes)
    snapguard_notices_total{source}
    snapguard_last_whole_snapshot_timestamp_seconds{job}
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from . import __version__, tally

if TYPE_CHECKING:
    from .preflight import Report

__all__ = ["TEXTFILE_NAME", "DEFAULT_TEXTFILE_DIR", "MetricsUnavailable", "operations_registry", "serve",
           "write_textfile"]

TEXTFILE_NAME = "snapguard.prom"
DEFAULT_TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"


class MetricsUnavailable(Exception):
    """prometheus_client is not installed."""


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise MetricsUnavailable("prometheus_client is not installed: pip install 'snapguard[metrics]' "
                                 "(the Debian package has it)") from None
    return prometheus_client


def _operations(state_dir: str) -> list[Any]:
    """The metric families of `state_dir`'s tallies, read now."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    doc = tally.load(state_dir)
    out: list[Any] = []
    for kind in tally.KINDS:
        c = CounterMetricFamily(f"snapguard_{kind}s", f"{kind}s by outcome and typed reason",
                                labels=("outcome", "reason"))
        for key, n in sorted(doc["counts"].get(kind, {}).items()):
            outcome, _, reason = key.partition(" ")
            c.add_metric((outcome, reason), n)
        out.append(c)
        for part, unit, buckets in (("seconds", "duration_seconds", tally.SECONDS_BUCKETS),
                                    ("bytes", "bytes", tally.BYTES_BUCKETS)):
            h = HistogramMetricFamily(f"snapguard_{kind}_{unit}", f"how long each {kind} took" if part == "seconds"
                                      else f"the image bytes of each {kind}")
            got = doc[part].get(kind)
            if got:
                running, cumulative = 0, []
                for le, n in zip(buckets, got[:-1]):
                    running += n
                    cumulative.append(("+Inf" if le == float("inf") else repr(le), running))
                h.add_metric((), cumulative, got[-1])
            out.append(h)
    n = CounterMetricFamily("snapguard_notices", "notices the agent acted on, by source", labels=("source",))
    for source, count in sorted(doc["notices"].items()):
        n.add_metric((source,), count)
    w = GaugeMetricFamily("snapguard_last_whole_snapshot_timestamp_seconds",
                          "when the job's last whole snapshot was sealed (Unix time)", labels=("job",))
    for job, at in sorted(doc["whole"].items()):
        w.add_metric((job,), at)
    return [*out, n, w]


class _Operations:
    """A prometheus_client collector of `state_dir`'s tallies."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir

    def collect(self) -> list[Any]:
        return _operations(self.state_dir)


def operations_registry(state_dir: str) -> Any:
    """A prometheus_client registry whose every scrape reads `state_dir`'s tallies afresh."""
    registry = _client().CollectorRegistry()
    registry.register(_Operations(state_dir))
    return registry


def serve(port: int, address: str, state_dir: str) -> Any:
    """Serve the tallies over HTTP on address:port (prometheus_client's server, in threads of
    this process); the server, to shut down."""
    server, _thread = _client().start_http_server(port, addr=address, registry=operations_registry(state_dir))
    return server


def write_textfile(report: Report, directory: str, duration_s: float, name: str = TEXTFILE_NAME,
                   state_dir: str | None = None) -> str:
    """Write `report` (a node report), and `state_dir`'s tallies when given, as `directory/name`;
    returns the path."""
    client = _client()
    CollectorRegistry, Gauge, write_to_textfile = client.CollectorRegistry, client.Gauge, client.write_to_textfile
    registry = CollectorRegistry()
    if state_dir is not None:
        registry.register(_Operations(state_dir))

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
