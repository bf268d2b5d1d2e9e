"""Two Kubernetes "nodes" on one machine for the kubelet's path end to end: one registry (Debian's
docker-registry) and two containerd 2.1.9 with CRI (testbed.Containerd), each with its own root,
state, sockets, runc root, snapguard state directory and network namespace (snapguard_lab.netns:
a veth into a bridge of the test's namespace), both with the runtime handler `snapguard`
(snapguard-runc). No kubelet: snapguard_lab.cri.Cri makes its calls on each node's socket.

The pods are host-network (no CNI): a pod's network is its node's namespace, as on a real node.
The registry listens on the bridge's address (`Nodes.host_address`); in each node a relay
(snapguard_lab.relay) makes it `localhost:<port>` (`TwoNodes.host`), the name every image
reference carries: containerd's CRI restore pulls the checkpoint's base image (config.dump's
rootfsImageRef) with its default resolver, which speaks plain HTTP to localhost alone. Each node
pulls the counter image from the registry as the kubelet would and imports the sandbox image
built from the same layer. `in_node` runs a function with a node's network (the agent's push).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .cri import COMPAT_BIN, COUNTER_REPO, Cri, Registry, lab_images, remove_all_pods
from .netns import Nodes
from .testbed import Containerd

__all__ = ["Node", "TwoNodes"]

T = TypeVar("T")


@dataclass
class Node:
    name: str  # also its network namespace's (TwoNodes.net.ns(name))
    containerd: Containerd
    cri: Cri
    state_dir: Path  # SNAPGUARD_STATE_DIR of this node's snapguard-runc


class TwoNodes:
    """Registry + node "a" and node "b"; `config_file` is SNAPGUARD_CONFIG on both."""

    def __init__(self, workdir: str, config_file: str) -> None:
        self.workdir = Path(workdir)
        self.config_file = config_file
        self.net = Nodes(["a", "b"])  # a free subnet, chosen as the nodes are made
        self.registry: Registry | None = None  # on the nodes' bridge: made with them
        self.nodes: dict[str, Node] = {}
        self.counter_image = ""
        self.counter_digest = ""
        self.host = ""  # localhost:<port>: the registry as every node names it
        self.relays: list[subprocess.Popen[bytes]] = []
        self.store_url = ""  # the image store both nodes use (SNAPGUARD_STORE of their snapguard-runc)

    def start(self) -> TwoNodes:
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.net.__enter__()
        manifest, blobs, pause_tar = lab_images(self.workdir / "images")
        self.registry = Registry(str(self.workdir / "registry"), self.net.host_address)
        self.registry.start()
        self.counter_digest = self.registry.push(COUNTER_REPO, "1", manifest, blobs)
        self.host = f"localhost:{self.registry.port}"
        self.counter_image = f"{self.host}/{COUNTER_REPO}:1"
        store = self.workdir / "store"
        store.mkdir(mode=0o700, exist_ok=True)
        self.store_url = f"file://{store}"
        for name in ("a", "b"):
            relay = subprocess.Popen([sys.executable, "-m", "snapguard_lab.relay", str(self.registry.port),
                                      self.net.host_address, str(self.registry.port)], stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, preexec_fn=self.net.enter(name))
            self.relays.append(relay)
            assert relay.stdout is not None
            if relay.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"the registry relay in node {name} did not start")
            state = self.workdir / f"node-{name}" / "snapguard-state"
            state.mkdir(mode=0o700, parents=True, exist_ok=True)
            ctrd = Containerd(str(self.workdir / f"node-{name}" / "containerd"), {
                "SNAPGUARD_RUNC": f"{COMPAT_BIN}/runc",
                "SNAPGUARD_CONFIG": self.config_file,
                "SNAPGUARD_STATE_DIR": str(state),
                "SNAPGUARD_STORE": self.store_url,
            }, stack="compat", cri=True, registry_host=self.host, remove_pods=remove_all_pods,
                preexec=self.net.enter(name))
            ctrd.start()
            self.nodes[name] = Node(name, ctrd, Cri(ctrd.socket), state)
            ctrd.import_image(pause_tar)
        return self

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def in_node(self, name: str, fn: Callable[[], T]) -> T:
        """fn() in a thread that joined node `name`'s network namespace (the agent on that node)."""
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                self.net.enter(name)()
                out["value"] = fn()
            except BaseException as e:  # handed to the caller's thread
                out["error"] = e

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        try:
            for relay in self.relays:
                relay.kill()
                relay.wait()
            self.relays = []
            for node in self.nodes.values():
                node.cri.close()
                node.containerd.stop()
            self.nodes = {}
            if self.registry is not None:
                self.registry.stop()
        finally:
            self.net.__exit__()
