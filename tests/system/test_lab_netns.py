"""The lab's network-namespace nodes (snapguard_lab.netns) beside a link a killed run left behind:
a set never takes a subnet that is already on a link here, since the host's answers to the nodes
would then leave by either link (a connect from a node times out)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from snapguard_lab.netns import Nodes

pytestmark = pytest.mark.root  # network namespaces and a bridge


def test_a_stale_link_s_subnet_is_never_taken_and_nodes_reach_the_host() -> None:
    with Nodes(["x"]) as stale:  # what a killed run leaves: a bridge with its address, still up
        with pytest.raises(ValueError, match="already on a link"):
            Nodes(["y"], subnet=stale.subnet).__enter__()
        with Nodes(["a"]) as fresh:
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
