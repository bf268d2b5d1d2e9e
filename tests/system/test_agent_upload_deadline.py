"""The agent's upload on the runc path (no CRI) is bound by the notice's lead.

A runc container (snapguard_lab.targets.RuncTarget) protected with `snapguard protect
--container`; the store is s3:// on the real radosgw (snapguard_lab.s3), reached through a proxy
on loopback that forwards every request as it came, signature intact, but never answers the
upload of an image's page file (its PUT, whole or as a multipart part): a store that takes the
small writes (the agent's probe, the epochs) and then stalls. On a notice with a 6 s lead the
agent snapshots the container; the stream while CRIU writes and the push after the seal get what
is left of the lead, and each ends with a typed reason (STORE_TOO_SLOW inside AGENT_UPLOAD_FAILED)
by the notice's deadline, not the store's own deadlines (tens of seconds per exchange).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from snapguard_lab.s3proxy import S3Proxy
from snapguard_lab.targets import RuncTarget, snapguard_path

pytest_plugins = ("snapguard_lab.s3",)  # rgw: one real radosgw for the session
pytestmark = [pytest.mark.stack, pytest.mark.timeout(180)]

LEAD_S = 6


class StallingProxy(S3Proxy):
    """In front of the real radosgw: forwards every request unchanged, except the PUT of a page
    file, whose body it reads and never answers (until the client gives up and closes)."""

    def __init__(self, upstream_port: int) -> None:
        self.held: list[str] = []
        super().__init__(upstream_port)

    def intercept(self, method: str, target: str, body: bytes, conn: socket.socket) -> bool:
        if method == "PUT" and "/pages-" in target:
            self.held.append(target)
            while conn.recv(1 << 16):  # no answer, ever: until the client shuts the socket
                pass
            return True
        return False


def test_a_stalled_upload_ends_typed_by_the_notices_deadline(rgw, tmp_path: Path) -> None:
    import boto3

    bucket = f"sg-{uuid.uuid4().hex[:12]}"
    boto3.session.Session().client("s3", endpoint_url=rgw.endpoint).create_bucket(Bucket=bucket)
    proxy = StallingProxy(rgw.port)
    t = RuncTarget(tmp_path / "target")
    state = tmp_path / "agent-state"
    env = {**t.env(), "SNAPGUARD_STATE_DIR": str(state), "S3_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
           "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{proxy.port}"}
    try:
        t.start(lines=3)
        exe = snapguard_path()
        for argv in (["protect", "--container", t.container_id, "--root", str(t.root), "--job", "upload-job"],
                     ["notice", "--queue", "--lead", str(LEAD_S), "--reason", "spot"]):
            out = subprocess.run([exe, *argv], env=env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
        agent = subprocess.run([exe, "agent", "--once", "--host-checks-every", "0", "--store", f"s3://{bucket}/snaps"],
                               env=env, capture_output=True, text=True, timeout=120)
        ended = time.time()
        assert agent.returncode == 0, agent.stderr
        journal = [json.loads(x) for x in (state / "agent" / "journal.jsonl").read_text().splitlines()]
        events = {e["event"]: e for e in journal}
        deadline = events["noticed"]["deadline"]
        assert events["store_check"]["writable"] is True  # the small writes went through
        assert "snapshot_sealed" in events, agent.stderr
        started = [e for e in journal if e["event"] == "upload_started"]
        failed = [e for e in journal if e["event"] == "upload_failed"]
        assert started and all(e["deadline"] == deadline for e in started), started
        assert failed and all(e["record"]["reason"] == "AGENT_UPLOAD_FAILED" and
                              e["record"]["evidence"]["cause"] == "STORE_TOO_SLOW" for e in failed), failed
        assert "uploaded" not in events and proxy.held
        # ended by the notice's deadline (the push after a failed stream gets at least 1 s)
        assert ended - deadline < 5, (ended - deadline, agent.stderr[-2000:])
    finally:
        t.stop()
        proxy.close()
