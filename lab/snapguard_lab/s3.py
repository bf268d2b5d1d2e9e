"""A throwaway real S3 server for tests: Ceph's radosgw on a one-node cluster (Debian 12's Ceph 16).

ceph-mon + one memstore ceph-osd (its data in RAM) + radosgw (beast), every daemon with its state,
logs, pid files and sockets under one directory, listening on loopback (and on any extra addresses
given, e.g. the bridge the lab's network-namespace nodes reach). No ceph-mgr (S3 does not need it).
Stopped by the pids it recorded, each checked to be ours by its command line; never by name.
Adapted from shared/recipes/s3-radosgw.sh (measured there: start 2.3-2.5 s on 2 cores).

Packages (Debian 12): ceph-mon ceph-osd radosgw ceph-common (`RadosGW.missing()` names the absent).

`shared_gateway` is one radosgw for a whole test session, with two network-namespace nodes that
reach it over a link of their own; a test module that lists this module in `pytest_plugins` gets
it as the session fixtures `shared_s3`, `rgw` and `rgw_nodes` (started once, by the first test
that asks).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PACKAGES", "RadosGW", "RadosGWError", "Shared", "shared_gateway"]

PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-common")
_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "ceph-authtool", "monmaptool")
_DAEMONS = ("client.rgw.a", "osd.0", "mon.a")  # stop order
ACCESS_KEY = "TESTACCESSKEY0000001"
SECRET_KEY = "testsecretkey0000000000000000000000000001"


class RadosGWError(RuntimeError):
    pass


@dataclass
class RadosGW:
    dir: Path
    port: int = 7480
    mon_port: int = 40300
    extra_addresses: tuple[str, ...] = ()  # more addresses radosgw listens on (same port)
    mem_bytes: int = 2 << 30
    started_s: float = 0.0
    _pids: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def missing() -> list[str]:
        return [b for b in _BINARIES if shutil.which(b) is None]

    @property
    def conf(self) -> Path:
        return self.dir / "ceph.conf"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {"S3_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint,
                "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_REQUEST_CHECKSUM_CALCULATION": "WHEN_REQUIRED",
                "AWS_RESPONSE_CHECKSUM_VALIDATION": "WHEN_REQUIRED", "CEPH_CONF": str(self.conf)}

    def _run(self, *args: str, timeout: float = 60) -> str:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RadosGWError(f"{' '.join(args[:3])}... exit {out.returncode}: {out.stderr.strip()[-800:]}")
        return out.stdout

    def _ceph(self, *args: str, timeout: float = 30) -> str:
        return self._run("ceph", "-c", str(self.conf), "--connect-timeout", "20", *args, timeout=timeout)

    def _write_conf(self, fsid: str) -> None:
        d = self.dir
        endpoints = " ".join(f"endpoint={a}:{self.port}" for a in ("127.0.0.1", *self.extra_addresses))
        self.conf.write_text(f"""[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{self.mon_port}]
mon initial members = a
public addr = 127.0.0.1
ms bind ipv6 = false
ms bind msgr1 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = {d}/keyring
run dir = {d}/run
admin socket = {d}/run/$name.asok
pid file = {d}/run/$name.pid
log file = {d}/log/$name.log
crash dir = {d}/crash
log to stderr = false
err to stderr = false
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 1000
mon data avail warn = 1
mon data avail crit = 1
auth allow insecure global id reclaim = false

[mon]
mon data = {d}/mon/$id
mon cluster log file = {d}/log/cluster.log
paxos propose interval = 0.1

[osd]
osd data = {d}/osd/$id
osd objectstore = memstore
memstore device bytes = {self.mem_bytes}
osd memory target = 1073741824
osd crush update on start = true

