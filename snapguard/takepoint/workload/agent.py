"""torchrun's elastic agent (the root of an unmodified `torchrun` job's tree) with the take point
in it: made to let go of every TCP connection and listening socket it has while its workers are
held, and to make them again after, at the job's new address after a restore.

The take point becomes the agent's when `torch.distributed.launcher.api` (what torchrun runs) is
imported and a `LaunchConfig` is made. Then:
  stores   every TCPStore the agent makes (the static rendezvous's, whose server its workers use;
           the c10d rendezvous's backend store and the store it shares with its workers) is an
           `AgentStore`: a TCPStore inside (the classic server, no libuv and so no io_uring),
           replaceable. While released, the agent's own use of a store (its monitor loop's
           rendezvous sync, the rendezvous keep-alive) waits for it to come back.
  hold     a worker, at its hold, once its groups and its store are gone, asks the agent (its
           parent) to hold (`agent_link`): the agent waits until every rank of the job is done
           with the store it hosts (a key the last one sets), then drops every store: their
           clients, their servers and the servers' connections. Every worker's request is
           answered after that, so none of them reports the hold before the agent has let go.
  rebuild  a worker, at its release, asks the agent to rebuild first: the servers come back on
           their ports (the one the workers use on the port the release's rendezvous names),
           empty, the clients reconnect; after a restore elsewhere every store moves to the
           rendezvous's node (the c10d rendezvous's backend on its own port), all of them hosted
           by the agent that hosts the workers' store, whichever agent held them before; torchelastic's rendezvous state is made again by its
           next sync. A hold that no worker ends (they are gone) ends by itself after the
           take point's hold limit (HOLD_S_ENV) of running time, as a worker's does.
  CUDA     `LaunchConfig.__post_init__` asks torch.cuda.is_available() to pick default NUMA
           options (none in PyTorch's own builds); that initialises the driver in the agent,
           which then holds /dev/nvidia* with no CUDA context. The agent skips the probe; in
           torchrun's launcher, `--nproc-per-node gpu|auto` is counted in a child (`localsize`).
  trainer  the agent imports torch's optimizers but never steps: its status says it is no
           trainer, so the executor does not wait for it to reach a step.
Not released (its status lists them, and its workers' status then lists them as unreached):
an etcd rendezvous backend's connections.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from .. import protocol
from . import agent_link, env, localsize
from .afterimport import AfterImport

__all__ = ["AGENT", "LAUNCHER_MODULE", "Agent", "activate", "install"]

LAUNCHER_MODULE = "torch.distributed.launcher.api"
ETCD_MODULES = ("torch.distributed.elastic.rendezvous.etcd_rendezvous",
                "torch.distributed.elastic.rendezvous.etcd_rendezvous_backend")
FROZEN_GAP_S = 5.0  # a wait's slice that took longer than this was frozen (a snapshot): not counted


class Agent:
    """The agent's stores and the state of their hold (one per process: AGENT)."""

    def __init__(self) -> None:
        self.active = False  # this process is torchrun's agent
        self.cond = threading.Condition()
        self.stores: list[Any] = []  # the AgentStores made, in order
        self.released = False  # the stores are dropped
        self.holding = False  # a hold is under way (its request waits for the hold key)
        self.rebuilding = False
        self.inflight = 0  # store operations under way
        self.holds = 0
        self.error: str | None = None
        self.figures: dict[str, Any] = {}

    def unreached(self) -> list[str]:
        return [f"torchrun's agent uses {name.rsplit('.', 1)[1]}: its connections are not released at the hold"
                for name in ETCD_MODULES if name in sys.modules]

    def status(self) -> dict[str, Any]:
        with self.cond:
            stores = [{"host": s.host, "port": s.port, "hosted": s.is_master, "released": s.inner is None}
                      for s in self.stores[:16]]
            return {protocol.OK: True, protocol.PID: os.getpid(), "stores": stores, "released": self.released,
                    "holds": self.holds, protocol.GROUPS_UNREACHED: self.unreached(),
                    **({protocol.ERROR: self.error} if self.error else {}), **self.figures}

    # -- the stores' side -----------------------------------------------------------------------

    def add(self, store: Any) -> None:
        with self.cond:
            self.stores.append(store)

    def acquire(self, store: Any) -> Any:
        """The store's TCPStore for one operation, waiting while the hold has it released."""
        with self.cond:
            while store.inner is None:
                self.cond.wait(1.0)
            self.inflight += 1
            return store.inner

    def done(self) -> None:
        with self.cond:
            self.inflight -= 1
            self.cond.notify_all()

    # -- the hold -------------------------------------------------------------------------------

    def hold(self, key: str, port: int, timeout_s: float) -> dict[str, Any]:
        """Drop every store, once every rank of the job is done with the one hosted at `port`
        (when this agent hosts it: `key` set). Each worker's request returns the same outcome."""
        deadline = time.monotonic() + max(timeout_s, 1.0)
        with self.cond:
            while self.holding and time.monotonic() < deadline:
                self.cond.wait(0.2)
            if self.released:
                return {protocol.OK: True, **self.figures}
            self.holding = True
        t0 = time.monotonic()
        try:
            hosted = [s for s in self.stores if s.is_master and s.port == port and s.inner is not None]
            if hosted:  # the workers' store: every rank of the job has passed its last operation on it
                hosted[0].inner.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.5)))
            with self.cond:
                old = [(s, s.inner) for s in self.stores]
                for s in self.stores:
                    s.inner = None
                while self.inflight and time.monotonic() < deadline:
                    self.cond.wait(0.05)
                busy = self.inflight
                self.released, self.holds = True, self.holds + 1
            # clients first, then the servers (their connections closed with them)
            old.sort(key=lambda pair: pair[0].is_master)
            while old:
                old.pop(0)
            gc.collect()
            if busy:
                self.error = f"{busy} store operation(s) of the agent still under way at the hold"
            else:
                self.error = None
            self.figures = {"agent_release_s": round(time.monotonic() - t0, 4)}
            threading.Thread(target=self._limit, args=(self.holds,), name="snapguard-agent-hold",
                             daemon=True).start()
            return {protocol.OK: not busy, **({protocol.ERROR: self.error} if busy else {}), **self.figures}
        except Exception as e:
            self.error = f"hold: {type(e).__name__}: {e}"[:300]
            return {protocol.OK: False, protocol.ERROR: self.error}
        finally:
            with self.cond:
                self.holding = False
                self.cond.notify_all()

    def rebuild(self, port: int, rendezvous: str | None) -> dict[str, Any]:
        """The stores made again: the servers first (the one at `port` on the rendezvous's port
        when one is named), then the clients, in the background (their server may be another
        node's agent, not yet back)."""
        with self.cond:
            while self.rebuilding:
                self.cond.wait(0.2)
            if not self.released:
                return {protocol.OK: True}
            self.rebuilding = True
        t0 = time.monotonic()
        moved: tuple[str, int] | None = protocol.parse_rendezvous(rendezvous) if rendezvous else None
        try:
            if moved is not None:
                # after a restore elsewhere every store of the job is on the rendezvous's node: the
                # workers' (at `port`) on the port it names, the others (the c10d rendezvous's
                # backend, at --rdzv-endpoint) on their own ports, all hosted by the agent that
                # hosts the workers' store (they come back empty: which agent held one before does
                # not matter), the other agents their clients
                hosts_workers = any(s.is_master and s.port == port for s in self.stores)
                for s in self.stores:
                    if s.port == port:
                        s.host, s.port = moved
                    else:
                        s.host, s.is_master = moved[0], hosts_workers
            for s in [s for s in self.stores if s.is_master]:
                s.connect()
            clients = [s for s in self.stores if not s.is_master]
            if clients:
                threading.Thread(target=self._connect_all, args=(clients,), name="snapguard-agent-rebuild",
                                 daemon=True).start()
            with self.cond:
                self.released = False
                self.cond.notify_all()
            self.figures = {**self.figures, "agent_rebuild_s": round(time.monotonic() - t0, 4)}
            return {protocol.OK: True, **self.figures}
        except Exception as e:
            self.error = f"rebuild: {type(e).__name__}: {e}"[:300]
            return {protocol.OK: False, protocol.ERROR: self.error}
        finally:
            with self.cond:
                self.rebuilding = False
                self.cond.notify_all()

    def _connect_all(self, clients: list[Any]) -> None:
        for s in clients:
            try:
                s.connect()
            except Exception as e:  # its operations keep waiting; the status says why
                self.error = f"rebuild {s.host}:{s.port}: {type(e).__name__}: {e}"[:300]
        with self.cond:
            self.cond.notify_all()

    def _limit(self, hold: int) -> None:
        """A hold no worker ends (they are gone, or their executor is) ends by itself after
        env.HOLD_S of running time (a slice that took far longer was a freeze: not counted)."""
        ran, last = 0.0, time.monotonic()
        limit = env.HOLD_S + 30.0
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            ran += now - last if now - last < FROZEN_GAP_S else 0.0
            last = now
            with self.cond:
                if not self.released or self.holds != hold:
                    return
            if ran > limit:
                self.rebuild(-1, None)
                return


