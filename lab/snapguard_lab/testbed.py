"""The one containerd harness of the lab and the tests (`Containerd`: a private containerd whose
runc is snapguard-runc, with or without its CRI plugin), the counter workload, its image and its log.

Used by `snapguard-lab drill`, the tests (tests/conftest.py's `containerd` fixture, the CRI lab of
snapguard_lab.cri, `snapguard install` against a real containerd) and the benchmarks: containerd
runs in its own root with its own socket, so nothing of a node's real containerd is touched. The
image is built locally from the counter workload (package data, `workloads/counter`) and the host's
static busybox; nothing is pulled. Bundles of the host's directories are snapguard_lab.bundles, the
ddp job snapguard_lab.ddp.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import snapguard

from . import workloads
from .bundles import RUNC, release_mounts
from .containerd_config import cri_config, plain_config

__all__ = ["COMPAT", "CONTAINERD_UMASK", "COUNTER_IMAGE", "COUNTER_SCRIPT", "Containerd", "CounterLog", "HANDLER",
           "MODULUS", "PAUSE_IMAGE", "STACKS", "SYSTEM_PATH", "Stack", "build_counter_image", "compat_missing",
           "expected_hash", "product_root", "snapguard_runc_path"]

COUNTER_IMAGE = "snapguard.local/counter:1"
BUSYBOX = "/bin/busybox"
CTR = "/usr/bin/ctr"
CONTAINERD = "/usr/bin/containerd"
COUNTER_SCRIPT = workloads.path("counter", "counter.sh")
MODULUS = 1_000_000_007
COMPAT = "/opt/snapguard/compat"  # packaging/install-deps.sh: Debian unstable's containerd and runc
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HANDLER = "snapguard"  # the CRI runtime handler (a RuntimeClass's `handler`)
PAUSE_IMAGE = "snapguard.local/pause:1"  # imported, never pulled: a lab registry does not have it
# containerd runs under systemd's default UMask=0022 on a node; what it creates follows it
CONTAINERD_UMASK = 0o022


@dataclass(frozen=True)
class Stack:
    """A containerd with its ctr, and the real runc that snapguard-runc passes through to."""

    name: str
    containerd: str
    ctr: str
    runc: str
    config_version: int
    bin_dir: str | None = None  # first in containerd's PATH: its shim (containerd-shim-runc-v2) is found there


STACKS = {
    # Debian 12: containerd 1.6.20, runc 1.1.5
    "debian12": Stack("debian12", CONTAINERD, CTR, RUNC, 2),
    # Debian unstable's containerd 2.1.9 and runc 1.3.6 (patched to unstable's glibc), from install-deps.sh
    "compat": Stack("compat", f"{COMPAT}/bin/containerd", f"{COMPAT}/bin/ctr", f"{COMPAT}/bin/runc", 3,
                    bin_dir=f"{COMPAT}/bin"),
}


def snapguard_runc_path() -> str:
    """The installed snapguard-runc: beside this Python, else in /usr/local/bin."""
    found = shutil.which("snapguard-runc", path=os.path.dirname(sys.executable) + os.pathsep + "/usr/local/bin")
    if not found:
        raise RuntimeError("snapguard-runc is not installed next to this Python; run `pip install -e .`")
    return found


def product_root() -> str:
    """The directory snapguard is imported from: a workload started with the take-point hook has it
    on PYTHONPATH, since the hook's sitecustomize imports snapguard inside the workload."""
    return os.path.dirname(os.path.dirname(os.path.abspath(snapguard.__file__)))


def expected_hash(i: int) -> int:
    h = 0
    for k in range(1, i + 1):
        h = (h * 31 + k) % MODULUS
    return h


