"""The lab's network-namespace nodes (snapguard_lab.netns) beside a link a killed run left behind:
a set never takes a subnet that is already on a link here, since the host's answers to the nodes
would then leave by either link (a connect from a node times out); and the next set made sweeps
what a killed run left (its namespaces and bridge), never a set whose maker still runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from snapguard_lab.netns import RECORDS, Nodes

MAKE_AND_HANG = """
import sys, time
from snapguard_lab.netns import Nodes
nodes = Nodes(["p", "q"]).__enter__()
print(nodes.tag, flush=True)
time.sleep(600)
"""


def _links() -> str:
    return subprocess.run(["/usr/sbin/ip", "-br", "link"], capture_output=True, text=True, check=True).stdout


def _namespaces() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()

pytestmark = pytest.mark.root  # network namespaces and a bridge


def test_a_stale_link_s_subnet_is_never_taken_and_nodes_reach_the_host() -> None:
    with Nodes(["x"]) as stale:  # what a killed run leaves: a bridge with its address, still up
        with pytest.raises(ValueError, match="already on a link"):
            Nodes(["y"], subnet=stale.subnet).__enter__()
        with Nodes(["a"]) as fresh:
            assert f"sgbr{stale.tag}" in _links(), "a set whose maker runs was swept"
            assert fresh.subnet != stale.subnet
            server = socket.create_server((fresh.host_address, 0))
            try:
                server.settimeout(10)
                port = server.getsockname()[1]
                probe = subprocess.Popen([sys.executable, "-c", "import socket, sys; "
                                          "socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()",
                                          fresh.host_address, str(port)], preexec_fn=fresh.enter("a"))
                conn, peer = server.accept()
                conn.close()
                assert probe.wait(timeout=10) == 0
                assert peer[0] == fresh.addresses["a"]
            finally:
                server.close()


@pytest.mark.timeout(120)
def test_a_killed_run_s_set_is_swept_by_the_next_one() -> None:
    maker = subprocess.Popen([sys.executable, "-c", MAKE_AND_HANG], stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout is not None
        tag = maker.stdout.readline().strip()
        assert tag, "the maker made no set"
        record = Path(RECORDS) / f"{tag}.json"
        rec = json.loads(record.read_text())
        assert rec["pid"] == maker.pid and set(rec["namespaces"]) <= _namespaces()
        assert f"sgbr{tag}" in _links()
    finally:
        maker.send_signal(signal.SIGKILL)
        maker.wait(timeout=30)
    assert f"sgbr{tag}" in _links() and record.exists(), "a killed run leaves its set (nothing swept yet)"
    with Nodes(["z"]) as nodes:
        assert nodes.tag != tag
        assert f"sgbr{tag}" not in _links(), "the killed run's bridge is still there"
        assert not set(rec["namespaces"]) & _namespaces(), "the killed run's namespaces are still there"
        assert not record.exists()
        assert (Path(RECORDS) / f"{nodes.tag}.json").exists()
    assert not (Path(RECORDS) / f"{nodes.tag}.json").exists(), "a set removed keeps its record"
