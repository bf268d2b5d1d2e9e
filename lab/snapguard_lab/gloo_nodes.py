"""A ddp job (train.py over gloo) spread over the "nodes" of `netns.Nodes`, each node's ranks
launched as torchrun's agent launches them (workloads/ddp/node_launch.py) or by an unmodified
torchrun itself (`start_torchrun`: its elastic agent the node's root), and snapguard run
inside a node's network namespace, as it runs on that node: a checkpoint of the node's tree and a
restore of it into another node (other addresses), through the `snapguard` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from snapguard.takepoint import site_dir

from . import workloads
from .ddp import DdpJob
from .netns import Nodes
from .ports import free_port
from .testbed import product_root

__all__ = ["NODE_LAUNCH", "NodesJob", "TORCHRUN", "restore_on", "snapguard_in"]

NODE_LAUNCH = workloads.path("ddp", "node_launch.py")
TRAIN = workloads.path("ddp", "train.py")
SNAPGUARD = os.path.join(os.path.dirname(sys.executable), "snapguard")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


@dataclass
class NodesJob(DdpJob):
    """The job's ranks spread over nodes; `rows`, `results`, `mismatches` as DdpJob's.
    `step_sleep`: seconds per step outside the math (the reference runs with none: same bits)."""

    step_sleep: float = 0.08

    def start_reference(self) -> subprocess.Popen[bytes]:
        """Every rank on this host (loopback), no hook: the bits a spread run must have; its
        launcher, started (this job's `step_sleep` is ignored: the math is the same)."""
        self.step_sleep = 0.0
        return self.start_node(None, "local", list(range(self.world)), f"127.0.0.1:{_free_port()}", None)

    def start_node(self, nodes: Nodes | None, name: str, ranks: list[int], master: str, take_dir: str | None,
                   node_rank: int = 0) -> subprocess.Popen[bytes]:
        """This node's launcher, in its network namespace (None: this one), its ranks
        rendezvousing at `master`."""
        return self._start(nodes, name, take_dir, [
            sys.executable, str(NODE_LAUNCH), "--ranks", ",".join(map(str, ranks)), "--world", str(self.world),
            "--node-rank", str(node_rank), "--master", master])

    def start_torchrun(self, nodes: Nodes | None, name: str, rendezvous: list[str],
                       take_dir: str | None, nnodes: int = 1) -> subprocess.Popen[bytes]:
        """An unmodified `torchrun --nnodes N --nproc-per-node WORLD/N RENDEZVOUS... train.py` on
        node `name` (its elastic agent the root of the tree); `rendezvous`: torchrun's own
        options (`--master-addr A --master-port P` for its static rendezvous, `--standalone`,
        `--rdzv-backend c10d --rdzv-endpoint A:P --rdzv-id J` for the c10d one of several nodes)."""
        return self._start(nodes, name, take_dir, [
            TORCHRUN, "--nnodes", str(nnodes), "--nproc-per-node", str(self.world // nnodes), *rendezvous, str(TRAIN)])

    def _start(self, nodes: Nodes | None, name: str, take_dir: str | None,
               argv: list[str]) -> subprocess.Popen[bytes]:
        self.out.mkdir(parents=True, exist_ok=True)
        # torchrun gives its workers OMP_NUM_THREADS=1 where it is unset: every launch the same, for the same bits
        env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONWARNINGS": "ignore", "NCCL_NVLS_ENABLE": "0"}
        for key in ("GLOO_SOCKET_IFNAME", "USE_LIBUV", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(key, None)
        if take_dir:
            env["PYTHONPATH"] = os.pathsep.join([site_dir(), product_root()])
            env["SNAPGUARD_TAKE_DIR"] = take_dir
        log = open(self.out / f"launcher-{name}.out", "ab")
        proc = subprocess.Popen([*argv, "--out", str(self.out), "--steps", str(self.steps),
                                 "--step-sleep", str(self.step_sleep)],
                                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                preexec_fn=nodes.enter(name) if nodes is not None else None)
        log.close()
        return proc


def _free_port() -> int:
    return free_port("127.0.0.1")


def snapguard_in(nodes: Nodes, name: str, args: list[str], env: dict[str, str],
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`snapguard ARGS --json` run in node `name`'s network namespace; its record parsed into
    .stdout (a dict) when it printed one."""
    done = subprocess.run([SNAPGUARD, *args, "--json"], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=nodes.enter(name), stdin=subprocess.DEVNULL)
    try:
        done.stdout = json.loads(done.stdout)  # type: ignore[assignment]
    except ValueError:
        pass
    return done


def restore_on(nodes: Nodes, images: dict[str, str], args: list[str], env: dict[str, str]) -> list[dict]:
    """`snapguard restore --images IMAGE ARGS...` on each node of `images` ({node: image dir}) at
    once, as each node's operator would; each must succeed with its tree in that node's network
    namespace (the node's addresses). Their records, in `images`' order."""
    with ThreadPoolExecutor(len(images)) as pool:
        done = list(pool.map(lambda item: snapguard_in(nodes, item[0], ["restore", "--images", item[1], *args], env),
                             images.items()))
    for d, node in zip(done, images):
        assert d.returncode == 0, (node, d.stdout, d.stderr)
        assert os.stat(f"/proc/{d.stdout['pid']}/ns/net").st_ino == os.stat(f"/var/run/netns/{nodes.ns(node)}").st_ino
    return [d.stdout for d in done]
