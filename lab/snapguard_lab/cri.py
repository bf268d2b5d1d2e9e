"""The kubelet's checkpoint path without a kubelet: a private containerd 2.x with its CRI plugin and
a runtime handler `snapguard` whose BinaryName is snapguard-runc (testbed.Containerd with CRI on),
a local registry, and a CRI client.

What a node runs, in a tmp dir: containerd 2.1.9 (the "compat" stack under /opt/snapguard/compat/bin,
packaging/install-deps.sh) with its own root, state, sockets and runc root, config version 3; its
runc v2 shim runs snapguard-runc, which passes every verb to runc 1.3.6 but checkpoint and restore.
containerd passes its environment to the shim and so to snapguard-runc: SNAPGUARD_RUNC,
SNAPGUARD_CONFIG (a file the caller rewrites to change what the executor sees) and
SNAPGUARD_STATE_DIR are set on containerd.

A CRI restore pulls the checkpoint's base image by NAME@DIGEST even when it is local, so a registry
must answer: Debian's docker-registry (distribution 2.8.2) on 127.0.0.1:<free port>, to which the
counter image (testbed.build_counter_image: the lab's counter workload and the host's busybox) is
pushed through the registry's HTTP API; CRI PullImage then records its repo digest. The sandbox
(pause) image is built from the same layer and imported, never pulled. Host-network pods need no CNI.

The CRI client is grpcio on stubs compiled from Kubernetes' published api.proto (cri-api v0.32.3,
the version containerd 2.1.9 vendors; package data in proto/) at the first use in a process, into a
temporary directory, with the grpcio-tools of this environment: generated code must match the
protobuf runtime it runs on (protobuf checks its gencode version at import), which a build-time
compile would not guarantee once either is upgraded, and the compile takes a fraction of a second.

The facts behind the configuration (each observed on containerd 2.1.9, shared/recipes/cri-checkpoint.sh):
CRI PullImage tries https first (hosts.toml with an http server); the pause spec's oomScoreAdj needs
CAP_SYS_RESOURCE (restrict_oom_score_adj); containerd's CheckForCriu and runc find `criu` on PATH;
the shim is found on PATH unless runtime_path is set; the shim's default runc root is shared with a
system containerd (options.Root); a host-network sandbox must not set a hostname.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from types import ModuleType
from typing import Any

from .ports import free_port
from .testbed import COMPAT, HANDLER, PAUSE_IMAGE, Containerd, build_counter_image, expected_hash

__all__ = ["COUNTER_REPO", "CounterRows", "Cri", "CriLab", "Registry", "api", "counter_rows", "remove_all_pods", "tampered_archive"]

COMPAT_BIN = f"{COMPAT}/bin"
REGISTRY_BIN = "/usr/bin/docker-registry"
PROTO_FILE = "cri-api-v0.32.3-api.proto"
COUNTER_REPO = "snapguard/counter"
NODE, POD, CONTAINER = 2, 0, 1  # runtime.v1.NamespaceMode
_PAUSE_CMD = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"]
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"

_api: tuple[ModuleType, ModuleType] | None = None


def _free_port(address: str = "127.0.0.1") -> int:
    return free_port(address)


def _digest(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


# ---------------------------------------------------------------- the CRI API, compiled at run time

def api() -> tuple[ModuleType, ModuleType]:
    """(messages, services) of CRI runtime.v1, compiled from the packaged api.proto once per process."""
    global _api
    if _api is None:
        from grpc_tools import protoc

        text = files("snapguard_lab").joinpath("proto", PROTO_FILE).read_text("utf-8")
        out = tempfile.mkdtemp(prefix="snapguard-cri-api-")
        try:
            # a module name protoc can derive (the packaged name has dashes and dots)
            src = os.path.join(out, "snapguard_cri_v1.proto")
            with open(src, "w", encoding="utf-8") as f:
                f.write(text)
            rc = protoc.main(["grpc_tools.protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}",
                              src])
            if rc != 0:
                raise RuntimeError(f"grpc_tools.protoc could not compile {PROTO_FILE} (exit {rc})")
            loaded = []
            for mod in ("snapguard_cri_v1_pb2", "snapguard_cri_v1_pb2_grpc"):
                spec = importlib.util.spec_from_file_location(mod, os.path.join(out, mod + ".py"))
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod] = module  # the services module imports the messages module by name
                spec.loader.exec_module(module)
                loaded.append(module)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        _api = (loaded[0], loaded[1])
    return _api


class Cri:
    """A CRI client on containerd's socket, making the calls (and the fields) the kubelet makes."""

    def __init__(self, socket_path: str) -> None:
        import grpc

        self.pb, services = api()
        self.channel = grpc.insecure_channel("unix://" + socket_path,
                                             options=[("grpc.max_receive_message_length", 64 << 20)])
        self.runtime = services.RuntimeServiceStub(self.channel)
        self.images = services.ImageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def version(self) -> Any:
        return self.runtime.Version(self.pb.VersionRequest(), timeout=10)

    def pull(self, image: str, timeout: float = 120) -> str:
        """PullImage: the image ref containerd records (a pulled image has its repo digest)."""
        return str(self.images.PullImage(self.pb.PullImageRequest(image=self.pb.ImageSpec(image=image)),
                                         timeout=timeout).image_ref)

    def sandbox_config(self, name: str, namespace: str, uid: str, log_directory: str) -> Any:
        """A host-network pod's sandbox config (no CNI); no hostname: runc refuses one without a
        private UTS namespace."""
        pb = self.pb
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
            log_directory=log_directory,
            labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace,
                    "io.kubernetes.pod.uid": uid},
            linux=pb.LinuxPodSandboxConfig(security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=NODE, pid=CONTAINER, ipc=POD))))

    def run_sandbox(self, config: Any, timeout: float = 60) -> str:
        return str(self.runtime.RunPodSandbox(self.pb.RunPodSandboxRequest(config=config, runtime_handler=HANDLER),
                                              timeout=timeout).pod_sandbox_id)

    def container_config(self, name: str, image: str, sandbox: Any, attempt: int = 0) -> Any:
        """The kubelet's container config for a hostNetwork pod (pid CONTAINER, ipc POD, network NODE);
        the image's own command. `image` may be a checkpoint archive: containerd then restores."""
        pb = self.pb
        meta = sandbox.metadata
        return pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name, attempt=attempt),
            image=pb.ImageSpec(image=image),
            log_path=f"{name}/{attempt}.log",
            labels={"io.kubernetes.container.name": name, "io.kubernetes.pod.name": meta.name,
                    "io.kubernetes.pod.namespace": meta.namespace, "io.kubernetes.pod.uid": meta.uid},
            linux=pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(
                namespace_options=pb.NamespaceOption(network=NODE, pid=CONTAINER, ipc=POD))))

    def create(self, sandbox_id: str, sandbox: Any, config: Any, timeout: float = 120) -> str:
        return str(self.runtime.CreateContainer(self.pb.CreateContainerRequest(
            pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox), timeout=timeout).container_id)

    def start(self, container_id: str, timeout: float = 120) -> None:
        self.runtime.StartContainer(self.pb.StartContainerRequest(container_id=container_id), timeout=timeout)

    def status(self, container_id: str) -> Any:
        return self.runtime.ContainerStatus(self.pb.ContainerStatusRequest(container_id=container_id),
                                            timeout=10).status

    def state(self, container_id: str) -> str:
        return str(self.pb.ContainerState.Name(self.status(container_id).state))

    def checkpoint(self, container_id: str, location: str, timeout_s: int = 60) -> None:
        """CheckpointContainer as the kubelet sends it: id, archive location, timeout; the kubelet's
        CRI client bounds the call by the same timeout (containerd itself ignores the field)."""
        self.runtime.CheckpointContainer(self.pb.CheckpointContainerRequest(
            container_id=container_id, location=location, timeout=timeout_s), timeout=timeout_s)

    def exec_sync(self, container_id: str, cmd: list[str], timeout_s: int = 10) -> bytes:
        r = self.runtime.ExecSync(self.pb.ExecSyncRequest(container_id=container_id, cmd=cmd, timeout=timeout_s),
                                  timeout=timeout_s + 10)
        if r.exit_code != 0:
            raise RuntimeError(f"exec {cmd} in {container_id[:13]} exited {r.exit_code}: {r.stderr[-500:]!r}")
        return bytes(r.stdout)

    def stop_and_remove(self, container_id: str) -> None:
        self.runtime.StopContainer(self.pb.StopContainerRequest(container_id=container_id, timeout=0), timeout=60)
        self.runtime.RemoveContainer(self.pb.RemoveContainerRequest(container_id=container_id), timeout=60)

    def start_refused(self, container_id: str) -> str:
        """StartContainer of a container whose start must fail: the one-line message the CRI
        caller (the kubelet) gets; the container is then not running, and is removed."""
        import grpc

        try:
            try:
                self.start(container_id)
            except grpc.RpcError as e:
                message = str(e.details())
            else:
                raise AssertionError(f"container {container_id[:13]} started; its start was to be refused")
            assert "\n" not in message, message
            assert self.state(container_id) != "CONTAINER_RUNNING"
            return message
        finally:
            self.stop_and_remove(container_id)

    def remove_all_sandboxes(self) -> None:
        for s in self.runtime.ListPodSandbox(self.pb.ListPodSandboxRequest(), timeout=10).items:
            self.runtime.StopPodSandbox(self.pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=60)
            self.runtime.RemovePodSandbox(self.pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=60)