AGENT = Agent()


def _store_class(c10d: Any) -> type:
    class AgentStore(c10d.Store):  # type: ignore[misc,name-defined]
        """What the agent gets for a TCPStore: one inside (classic server), dropped at the hold."""

        def __init__(self, host_name: str, port: int = 29500, world_size: int | None = None, is_master: bool = False,
                     timeout: timedelta = timedelta(seconds=300), wait_for_workers: bool = True,
                     multi_tenant: bool = False, master_listen_fd: int | None = None, use_libuv: bool = True) -> None:
            super().__init__()
            self.host, self.is_master, self.world, self.limit = host_name, is_master, world_size, timeout
            self.multi_tenant = multi_tenant
            super().set_timeout(timeout)
            self.inner: Any = c10d.TCPStore(host_name, port, world_size, is_master, timeout, wait_for_workers,
                                            multi_tenant, master_listen_fd, use_libuv=False)
            self.port = int(self.inner.port)  # the one bound when 0 was asked
            AGENT.add(self)

        def connect(self) -> None:
            self.inner = c10d.TCPStore(self.host, self.port, self.world, self.is_master, self.limit, False,
                                       self.multi_tenant, None, use_libuv=False)
            with AGENT.cond:
                AGENT.cond.notify_all()

        @property
        def libuvBackend(self) -> bool:
            return False

        def _call(self, name: str, *args: Any) -> Any:
            inner = AGENT.acquire(self)
            try:
                return getattr(inner, name)(*args)
            finally:
                AGENT.done()

        def set(self, key: str, value: Any) -> None:
            self._call("set", key, value)

        def get(self, key: str) -> bytes:
            return self._call("get", key)

        def add(self, key: str, value: int) -> int:
            return self._call("add", key, value)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return self._call("compare_set", key, expected, desired)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            # PrefixStore's set_timeout reaches the C++ base's timeout, not this class's method
            self._call("wait", keys, self.timeout if timeout is None else timeout)

        def check(self, keys: list[str]) -> bool:
            return self._call("check", keys)

        def delete_key(self, key: str) -> bool:
            return self._call("delete_key", key)

        def num_keys(self) -> int:
            return self._call("num_keys")

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return self._call("multi_get", keys)

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            self._call("multi_set", keys, values)

        def append(self, key: str, value: Any) -> None:
            self._call("append", key, value)

        def set_timeout(self, timeout: timedelta) -> None:
            self.limit = timeout
            super().set_timeout(timeout)
            self._call("set_timeout", timeout)

    return AgentStore