def _add(tf: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tf.addfile(info, io.BytesIO(data))


def _add_dir(tf: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    tf.addfile(info)


def build_counter_image(out: str, script: Path = COUNTER_SCRIPT) -> str:
    """Write an OCI image layout tarball of the counter workload to `out`; return its name."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w") as tf:
        for d in ("bin", "dev", "proc", "sys", "tmp", "out", "etc"):
            _add_dir(tf, d)
        with open(BUSYBOX, "rb") as f:
            _add(tf, "bin/busybox", f.read(), 0o755)
        for applet in ("sh", "sleep", "echo", "cat"):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tf.addfile(info)
        _add(tf, "counter.sh", script.read_bytes(), 0o755)
    layer = layer_buf.getvalue()

    def digest(b: bytes) -> str:
        return "sha256:" + hashlib.sha256(b).hexdigest()

    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": ["/bin/sh", "/counter.sh"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [digest(layer)]},
    }).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest(layer),
                    "size": len(layer)}],
    }).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest(manifest),
        "size": len(manifest), "annotations": {"io.containerd.image.name": COUNTER_IMAGE,
                                               "org.opencontainers.image.ref.name": COUNTER_IMAGE}}]}).encode()
    with tarfile.open(out, "w") as tf:
        _add(tf, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        _add(tf, "index.json", index)
        for blob in (layer, config, manifest):
            _add(tf, "blobs/sha256/" + digest(blob).split(":")[1], blob)
    return COUNTER_IMAGE


@dataclass
class CounterLog:
    """The counter workload's output file, parsed and checked."""

    path: Path

    def values(self) -> list[tuple[int, int]]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        rows = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and all(p.isdigit() for p in parts):
                rows.append((int(parts[0]), int(parts[1])))
        return rows

    def last(self) -> int:
        rows = self.values()
        return rows[-1][0] if rows else 0

    def wait_for(self, count: int, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.values()) >= count:
                return self.last()
            time.sleep(0.02)
        raise TimeoutError(f"{self.path} has {len(self.values())} lines, waited for {count}")

    def chain_errors(self) -> list[str]:
        """Lines that break the sequence (a gap or repeat) or the hash chain."""
        rows = self.values()
        errors = []
        if rows and rows[0][1] != expected_hash(rows[0][0]):
            errors.append(f"first line {rows[0]} does not carry the hash of 1..{rows[0][0]}")
        for (i0, h0), (i1, h1) in zip(rows, rows[1:]):
            if i1 != i0 + 1 or h1 != (h0 * 31 + i1) % MODULUS:
                errors.append(f"{i0} {h0} -> {i1} {h1}")
        return errors


class Containerd:
    """containerd in its own root under `workdir` with its own socket: `start` it and `stop` it (its
    containers or pods with it), or use it as a context manager.

    - `stack` picks the containerd, ctr and real runc (`STACKS`): "debian12" (the default) or
      "compat". A stack with a bin_dir gets it first in containerd's PATH (its shim is found there),
      and snapguard-runc (which containerd's environment reaches through the shim) `SNAPGUARD_RUNC`
      set to the stack's runc, unless `env` names another.
    - `cri` off (the default): no CRI plugin; ctr works in a namespace of its own per stack and the
      runc of each container is named at `ctr run` (`run_counter`). On: containerd's CRI plugin
      with the runtime handler `HANDLER`, whose runc is `runtime_binary` (snapguard-runc unless
      named) with its root at `runc_root`, images resolved from the http registry at
      `registry_host`; ctr works in CRI's namespace k8s.io, containerd runs with the system's PATH
      (criu for its CheckForCriu and for runc) under systemd's umask, and `stop` first hands the
      socket to `remove_pods` (snapguard_lab.cri.remove_all_pods), then releases every mount left
      under `workdir`.
    - `config`: a config file the caller wrote, used as it is instead of the one `write_config`
      writes; `socket` is then the address it names (workdir/containerd.sock unless given).
    """

    def __init__(self, workdir: str, env: dict[str, str] | None = None, stack: str = "debian12", *,
                 cri: bool = False, config: str | None = None, socket: str | None = None,
                 runtime_binary: str | None = None, registry_host: str | None = None,
                 remove_pods: Callable[[str], None] | None = None,
                 preexec: Callable[[], None] | None = None) -> None:
        self.workdir = Path(workdir)
        self.stack = STACKS[stack]
        self.cri = cri
        self.config = Path(config) if config else None
        self.socket = socket or str(self.workdir / "containerd.sock")
        self.runtime_binary = runtime_binary
        self.registry_host = registry_host
        self.remove_pods = remove_pods
        self.preexec = preexec  # run in containerd's child before exec (netns.Nodes.enter: a node's network)
        stack_env: dict[str, str] = {"PATH": SYSTEM_PATH} if cri else {}
        if self.stack.bin_dir:
            stack_env = {"PATH": f"{self.stack.bin_dir}:{SYSTEM_PATH}", "SNAPGUARD_RUNC": self.stack.runc}
        self.env = {**os.environ, **stack_env, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        # CRI's namespace; else one per stack: runc's root (below) is shared by every containerd on the host
        self.namespace = "k8s.io" if cri else "snapguard" if stack == "debian12" else f"snapguard-{stack}"

    def __enter__(self) -> Containerd:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def runc(self) -> str:
        """The real runc of this stack."""
        return self.stack.runc

    @property
    def bin_dir(self) -> str:
        """The directory of this stack's containerd (and its shim)."""
        return self.stack.bin_dir or os.path.dirname(self.stack.containerd)

    @property
    def runc_root(self) -> str:
        """runc's --root for this containerd's containers: the shim keeps them there."""
        return str(self.workdir / "runc") if self.cri else f"/run/containerd/runc/{self.namespace}"

    @property
    def root(self) -> Path:
        return self.workdir / "root"

    @property
    def state(self) -> Path:
        return self.workdir / "state"

    def write_config(self) -> Path:
        """The config containerd starts with: the caller's, else one written in workdir."""
        if self.config is not None:
            return self.config
        config = self.workdir / "config.toml"
        if self.cri:
            config.write_text(self._cri_config())
            return config
        if self.stack.config_version >= 3:
            (self.workdir / "tmp").mkdir(exist_ok=True)
        config.write_text(plain_config(self.workdir, self.socket, self.stack.config_version))
        return config

    def _cri_config(self) -> str:
        w = self.workdir
        if self.registry_host is None:
            raise ValueError("a CRI containerd needs registry_host")
        for d in ("root", "state", "tmp", "cni", "opt", "runc"):
            (w / d).mkdir(mode=0o700, parents=True, exist_ok=True)
        certs = w / "certs.d" / self.registry_host
        certs.mkdir(parents=True, exist_ok=True)
        # CRI PullImage tries https first: "tls: first record does not look like a TLS handshake"
        (certs / "hosts.toml").write_text(
            f'server = "http://{self.registry_host}"\n'
            f'[host."http://{self.registry_host}"]\n  capabilities = ["pull", "resolve"]\n')
        return cri_config(w, self.socket, self.bin_dir, self.runtime_binary or snapguard_runc_path(), self.runc_root,
                          handler=HANDLER, pause_image=PAUSE_IMAGE)

    def start(self, timeout: float | None = None) -> None:
        for path in (self.stack.containerd, self.stack.ctr, self.stack.runc,
                     *([f"{self.stack.bin_dir}/containerd-shim-runc-v2"] if self.stack.bin_dir else [])):
            if not os.access(path, os.X_OK):
                raise RuntimeError(f"{path} is missing or not executable: run packaging/install-deps.sh")
        self.workdir.mkdir(mode=0o700 if self.cri else 0o777, parents=True, exist_ok=True)
        config = self.write_config()
        log = open(self.workdir / "containerd.log", "ab")
        self.proc = subprocess.Popen([self.stack.containerd, "--config", str(config)], stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, env=self.env, start_new_session=True,
                                     umask=CONTAINERD_UMASK if self.cri else -1, preexec_fn=self.preexec)
        log.close()
        deadline = time.monotonic() + (timeout or (30.0 if self.cri else 20.0))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited {self.proc.returncode}; see {self.workdir}/containerd.log")
            if os.path.exists(self.socket) and self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise TimeoutError(f"containerd did not answer on {self.socket}")

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([self.stack.ctr, "--address", self.socket, "--namespace", self.namespace, *args],
                             capture_output=True, text=True, timeout=timeout, env=self.env, check=False)
        if check and out.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} exited {out.returncode}: {out.stderr.strip()[-2000:]}")
        return out

    def import_image(self, tarball: str) -> None:
        """Import and unpack an OCI layout tarball: nothing is pulled. With CRI on, overlayfs in
        CRI's namespace (what a pod's image needs); else the native snapshotter."""
        # ctr 2.x imports through containerd's transfer service, which unpacks only for the
        # platforms and snapshotters its config names; --local imports as ctr 1.6 does
        local = ["--local"] if self.stack.config_version >= 3 else []
        self.ctr("images", "import", *local, "--snapshotter", "overlayfs" if self.cri else "native", tarball)

    def import_counter_image(self) -> str:
        tarball = self.workdir / "counter-image.tar"
        name = build_counter_image(str(tarball))
        self.import_image(str(tarball))
        return name

    def run_counter(self, container_id: str, out_dir: str, runc_binary: str) -> None:
        """Start the counter detached, its /out bound to out_dir, with runc_binary as the shim's runc."""
        os.makedirs(out_dir, exist_ok=True)
        self.ctr("run", "-d", "--null-io", "--snapshotter", "native", "--runc-binary", runc_binary,
                 "--mount", f"type=bind,src={out_dir},dst=/out,options=rbind:rw",
                 COUNTER_IMAGE, container_id)

    def bundle_dir(self, container_id: str) -> Path:
        return self.workdir / "state" / "io.containerd.runtime.v2.task" / self.namespace / container_id

    def mount_snapshot(self, container_id: str, target: Path) -> None:
        """Bind the container's (native) rootfs snapshot at target."""
        out = self.ctr("snapshots", "--snapshotter", "native", "mounts", str(target), container_id).stdout.split()
        # prints: mount -t bind SRC TARGET -o rbind,rw
        if len(out) < 5 or out[:3] != ["mount", "-t", "bind"]:
            raise RuntimeError(f"unexpected snapshot mount: {' '.join(out)}")
        subprocess.run(["/usr/bin/mount", "--rbind", out[3], str(target)], check=True, capture_output=True)

    def task_status(self, container_id: str) -> str | None:
        for line in self.ctr("tasks", "ls", check=False).stdout.splitlines()[1:]:
            cols = line.split()
            if cols and cols[0] == container_id:
                return cols[-1]
        return None

    def remove(self, container_id: str) -> None:
        """Kill and delete the task and the container; quiet when they are already gone."""
        if self.task_status(container_id) not in (None, "STOPPED"):
            self.ctr("tasks", "kill", "--signal", "SIGKILL", container_id, check=False)
            deadline = time.monotonic() + 10
            while self.task_status(container_id) not in (None, "STOPPED") and time.monotonic() < deadline:
                time.sleep(0.05)
        self.ctr("tasks", "delete", container_id, check=False)
        self.ctr("containers", "delete", container_id, check=False)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join((self.workdir / "containerd.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.cri:
            try:
                if self.remove_pods is not None:
                    self.remove_pods(self.socket)
            except Exception:  # a broken run still stops containerd below
                pass
        else:
            for cid in self.ctr("containers", "ls", "-q", check=False).stdout.split():
                self.remove(cid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self.cri:
            # rootfs and shm mounts of killed pods would otherwise keep the tree from being removed
            release_mounts(self.workdir)
        else:
            # native snapshots and bundles may leave bind mounts behind on a killed run
            subprocess.run(["umount", "-R", "-l", str(self.workdir / "state")], capture_output=True, check=False)


def compat_missing() -> str | None:
    """Why the compat stack (containerd 2.1.9, its shim and ctr, runc 1.3.6) is not here, or None.
    Only its absence: a compat directory with a binary missing or broken fails at start instead."""
    if not os.path.isdir(COMPAT):
        return f"{COMPAT} is absent (packaging/install-deps.sh installs containerd 2.1.9 and runc 1.3.6 there)"
    return None