# ---------------------------------------------------------------- the counter's rows

@dataclass
class CounterRows:
    """The counter workload's lines (`i h`, h the hash chain over 1..i), parsed and checked."""

    rows: list[tuple[int, int]] = field(default_factory=list)

    def last(self) -> int:
        return self.rows[-1][0] if self.rows else 0

    def chain_errors(self) -> list[str]:
        rows, errors = self.rows, []
        if rows and rows[0] != (rows[0][0], expected_hash(rows[0][0])):
            errors.append(f"first line {rows[0]} does not carry the hash of 1..{rows[0][0]}")
        for (i0, h0), (i1, h1) in zip(rows, rows[1:]):
            if i1 != i0 + 1 or h1 != (h0 * 31 + i1) % 1_000_000_007:
                errors.append(f"{i0} {h0} -> {i1} {h1}")
        return errors


def counter_rows(text: str) -> CounterRows:
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            rows.append((int(parts[0]), int(parts[1])))
    return CounterRows(rows)


# ---------------------------------------------------------------- images

def _image_blobs(layer: bytes, cmd: list[str]) -> tuple[bytes, bytes]:
    """(config, manifest) of a one-layer amd64 image (uncompressed OCI layer)."""
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Cmd": cmd, "Env": ["PATH=/bin"], "WorkingDir": "/"},
                         "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]}}, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": MT_MANIFEST,
        "config": {"mediaType": MT_CONFIG, "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": _digest(layer),
                    "size": len(layer)}]}, sort_keys=True).encode()
    return config, manifest


