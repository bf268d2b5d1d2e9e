"""The trainer's process groups, made releasable at the hold: when `torch.distributed` is
imported, `init_process_group` and `new_group` are wrapped so that every group of `gloo` or `nccl`
runs on a backend of the take point's own (`Swappable`, registered with
`torch.distributed.Backend.register_backend` as `sggloo` / `sgnccl`) that delegates each collective
to a replaceable inner ProcessGroupGloo / ProcessGroupNCCL, and so that the rendezvous (env:// or
tcp://, as torchrun's ranks make it) goes through a store the take point owns (`SwapStore`: a
TCPStore inside, the classic server, no libuv and so no io_uring; rank 0 hosts it). In a
torchrun job (TORCHELASTIC_USE_AGENT_STORE=True) the agent, the workers' parent, hosts it: every
rank is a client, and the agent, running the take point's agent side (`agent`), lets go of its
own stores once every rank is done with it, and makes them again first at the release.

At the hold every rank drains (its collectives complete, then a barrier through the store that
every rank of the job passes), shuts its inner groups down, drops them
and then its store: the process holds no TCP connection and no listening socket while the snapshot
is taken. On the release they are rebuilt (`Groups.rebuild`): the store first (rank 0 hosts, the
others connect: at the address the release names, protocol.RENDEZVOUS_WORD, else the one the
job started with), then each inner group on a new key prefix. DDP's reducer and every group the
trainer holds keep their Python objects: only what is inside them is new.

Not reached (the status answer lists each; the executor's preflight refuses such a job, or warns
when --tcp-established carries its connections):
a store the trainer passed itself, an init_method other than env:// and tcp://HOST:PORT, env://
without MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, torchrun's agent store when the agent runs no
take point (or one whose own connections it cannot release: its status says which), and
backends other than gloo and nccl. An NCCL collective run
under CUDA graph capture keeps the groups as they are (the graph replays its communicator).
torch is imported only when the trainer imports torch.distributed.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from datetime import timedelta
from typing import Any

from .. import protocol
from . import agent, agent_link
from .afterimport import AfterImport
from .reach import address as _address
from .reach import agent_store as _agent_store
from .reach import local_address
from .reach import unreached as _unreached

__all__ = ["DIST_MODULE", "GROUPS", "Groups", "InstallOnImport", "install_on", "translate_backend"]

DIST_MODULE = "torch.distributed.distributed_c10d"
KINDS = {"gloo": "sggloo", "nccl": "sgnccl"}
DEVICES = {"gloo": ["cpu"], "nccl": ["cuda"]}
DEFAULT_TIMEOUT = timedelta(minutes=30)
LISTED = 64  # groups, and ranks of each, the status answer lists


def translate_backend(backend: Any) -> tuple[Any, list[str]]:
    """The backend string with gloo and nccl replaced by the take point's (`cpu:gloo,cuda:nccl`
    too), and the parts it leaves (other backends: not reached). None stays None."""
    if backend is None:
        return None, []
    text = str(backend).lower()
    left: list[str] = []
    parts = []
    for part in text.split(","):
        device, _, name = part.rpartition(":")
        if name in KINDS:
            name = KINDS[name]
        elif name not in KINDS.values():
            left.append(name)
        parts.append(f"{device}:{name}" if device else name)
    return ",".join(parts), left


class Groups:
    """The take point's handle on the trainer's store and groups (one per process: GROUPS)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.store: Any = None  # the SwapStore, once init_process_group went through it
        self.groups: list[Any] = []  # the Swappable backends made, in order
        self.unreached: list[str] = []  # what the take point cannot release, one line each
        self.released = False
        self.error: str | None = None  # why the last release or rebuild failed
        self.captured = False  # an NCCL collective ran under CUDA graph capture: the graph holds its communicator

    # -- the status answer ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self.lock:
            # bounded: the executor reads a few KB (the first LISTED groups, each's first LISTED ranks)
            groups = [{protocol.GROUP_BACKEND: g.kind, protocol.GROUP_RANK: g.rank(),
                       protocol.GROUP_SIZE: g.size(), protocol.GROUP_RANKS: g.global_ranks[:LISTED]}
                      for g in self.groups[:LISTED]]
            out: dict[str, Any] = {protocol.GROUP_LIST: groups, protocol.GROUPS_UNREACHED: list(self.unreached[:8]),
                                   protocol.GROUPS_RELEASED: self.released}
            if self.store is not None:
                out[protocol.GROUP_STORE] = {"host": self.store.host, "port": self.store.port,
                                             "hosted": self.store.hosted(),
                                             **({AGENT_FIELD: os.getppid()} if self.store.agent else {})}
            if self.error:
                out[ERROR_FIELD] = self.error
            if self.captured:
                out[protocol.GROUPS_CAPTURED] = True
            return out

    def releasable(self) -> bool:
        return bool(self.groups) and not self.unreached

    # -- the hold ------------------------------------------------------------------------------

    def release(self, timeout_s: float, step: int = 0) -> dict[str, Any] | None:
        """At the hold (at the end of optimizer step `step`, the same on every rank): drain, shut
        down and drop every inner group, then the store. Its figures; None when there is nothing
        to release. A drain that fails leaves everything as it was."""
        if not self.groups or self.released:
            return None
        import time

        if self.captured:  # a graph replays the communicator it captured: a new one would not be it
            self.error = "an NCCL collective was captured in a CUDA graph: its communicator is kept"
            return {"released": False, ERROR_FIELD: self.error}
        t0 = time.monotonic()
        try:
            for g in self.groups:
                g.drain()
            self._barrier(step, timeout_s)
        except Exception as e:
            self.error = f"drain: {type(e).__name__}: {e}"[:300]
            return {"released": False, ERROR_FIELD: self.error}
        for g in self.groups:
            g.drop()
        if self.store is not None:
            self.store.drop()
        gc.collect()
        self.released, self.error = True, None
        agent = self._agent_hold(step, max(timeout_s - (time.monotonic() - t0), 1.0))
        return {"released": True, "groups": len(self.groups), "release_s": round(time.monotonic() - t0, 4),
                **agent}

    def _agent_hold(self, step: int, timeout_s: float) -> dict[str, Any]:
        """torchrun's agent lets go of its stores (after every rank is done with the one it hosts)
        before this rank reports its hold. Its answer's figures; an error leaves its stores as
        they are (the executor then finds its connections and refuses the snapshot)."""
        store = self.store
        if store is None or not store.agent:
            return {}
        try:
            answer = agent_link.ask(store.agent, f"{agent_link.HOLD} {OUT_KEY.format(step)}/all {store.port} "
                                                 f"{timeout_s:.3f}", timeout_s + 2.0)
        except (OSError, ValueError) as e:
            answer = {protocol.OK: False, ERROR_FIELD: f"{type(e).__name__}: {e}"}
        if answer.get(protocol.OK) is not True:
            self.error = f"torchrun's agent did not release its stores: {answer.get(ERROR_FIELD)}"[:300]
            return {ERROR_FIELD: self.error}
        return {"agent": {k: v for k, v in answer.items() if k != protocol.OK}}

    def _barrier(self, step: int, timeout_s: float) -> None:
        """Every rank of the job here, through the store: not a collective of the groups, so a rank
        that is not held (its node's snapguard came late) leaves them as they were, the wait
        timing out here."""
        store = self.store
        if store is None or (store.world <= 1 and not store.agent):
            return
        key = f"snapguard/drain/{step}"
        if store.add(key, 1) == store.world:
            store.set(f"{key}/all", b"1")
        store.wait([f"{key}/all"], timedelta(seconds=max(timeout_s, 1.0)))
        if store.agent:  # the last operation of every rank on the agent's store: the agent then drops it
            if store.add(OUT_KEY.format(step), 1) == store.world:
                store.set(f"{OUT_KEY.format(step)}/all", b"1")

    def rebuild(self, rendezvous: str | None) -> dict[str, Any] | None:
        """After the release: the store (at `rendezvous` HOST:PORT when given), then each group."""
        if not self.released:
            return None
        import time

        t0 = time.monotonic()
        if self.store is not None:
            if self.store.agent:  # the agent's servers first: this rank's store is one of them
                answer = agent_link.ask(self.store.agent, f"{agent_link.REBUILD} {self.store.port}"
                                                          f"{' ' + rendezvous if rendezvous else ''}", 120.0)
                if answer.get(protocol.OK) is not True:
                    raise RuntimeError(f"torchrun's agent did not rebuild its stores: {answer.get(ERROR_FIELD)}")
            if rendezvous:
                self.store.host, self.store.port = protocol.parse_rendezvous(rendezvous)
            self.store.connect()
        for g in self.groups:
            g.configure()
        self.released = False
        return {"rebuilt": True, "rebuild_s": round(time.monotonic() - t0, 4),
                **({"rendezvous": rendezvous} if rendezvous else {})}