def _skip_cuda_probe(config_class: Any) -> None:
    """LaunchConfig.__post_init__ without its torch.cuda.is_available() (asked only while
    numa_options is None, to pick the default ones): while it runs, torch.cuda.is_available
    answers False, so numa_options stays None, as where no GPU is, whatever the order of its test."""
    original = config_class.__post_init__
    if getattr(original, "_snapguard", False):
        return

    def __post_init__(self: Any) -> None:
        become_agent()
        cuda = getattr(sys.modules.get("torch"), "cuda", None)
        if cuda is None or getattr(self, "numa_options", None) is not None:
            original(self)
            return
        probe = cuda.is_available
        cuda.is_available = lambda: False
        try:
            original(self)
        finally:
            cuda.is_available = probe

    __post_init__._snapguard = True  # type: ignore[attr-defined]
    config_class.__post_init__ = __post_init__


def become_agent() -> None:
    """This process launches an elastic agent (it made a LaunchConfig): it is no trainer, and
    its workers reach it on its socket."""
    with AGENT.cond:
        if AGENT.active:
            return
        AGENT.active = True
    take_dir = os.environ.get(protocol.TAKE_DIR_ENV, "")
    if take_dir:
        threading.Thread(target=serve, args=(agent_link.agent_socket(take_dir, os.getpid()),),
                         name="snapguard-agent", daemon=True).start()


