"""The operations metrics: snapguard.tally's file under a real state directory, added to by
several real processes at once, read back through snapguard.metrics' registry, served over a real
loopback HTTP port and parsed with prometheus_client's own parser; hostile tally files; and the
Grafana dashboard's every metric name present in what the code exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from snapguard import metrics, tally
from snapguard.reasons import Reason, SnapguardError

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "snapguard.json"

ADDER = """
import sys
from snapguard import tally
for i in range(int(sys.argv[2])):
    tally.note(state_dir=sys.argv[1], kind="snapshot", outcome="ok", seconds=1.5, size=3 << 20)
    tally.note(state_dir=sys.argv[1], source="aws")
"""


def _samples(registry: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


class _Config:
    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir


def test_concurrent_processes_add_up(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", ADDER, str(tmp_path), "10"]) for _ in range(4)]
    assert [p.wait(60) for p in procs] == [0] * 4
    got = _samples(metrics.operations_registry(str(tmp_path)))
    assert got[("snapguard_snapshots_total", (("outcome", "ok"), ("reason", "none")))] == 40
    assert got[("snapguard_notices_total", (("source", "aws"),))] == 40
    assert got[("snapguard_snapshot_duration_seconds_bucket", (("le", "2.0"),))] == 40
    assert got[("snapguard_snapshot_duration_seconds_bucket", (("le", "1.0"),))] == 0
    assert got[("snapguard_snapshot_bytes_count", ())] == 40
    assert got[("snapguard_snapshot_bytes_sum", ())] == 40 * (3 << 20)
    assert oct(Path(tally.path_for(str(tmp_path))).stat().st_mode & 0o777) == "0o600"


def test_counted_records_each_outcome_and_never_hides_the_error(tmp_path: Path) -> None:
    config = _Config(str(tmp_path))

    @tally.counted("restore")
    def restore(runner: object, req: object, config: object, fail: bool = False) -> dict:
        if fail:
            raise SnapguardError(Reason.CRIU_RESTORE_FAILED, "it failed")
        return {"ok": True, "image_bytes": 5000}

    assert restore(None, None, config) == {"ok": True, "image_bytes": 5000}
    with pytest.raises(SnapguardError):
        restore(None, None, config, fail=True)
    got = _samples(metrics.operations_registry(str(tmp_path)))
    assert got[("snapguard_restores_total", (("outcome", "ok"), ("reason", "none")))] == 1
    assert got[("snapguard_restores_total", (("outcome", "failed"), ("reason", "CRIU_RESTORE_FAILED")))] == 1
    assert got[("snapguard_restore_bytes_count", ())] == 1  # the failed one has no image bytes
    assert got[("snapguard_restore_duration_seconds_count", ())] == 2
    # a state directory that cannot be written: the operation's own result, no tally, no error
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert restore(None, None, _Config(str(blocked))) == {"ok": True, "image_bytes": 5000}


@pytest.mark.parametrize("content", [
    b"[" * 100_000, b"[1, 2]", b'{"counts": {"snapshot": {"ok none": "7"}}, "seconds": {}, "bytes": {}, '
    b'"notices": {}, "whole": {}}', b"x" * (tally.MAX_FILE_BYTES + 10), b"\xff\xfe",
])
def test_a_hostile_tally_file_is_started_afresh(tmp_path: Path, content: bytes) -> None:
    path = Path(tally.path_for(str(tmp_path)))
    path.parent.mkdir(mode=0o700)
    path.write_bytes(content)
    assert tally.load(str(tmp_path))["counts"] == {}
    tally.note(state_dir=str(tmp_path), kind="snapshot", outcome="failed", reason="FENCED")
    assert tally.load(str(tmp_path))["counts"] == {"snapshot": {"failed FENCED": 1}}


def test_labels_and_jobs_stay_bounded(tmp_path: Path) -> None:
    for i in range(tally.MAX_SOURCES + 5):
        tally.note(state_dir=str(tmp_path), source=f"s{i}")
    doc = tally.load(str(tmp_path))
    assert len(doc["notices"]) == tally.MAX_SOURCES
    doc["whole"] = {f"job{i}": float(i) for i in range(tally.MAX_JOBS)}
    Path(tally.path_for(str(tmp_path))).write_text(json.dumps(doc))
    tally.note(state_dir=str(tmp_path), job="new job\n{x}")
    whole = tally.load(str(tmp_path))["whole"]
    assert len(whole) == tally.MAX_JOBS and "job0" not in whole and "new_job__x_" in whole


def test_served_on_loopback_as_the_tallies_are_now(tmp_path: Path) -> None:
    server = metrics.serve(0, "127.0.0.1", str(tmp_path))
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        tally.note(state_dir=str(tmp_path), job="llama")
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert [s.labels for s in fams["snapguard_last_whole_snapshot_timestamp_seconds"].samples] == [{"job": "llama"}]
        tally.note(state_dir=str(tmp_path), kind="snapshot", outcome="ok")
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'snapguard_snapshots_total{outcome="ok",reason="none"} 1.0' in text
    finally:
        server.shutdown()
        server.server_close()


def _names(text: str) -> set[str]:
    """Every series name the text can carry, samples or not (a family with none yet still names them)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + suffix for f in text_string_to_metric_families(text) for suffix in suffixes.get(f.type, ("",))}


def test_every_metric_the_dashboard_uses_is_exported(tmp_path: Path) -> None:
    """The names come from the code's own registries: the operations one and the textfile's."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    exported = _names(generate_latest(metrics.operations_registry(str(tmp_path))).decode())
    out = tmp_path / "prom"
    report = SimpleNamespace(exit_code=0, capabilities=[], checks=[])
    metrics.write_textfile(report, str(out), 0.1, state_dir=str(tmp_path))  # type: ignore[arg-type]
    exported |= _names((out / metrics.TEXTFILE_NAME).read_text())
    dash = json.loads(DASHBOARD.read_text())
    used = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"\bsnapguard_[a-z_]+\b", t["expr"])}
    assert used and used <= exported, sorted(used - exported)
    assert {"snapguard_snapshots_total", "snapguard_restores_total", "snapguard_notices_total",
            "snapguard_snapshot_duration_seconds_bucket", "snapguard_last_whole_snapshot_timestamp_seconds"} <= used


def test_metrics_port_refused_before_anything_is_watched(tmp_path: Path) -> None:
    """`agent --metrics-port`: not a port, not an address, a port a real listener holds: each a
    typed USAGE_ERROR from the checks the agent runs before it watches anything."""
    import argparse
    import socket

    from snapguard.cli import agent

    for bad in ("0", "65536", "-1", "http", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            agent.port_number(bad)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for address in ("127.0.0.1", "not-an-address"):
            with pytest.raises(SnapguardError) as e:
                agent._serve_metrics(argparse.Namespace(metrics_port=port, metrics_address=address), str(tmp_path))
            assert e.value.reason is Reason.USAGE_ERROR