ERROR_FIELD = protocol.ERROR
AGENT_FIELD = "agent"  # GROUP_STORE's field: the pid of torchrun's agent, which hosts the store
OUT_KEY = "snapguard/drain/{}/out"  # every rank's last operation on the agent's store at a hold
GROUPS = Groups()


def _classes(dist: Any) -> tuple[type, type]:
    """SwapStore and Swappable, defined once torch.distributed is there (`dist`: torch's c10d
    bindings, torch._C._distributed_c10d: the package itself is still being imported)."""

    class SwapStore(dist.Store):  # type: ignore[misc,name-defined]
        """The rendezvous store every group's keys go through: a TCPStore inside, replaceable."""

        def __init__(self, host: str, port: int, rank: int, world: int, timeout: timedelta,
                     agent: str | None = None) -> None:
            super().__init__()
            self.host, self.port, self.rank, self.world, self.limit = host, port, rank, world, timeout
            self.agent = agent  # torchrun's agent's socket: the agent hosts the store
            self.inner: Any = None
            self.connect()

        def hosted(self) -> bool:
            return self.rank == 0 and not self.agent

        def connect(self) -> None:
            self.inner = dist.TCPStore(self.host, self.port, self.world, is_master=self.hosted(),
                                       timeout=self.limit, wait_for_workers=False, use_libuv=False)

        def drop(self) -> None:
            self.inner = None

        def _store(self) -> Any:
            if self.inner is None:
                raise RuntimeError("snapguard take point: the store is released for a snapshot")
            return self.inner

        def set(self, key: str, value: Any) -> None:
            self._store().set(key, value)

        def get(self, key: str) -> bytes:
            return self._store().get(key)

        def add(self, key: str, value: int) -> int:
            return self._store().add(key, value)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return self._store().compare_set(key, expected, desired)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            if timeout is None:
                self._store().wait(keys)
            else:
                self._store().wait(keys, timeout)

        def check(self, keys: list[str]) -> bool:
            return self._store().check(keys)

        def delete_key(self, key: str) -> bool:
            return self._store().delete_key(key)

        def num_keys(self) -> int:
            return self._store().num_keys()

        def set_timeout(self, timeout: timedelta) -> None:
            self.limit = timeout
            self._store().set_timeout(timeout)

    class Swappable(dist.ProcessGroup):  # type: ignore[misc,name-defined]
        """A backend that delegates each collective to an inner ProcessGroupGloo/NCCL, which the
        hold drops and the release rebuilds on a new key prefix of the same store."""

        def __init__(self, kind: str, opts: Any, pg_options: Any) -> None:
            super().__init__(opts.group_rank, opts.group_size)
            self.kind, self.store, self.timeout = kind, opts.store, opts.timeout or DEFAULT_TIMEOUT
            self.global_ranks = list(opts.global_ranks_in_group or range(opts.group_size))
            self.pg_options, self.gen, self.inner = pg_options, 0, None
            self.configure()

        def configure(self) -> None:
            self.gen += 1
            store = dist.PrefixStore(f"sg{self.gen}/", self.store)
            if self.kind == "gloo":
                ProcessGroupGloo = dist.ProcessGroupGloo
                opts = ProcessGroupGloo._Options()
                opts._timeout = self.timeout
                if os.environ.get("GLOO_SOCKET_IFNAME"):
                    opts._devices = [ProcessGroupGloo.create_default_gloo_device()] \
                        if hasattr(ProcessGroupGloo, "create_default_gloo_device") else \
                        [ProcessGroupGloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"])]
                else:
                    top = GROUPS.store
                    here = local_address(top.host, top.port) if top is not None else ""
                    opts._devices = [ProcessGroupGloo.create_device(hostname=here)] if here else \
                        [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
                self.inner = ProcessGroupGloo(store, self.rank(), self.size(), opts)
            else:
                ProcessGroupNCCL = dist.ProcessGroupNCCL
                opts = self.pg_options if self.pg_options is not None else ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self.inner = ProcessGroupNCCL(store, self.rank(), self.size(), opts)

        def drain(self) -> None:
            """This rank's collectives complete (gloo's are when they return; NCCL's on the stream)."""
            if self.kind == "nccl":
                sys.modules["torch"].cuda.synchronize()

        def drop(self) -> None:
            inner, self.inner = self.inner, None
            if self.kind == "nccl":
                torch = sys.modules["torch"]
                torch.cuda.synchronize()
            for name in ("shutdown", "abort"):
                if hasattr(inner, name):
                    try:
                        getattr(inner, name)()
                        break
                    except Exception:
                        continue
            del inner

        def getBackendName(self) -> str:
            return KINDS[self.kind]

    for op in ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
               "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
               "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "broadcast", "reduce", "gather",
               "scatter", "barrier", "send", "recv", "recv_anysource", "monitored_barrier"):
        def delegate(self: Any, *a: Any, _op: str = op, **k: Any) -> Any:
            if self.inner is None:
                raise RuntimeError("snapguard take point: the process group is released for a snapshot")
            if self.kind == "nccl" and not GROUPS.captured and _capturing():
                GROUPS.captured = True
            return getattr(self.inner, _op)(*a, **k)

        delegate.__name__ = op
        setattr(Swappable, op, delegate)
    return SwapStore, Swappable


class InstallOnImport(AfterImport):
    """Calls `install_on` as soon as torch.distributed.distributed_c10d has executed (before
    torch.distributed's `from .distributed_c10d import *` copies its names)."""

    def __init__(self) -> None:
        super().__init__(DIST_MODULE, install_on, _wrap_failed)


def _default_backend(module: Any) -> str:
    """What torch itself makes of init_process_group(backend=None), as "device:backend" pairs
    (torch 2.13: the accelerator's default backend only, `cpu:gloo` where there is none)."""
    try:
        return str(module.BackendConfig(module.Backend.UNDEFINED))
    except Exception:  # an older torch: its documented default
        return "cpu:gloo,cuda:nccl" if module.is_nccl_available() and sys.modules["torch"].cuda.is_available() \
            else "gloo"


def _wrap_failed(e: Exception) -> None:  # torch's internals moved: the groups stay as torch makes them
    GROUPS.unreached.append(f"the take point could not wrap torch.distributed: {type(e).__name__}: {e}"[:300])


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (never raises)."""
    try:
        return bool(sys.modules["torch"].cuda.is_current_stream_capturing())
    except Exception:
        return False


def install_on(module: Any) -> None:
    """Wrap `module`'s (torch.distributed.distributed_c10d's) init_process_group and new_group,
    and register the take point's backends. Called once that module has executed."""
    import torch._C._distributed_c10d as c10d

    agent.install()  # should this process be torchrun's agent: its side of the hold
    SwapStore, Swappable = _classes(c10d)
    backend_class = module.Backend
    for kind, name in KINDS.items():
        if name.upper() not in getattr(backend_class, "_plugins", {}):
            def create(opts: Any, pg_options: Any, _kind: str = kind) -> Any:
                g = Swappable(_kind, opts, pg_options)
                with GROUPS.lock:
                    GROUPS.groups.append(g)
                return g

            backend_class.register_backend(name, create, extended_api=True, devices=DEVICES[kind])
    original_init, original_new = module.init_process_group, module.new_group

    def init_process_group(backend: Any = None, init_method: str | None = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, store: Any = None, *args: Any, **kwargs: Any) -> Any:
        asked = backend
        why = _unreached(init_method, store, rank, world_size)
        if why is None:
            if backend is None:
                backend = _default_backend(module)
            backend, left = translate_backend(backend)
            if left:
                why = f"backend {', '.join(left)}: only gloo and nccl are released at the hold"
        if why is not None:
            GROUPS.unreached.append(why)
            return original_init(asked, init_method, timeout, world_size, rank, store, *args, **kwargs)
        host, port = _address(init_method)
        rank = rank if rank >= 0 else int(os.environ["RANK"])
        world_size = world_size if world_size > 0 else int(os.environ["WORLD_SIZE"])
        agent = agent_link.parent_agent() if _agent_store() else None
        GROUPS.store = SwapStore(host, port, rank, world_size, timeout or DEFAULT_TIMEOUT, agent)
        return original_init(backend, None, timeout, world_size, rank, GROUPS.store, *args, **kwargs)

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if backend is not None:
            backend, left = translate_backend(backend)
            if left:
                GROUPS.unreached.append(f"new_group backend {', '.join(left)}: not released at the hold")
        return original_new(ranks, timeout, backend, *args, **kwargs)

    init_process_group.__doc__, new_group.__doc__ = original_init.__doc__, original_new.__doc__
    module.init_process_group, module.new_group = init_process_group, new_group