def _read_layout(tarball: str) -> tuple[bytes, dict[str, bytes]]:
    """(manifest, {digest: blob}) of a one-image OCI layout tarball."""
    blobs: dict[str, bytes] = {}
    with tarfile.open(tarball) as tf:
        index = json.load(tf.extractfile("index.json"))  # type: ignore[arg-type]
        for m in tf.getmembers():
            if m.isfile() and m.name.startswith("blobs/sha256/"):
                blobs["sha256:" + m.name.rsplit("/", 1)[1]] = tf.extractfile(m).read()  # type: ignore[union-attr]
    return blobs[index["manifests"][0]["digest"]], blobs


def _write_layout(out: str, name: str, manifest: bytes, blobs: list[bytes]) -> None:
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": MT_MANIFEST, "digest": _digest(manifest), "size": len(manifest),
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name}}]}).encode()
    with tarfile.open(out, "w") as tf:
        for member, data in [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)] + \
                [("blobs/sha256/" + _digest(b).split(":")[1], b) for b in [manifest, *blobs]]:
            info = tarfile.TarInfo(member)
            info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------- the registry

class Registry:
    """Debian's docker-registry (distribution 2.8.2) on 127.0.0.1:<free port>, storage under workdir;
    on `address` instead where given (a bridge address network namespaces reach: netns.Nodes.host_address)."""

    def __init__(self, workdir: str, address: str = "127.0.0.1") -> None:
        self.workdir = Path(workdir)
        self.address = address
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"localhost:{self.port}" if self.address == "127.0.0.1" else f"{self.address}:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        if not os.access(REGISTRY_BIN, os.X_OK):
            raise RuntimeError(f"{REGISTRY_BIN} is missing: apt-get install docker-registry "
                               "(packaging/install-deps.sh's RUNTIME_PKGS)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port(self.address)
        config = self.workdir / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.workdir}/data\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.address}:{self.port}\n"
        )
        log = open(self.workdir / "registry.log", "ab")
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited {self.proc.returncode}; see {self.workdir}/registry.log")
            try:
                with urllib.request.urlopen(f"http://{self.address}:{self.port}/v2/", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"docker-registry did not answer on {self.address}:{self.port}")

    def _request(self, method: str, url: str, data: bytes | None = None,
                 headers: dict[str, str] | None = None) -> Any:
        if not url.startswith("http"):
            url = f"http://{self.address}:{self.port}{url}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        return urllib.request.urlopen(req, timeout=30)

    def push(self, repo: str, tag: str, manifest: bytes, blobs: dict[str, bytes]) -> str:
        """Push the manifest's config and layers, then the manifest; its digest (NAME@DIGEST)."""
        wanted = json.loads(manifest)
        for desc in [wanted["config"], *wanted["layers"]]:
            dg = desc["digest"]
            try:
                self._request("HEAD", f"/v2/{repo}/blobs/{dg}").close()
                continue
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
            with self._request("POST", f"/v2/{repo}/blobs/uploads/", b"") as r:
                location = r.headers["Location"]
            sep = "&" if "?" in location else "?"
            self._request("PUT", f"{location}{sep}digest={dg}", blobs[dg],
                          {"Content-Type": "application/octet-stream"}).close()
        with self._request("PUT", f"/v2/{repo}/manifests/{tag}", manifest,
                           {"Content-Type": wanted.get("mediaType", MT_MANIFEST)}) as r:
            digest = r.headers.get("Docker-Content-Digest") or _digest(manifest)
        if digest != _digest(manifest):
            raise RuntimeError(f"the registry stored {repo}:{tag} as {digest}, pushed {_digest(manifest)}")
        return str(digest)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def tampered_archive(archive: bytes, out: str | Path) -> str:
    """A copy at `out` of the checkpoint archive (tar) `archive` with one bit flipped in the
    middle of its largest page file, every header as it was (as an attacker who rebuilds the
    image with consistent digests makes it); that file's name in the archive."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as src, tarfile.open(out, "w") as dst:
        members = src.getmembers()
        pages = max((m for m in members if m.name.startswith("checkpoint/pages-")), key=lambda m: m.size)
        for m in members:
            f = src.extractfile(m) if m.isfile() else None
            body = f.read() if f is not None else None
            if m.name == pages.name:
                flipped = bytearray(body or b"")
                flipped[len(flipped) // 2] ^= 0x01
                body = bytes(flipped)
            dst.addfile(m, io.BytesIO(body) if body is not None else None)
    return pages.name


def lab_images(images: Path) -> tuple[bytes, dict[str, bytes], str]:
    """The counter image's (manifest, blobs) for the registry, and the pause image as an OCI
    layout tarball under `images` (imported, never pulled), built from the counter's layer."""
    images.mkdir(mode=0o700, parents=True, exist_ok=True)
    counter_tar = str(images / "counter.tar")
    build_counter_image(counter_tar)
    manifest, blobs = _read_layout(counter_tar)
    layer = blobs[json.loads(manifest)["layers"][0]["digest"]]
    pause_config, pause_manifest = _image_blobs(layer, _PAUSE_CMD)
    pause_tar = str(images / "pause.tar")
    _write_layout(pause_tar, PAUSE_IMAGE, pause_manifest, [pause_config, layer])
    return manifest, blobs, pause_tar