[client.rgw.a]
rgw frontends = beast {endpoints}
rgw data = {d}/rgw
rgw thread pool size = 64
rgw enable usage log = false
rgw gc obj min wait = 10
rgw gc processor period = 10
""")

    def _pid(self, name: str) -> int | None:
        """The daemon's pid if it runs and is ours (its command line names our conf)."""
        try:
            pid = int((self.dir / "run" / f"{name}.pid").read_text().strip())
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            return None
        return pid if str(self.conf) in cmd and stat != "Z" else None

    def _wait(self, what: str, name: str, ok, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ok():
                    return
            except Exception:
                pass
            if self._pid(name) is None and (self.dir / "run" / f"{name}.pid").exists():
                raise RadosGWError(f"{name} died while waiting for {what}: {self._log_tail(name)}")
            if time.monotonic() > deadline:
                raise RadosGWError(f"timeout ({timeout:g} s) waiting for {what}: {self._log_tail(name)}")
            time.sleep(0.2)

    def _log_tail(self, name: str) -> str:
        try:
            return " | ".join((self.dir / "log" / f"{name}.log").read_text().splitlines()[-5:])
        except OSError:
            return "(no log)"

    def _http_ok(self) -> bool:
        body = urllib.request.urlopen(self.endpoint + "/", timeout=2).read()
        return b"ListAllMyBucketsResult" in body

    def start(self) -> RadosGW:
        """A fresh cluster in self.dir (any earlier one there stopped and wiped first)."""
        missing = self.missing()
        if missing:
            raise RadosGWError(f"missing {', '.join(missing)}: apt-get install -y --no-install-recommends "
                               + " ".join(PACKAGES))
        self.stop()
        t0 = time.monotonic()
        for sub in ("run", "log", "crash", "mon/a", "osd/0", "rgw"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        fsid, osd_uuid = str(uuid.uuid4()), str(uuid.uuid4())
        self._write_conf(fsid)
        k = str(self.dir / "keyring")
        self._run("ceph-authtool", "-C", k, "-g", "-n", "mon.", "--cap", "mon", "allow *")
        self._run("ceph-authtool", k, "-g", "-n", "client.admin", "--cap", "mon", "allow *", "--cap", "osd",
                  "allow *", "--cap", "mgr", "allow *", "--cap", "mds", "allow *")
        self._run("ceph-authtool", k, "-g", "-n", "osd.0", "--cap", "mon", "allow profile osd", "--cap", "mgr",
                  "allow profile osd", "--cap", "osd", "allow *")
        self._run("ceph-authtool", k, "-g", "-n", "client.rgw.a", "--cap", "mon", "allow rw", "--cap", "osd",
                  "allow rwx", "--cap", "mgr", "allow rw")
        try:
            monmap = str(self.dir / "monmap")
            self._run("monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]",
                      monmap)
            self._run("ceph-mon", "-c", str(self.conf), "-i", "a", "--mkfs", "--monmap", monmap, "--keyring", k)
            self._run("ceph-mon", "-c", str(self.conf), "-i", "a")
            self._wait("mon quorum", "mon.a", lambda: self._ceph("mon", "stat") is not None, 60)
            osd_id = self._ceph("osd", "new", osd_uuid).strip()
            if osd_id != "0":
                raise RadosGWError(f"expected osd id 0, got {osd_id!r}")
            self._run("ceph-osd", "-c", str(self.conf), "-i", "0", "--mkfs", "--osd-uuid", osd_uuid, timeout=120)
            self._run("ceph-osd", "-c", str(self.conf), "-i", "0")
            self._wait("osd.0 up", "osd.0", lambda: any(
                line.startswith("osd.0 up ") for line in self._ceph("osd", "dump").splitlines()), 120)
            self._run("radosgw", "-c", str(self.conf), "-n", "client.rgw.a")
            self._wait(f"radosgw on {self.endpoint}", "client.rgw.a", self._http_ok, 120)
            user = self._run("radosgw-admin", "-c", str(self.conf), "user", "create", "--uid=test",
                             "--display-name=test", f"--access-key={ACCESS_KEY}", f"--secret-key={SECRET_KEY}")
            json.loads(user)
        except BaseException:
            self.kill()
            raise
        self.started_s = time.monotonic() - t0
        return self

    def kill(self) -> list[int]:
        """SIGKILL our daemons by pid (state is thrown away: nothing needs a clean stop)."""
        pids = [p for p in (self._pid(n) for n in _DAEMONS) if p is not None]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        for name in _DAEMONS:
            while self._pid(name) is not None and time.monotonic() < deadline:
                time.sleep(0.05)
        return pids

    def stop(self) -> None:
        if self.dir.exists():
            self.kill()
            shutil.rmtree(self.dir, ignore_errors=True)


# --- one radosgw for a whole test session -----------------------------------------------------

@dataclass
class Shared:
    """The session's radosgw and the two network-namespace nodes that reach it over their link
    (`nodes.host_address`, radosgw's port), with the S3 environment set while it runs."""

    gw: RadosGW
    nodes: object  # snapguard_lab.netns.Nodes


@contextlib.contextmanager
def shared_gateway(directory: Path) -> Iterator[Shared]:
    """Start two nodes and one radosgw listening on loopback and on their link; set the S3
    environment (endpoint, test keys; not CEPH_CONF) for what runs meanwhile, and put the old one
    back, nodes and daemons ended, when done. A port another run holds: once more, elsewhere."""
    import random

    from .netns import Nodes

    with Nodes(["a", "b"]) as nodes:  # a link of its own, on a free subnet
        for attempt in range(2):
            port = random.randrange(17000, 18900)
            gw = RadosGW(directory / f"rgw{attempt}", port=port, mon_port=port + 23000,
                         extra_addresses=(nodes.host_address,))
            try:
                gw.start()
                break
            except RadosGWError:
                if attempt:
                    raise
        saved = {k: os.environ.get(k) for k in gw.env()}
        os.environ.update({k: v for k, v in gw.env().items() if k != "CEPH_CONF"})
        try:
            yield Shared(gw, nodes)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            gw.stop()


def _skip_when_missing() -> None:
    import pytest

    if RadosGW.missing():
        pytest.skip(f"radosgw cannot start here: missing {', '.join(RadosGW.missing())} "
                    "(packaging/install-deps.sh installs " + " ".join(PACKAGES) + ")")


def _fixtures() -> tuple[object, object, object]:
    """The pytest fixtures of a test module that names this module in `pytest_plugins`:
    `shared_s3` (session: started by the first test that asks, ended with the session), and `rgw`
    and `rgw_nodes`, its parts."""
    import pytest

    @pytest.fixture(scope="session")
    def shared_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
        _skip_when_missing()
        with shared_gateway(tmp_path_factory.mktemp("shared-rgw")) as shared:
            yield shared

    @pytest.fixture(scope="session")
    def rgw(shared_s3: Shared) -> RadosGW:
        return shared_s3.gw

    @pytest.fixture(scope="session")
    def rgw_nodes(shared_s3: Shared) -> object:
        return shared_s3.nodes

    return shared_s3, rgw, rgw_nodes


try:
    shared_s3, rgw, rgw_nodes = _fixtures()
except ImportError:  # pytest absent: the gateway itself still works
    pass
