"""Two "nodes" on one machine: network namespaces made with pyroute2, joined by a bridge.

    with Nodes(["node-a", "node-b"]) as nodes:
        subprocess.run(cmd, preexec_fn=nodes.enter("node-b"))   # runs with node-b's network

Each set of nodes is one link, `subnet` (the first three octets of a /24): unless given, one that
no address of this namespace is on is taken as the set is made (`free_subnet`, under a lock, so
sets made at once by several test processes never share one). Two sets are two sites whose nodes
have other addresses, as a job restored on other machines sees. A subnet shared with a link that
is still there (a killed test run's bridge) would send the host's answers out of that link, which
is why none is fixed.

Each node is a network namespace with its own loopback and one end of a veth pair whose other end
is on a bridge in the creating namespace; the bridge holds the host's address on that link, which
a service on the host (the lab's radosgw) listens on, so every node reaches it. Addresses are
IPv4 link-local (169.254.0.0/16, RFC 3927, never routed off a link): the test hosts live in
namespaces this process made, traffic never leaves the machine, and no private (10/8, 172.16/12,
192.168/16) or public address is used. 169.254.169.254 (cloud metadata) is avoided.
Each node gets its own state and image directories from the test, not from here: only the
network is per node (mount, pid and user namespaces are the host's, as on a real node).

A set is recorded in RECORDS (its maker's pid and start time, its bridge and namespaces) before
anything is made and forgotten once all of it is removed. A run killed in between leaves its
record: the next set made sweeps every recorded set whose maker no longer runs (its namespaces,
which take their veth pairs with them, and its bridge), so stale links do not pile up run after run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RECORDS", "Nodes", "free_subnet", "sweep_stale"]

PREFIX = 24
_LOCK = "/run/snapguard-lab-netns.lock"  # held while a set picks its subnet and puts it on its bridge
RECORDS = "/run/snapguard-lab-netns"  # one JSON record per set made and not yet removed


def running_start_ticks(pid: int) -> int | None:
    """When pid started (/proc/PID/stat's field 22, clock ticks since boot) while it runs; None
    when it is gone or a zombie. With the pid, it names one process a reused pid does not share."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold anything
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in (b"Z", b"X") or not fields[19].isdigit():
        return None
    return int(fields[19])


def _remove(bridge: str, namespaces: list[str]) -> None:
    """A set's namespaces (removing one removes its veth end, and so the pair), then its bridge."""
    from pyroute2 import IPRoute, netns

    for ns in reversed(namespaces):
        try:
            netns.remove(ns)
        except OSError:
            pass
    if bridge:
        with IPRoute() as ip:
            found = ip.link_lookup(ifname=bridge)
            if found:
                ip.link("del", index=found[0])


def sweep_stale(records: str = RECORDS) -> list[str]:
    """Remove every recorded set whose maker no longer runs (a killed run's); the tags swept.
    Called with the subnet lock held, as a set is made."""
    swept: list[str] = []
    try:
        names = sorted(os.listdir(records))
    except FileNotFoundError:
        return swept
    for name in names:
        path = os.path.join(records, name)
        try:
            with open(path, encoding="utf-8") as f:
                rec: dict[str, Any] = json.load(f)
            pid, start = int(rec["pid"]), int(rec["start"])
            bridge, namespaces = str(rec["bridge"]), [str(n) for n in rec["namespaces"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a record of ours, or half written: left alone
        if running_start_ticks(pid) == start:
            continue  # its maker still runs: its set is in use
        _remove(bridge, namespaces)
        os.unlink(path)
        swept.append(name.removesuffix(".json"))
    return swept


def _taken() -> set[str]:
    """The /24s (first three octets) that an IPv4 address of this namespace is on."""
    from pyroute2 import IPRoute

    with IPRoute() as ip:
        used = {a.get_attr("IFA_ADDRESS") for a in ip.get_addr(family=socket.AF_INET)}
    return {".".join(str(u).split(".")[:3]) for u in used if u}


def free_subnet(exclude: set[str] | frozenset[str] = frozenset()) -> str:
    """A 169.254.X (X in 20..250, not 169: cloud metadata) that no address of this namespace is on."""
    taken = _taken() | set(exclude)
    free = [f"169.254.{x}" for x in range(20, 251) if x != 169 and f"169.254.{x}" not in taken]
    if not free:
        raise RuntimeError("no free 169.254.X/24 for the nodes' bridge")
    return secrets.choice(free)


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass
class Nodes:
    names: list[str]
    subnet: str = ""  # the link's /24, its first three octets (free_subnet's unless given); the host is .1, node i .(10 + i)
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    addresses: dict[str, str] = field(default_factory=dict)
    bridge: str = ""
    _made: list[str] = field(default_factory=list)

    @property
    def host_address(self) -> str:
        """The host's address on the link (the bridge's); known once the set is made."""
        if not self.subnet:
            raise RuntimeError("the nodes' subnet is chosen when they are made (with Nodes(...) as nodes)")
        return f"{self.subnet}.1"

    def ns(self, name: str) -> str:
        return f"sg-{self.tag}-{name}"

    def _record(self) -> str:
        return os.path.join(RECORDS, f"{self.tag}.json")

    def _write_record(self) -> None:
        os.makedirs(RECORDS, mode=0o700, exist_ok=True)
        rec = {"pid": os.getpid(), "start": running_start_ticks(os.getpid()), "bridge": self.bridge,
               "namespaces": [self.ns(n) for n in self.names]}
        tmp = self._record() + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rec, f)
        os.replace(tmp, self._record())

    def __enter__(self) -> Nodes:
        with _subnet_lock():
            sweep_stale()
            if not self.subnet:
                self.subnet = free_subnet()
            elif self.subnet in _taken():
                raise ValueError(f"subnet {self.subnet} is already on a link of this namespace: the host's answers "
                                 f"would leave by either; leave subnet out to get a free one")
            return self._make()

    def _make(self) -> Nodes:
        from pyroute2 import IPRoute, NetNS, netns

        parts = self.subnet.split(".")
        if len(parts) != 3 or parts[:2] != ["169", "254"] or not parts[2].isdigit() or \
                not 0 < int(parts[2]) < 255 or int(parts[2]) == 169:
            raise ValueError(f"subnet must be 169.254.N (N 1..254, not 169), got {self.subnet!r}")

        self.bridge = f"sgbr{self.tag}"[:15]
        self._write_record()
        try:
            with IPRoute() as ip:
                ip.link("add", ifname=self.bridge, kind="bridge")
                br = ip.link_lookup(ifname=self.bridge)[0]
                ip.addr("add", index=br, address=self.host_address, prefixlen=PREFIX)
                ip.link("set", index=br, state="up")
                for i, name in enumerate(self.names):
                    ns = self.ns(name)
                    netns.create(ns)
                    self._made.append(ns)
                    host_end, node_end = f"sgh{self.tag}{i}"[:15], f"sgn{self.tag}{i}"[:15]
                    ip.link("add", ifname=host_end, kind="veth", peer=node_end)
                    h = ip.link_lookup(ifname=host_end)[0]
                    ip.link("set", index=h, master=br, state="up")
                    n = ip.link_lookup(ifname=node_end)[0]
                    ip.link("set", index=n, net_ns_fd=ns)
                    address = f"{self.subnet}.{10 + i}"
                    with NetNS(ns) as nsip:
                        lo = nsip.link_lookup(ifname="lo")[0]
                        nsip.link("set", index=lo, state="up")
                        idx = nsip.link_lookup(ifname=node_end)[0]
                        nsip.addr("add", index=idx, address=address, prefixlen=PREFIX)
                        nsip.link("set", index=idx, state="up")
                    self.addresses[name] = address
        except BaseException:
            self.__exit__()
            raise
        return self

    def enter(self, name: str) -> Callable[[], None]:
        """A preexec_fn: the child joins the node's network namespace (and nothing else)."""
        path = f"/var/run/netns/{self.ns(name)}"

        def join() -> None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.setns(fd, os.CLONE_NEWNET) if hasattr(os, "setns") else _setns(fd)
            finally:
                os.close(fd)

        return join

    def __exit__(self, *exc: object) -> None:
        _remove(self.bridge, self._made)
        self._made.clear()
        if self.bridge:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._record())


def _setns(fd: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