def wait_rows(cri: Cri, container_id: str, count: int, timeout: float = 20.0) -> CounterRows:
    """The counter's /out/counter.log once it has `count` lines (AssertionError past `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = counter_rows(cri.exec_sync(container_id, ["cat", "/out/counter.log"]).decode())
        if len(rows.rows) >= count or time.monotonic() > deadline:
            assert len(rows.rows) >= count, f"{container_id[:13]}: {len(rows.rows)} lines, waited for {count}"
            return rows
        time.sleep(0.1)


def remove_all_pods(socket: str) -> None:
    """Stop and remove every pod sandbox on the CRI socket (testbed.Containerd's `remove_pods`)."""
    cri = Cri(socket)
    try:
        cri.remove_all_sandboxes()
    finally:
        cri.close()


# ---------------------------------------------------------------- the whole lab

class CriLab:
    """Registry + containerd (CRI, handler `snapguard`) + images: what the kubelet path test needs.

    `config_file` is SNAPGUARD_CONFIG for every snapguard-runc the shim runs; the caller rewrites it
    (a missing criu, say) to change what the executor sees.
    """

    def __init__(self, workdir: str, config_file: str) -> None:
        self.workdir = Path(workdir)
        self.config_file = config_file
        self.state_dir = self.workdir / "snapguard-state"
        self.registry = Registry(str(self.workdir / "registry"))
        self.containerd: Containerd | None = None
        self.cri: Cri | None = None
        self.counter_image = ""  # NAME:TAG in the registry
        self.counter_digest = ""

    def start(self) -> CriLab:
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.state_dir.mkdir(mode=0o700, exist_ok=True)
        manifest, blobs, pause_tar = lab_images(self.workdir / "images")
        self.registry.start()
        self.counter_digest = self.registry.push(COUNTER_REPO, "1", manifest, blobs)
        self.counter_image = f"{self.registry.host}/{COUNTER_REPO}:1"
        self.containerd = Containerd(str(self.workdir / "containerd"), {
            "SNAPGUARD_RUNC": f"{COMPAT_BIN}/runc",
            "SNAPGUARD_CONFIG": self.config_file,
            "SNAPGUARD_STATE_DIR": str(self.state_dir),
        }, stack="compat", cri=True, registry_host=self.registry.host, remove_pods=remove_all_pods)
        self.containerd.start()
        self.containerd.import_image(pause_tar)
        self.cri = Cri(self.containerd.socket)
        return self

    def stop(self) -> None:
        if self.cri is not None:
            self.cri.close()
            self.cri = None
        if self.containerd is not None:
            self.containerd.stop()
        self.registry.stop()