def activate(launcher: Any) -> None:
    """torch.distributed.launcher.api has executed (`launcher`): the TCPStores torch.distributed's
    elastic modules make from here on are AgentStores, and a LaunchConfig made makes this process
    the agent (`become_agent`; where torch has no LaunchConfig, importing the launcher does)."""
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    if localsize.launcher_process():
        localsize.answer_apart(sys.modules["torch"])
    if getattr(dist.TCPStore, "_snapguard", False):
        return
    AgentStore = _store_class(c10d)
    AgentStore._snapguard = True  # type: ignore[attr-defined]
    dist.TCPStore = AgentStore  # what torch.distributed.elastic makes from here on
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed.elastic.") and getattr(module, "TCPStore", None) is c10d.TCPStore:
            module.TCPStore = AgentStore
    if hasattr(launcher, "LaunchConfig"):
        _skip_cuda_probe(launcher.LaunchConfig)
    else:
        become_agent()


class ActivateOnImport(AfterImport):
    """Calls `activate` once torch.distributed.launcher.api has executed."""

    def __init__(self) -> None:
        super().__init__(LAUNCHER_MODULE, activate, _activate_failed)


def _activate_failed(e: Exception) -> None:  # torch's internals moved: the agent stays as torch makes it
    AGENT.error = f"the take point could not wrap torchrun's agent: {type(e).__name__}: {e}"[:300]


def install() -> None:
    """The agent side, should this process turn out to be torchrun's agent."""
    if LAUNCHER_MODULE in sys.modules:
        activate(sys.modules[LAUNCHER_MODULE])
    elif not any(isinstance(f, ActivateOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, ActivateOnImport())


def _answer(words: list[str]) -> dict[str, Any]:
    try:
        if words[0] == agent_link.STATUS:
            return AGENT.status()
        if words[0] == agent_link.HOLD and len(words) == 4:
            return AGENT.hold(words[1], int(words[2]), float(words[3]))
        if words[0] == agent_link.REBUILD and len(words) in (2, 3):
            moved = protocol.release_rendezvous([agent_link.REBUILD, protocol.RENDEZVOUS_WORD, words[2]]) \
                if len(words) == 3 else None
            return AGENT.rebuild(int(words[1]), moved)
    except ValueError as e:
        return {protocol.OK: False, protocol.ERROR: f"bad request: {e}"[:200]}
    return {protocol.OK: False, protocol.ERROR: f"unknown request {words[0][:40]!r}"}


def _handle(conn: socket.socket) -> None:
    with conn:
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            uid = int.from_bytes(creds[4:8], sys.byteorder)
            if uid not in (os.getuid(), 0):
                return
            words = agent_link.read_line(conn)
            if not words:
                return
            conn.settimeout(10.0)
            conn.sendall((json.dumps(_answer(words)) + "\n").encode())
        except OSError:
            pass


def serve(path: str) -> None:
    """Listen on `path` (0600); each connection's request answered in a thread of its own (a
    hold's request waits for the job's other ranks)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if os.path.exists(path):
            os.unlink(path)
        srv.bind(path)
        os.chmod(path, 0o600)
        srv.listen(64)
    except OSError as e:
        AGENT.error = f"the agent's socket {path}: {e}"[:300]
        srv.close()
        return
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_handle, args=(conn,), name="snapguard-agent-request", daemon=True).start()
