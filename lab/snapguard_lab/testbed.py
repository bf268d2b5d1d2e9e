"""A private containerd whose runc is snapguard-runc, the counter workload image, and runc
bundles whose rootfs is bind mounts of the host's own directories.

Used by `snapguard-lab drill`, the tests and the benchmarks: containerd runs in its own root with
its own socket, so nothing of a node's real containerd is touched. The image is built locally from
the counter workload (package data, `workloads/counter`) and the host's static busybox; nothing is
pulled.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import snapguard
from snapguard.hooks import site_dir

from . import workloads

__all__ = ["COMPAT", "COUNTER_IMAGE", "COUNTER_SCRIPT", "Containerd", "CounterLog", "DDP_LAUNCH", "DdpJob", "STACKS",
           "Stack", "build_counter_image", "expected_hash", "host_bundle", "product_root", "release_mounts",
           "snapguard_runc_path"]

COUNTER_IMAGE = "snapguard.local/counter:1"
BUSYBOX = "/bin/busybox"
CTR = "/usr/bin/ctr"
CONTAINERD = "/usr/bin/containerd"
COUNTER_SCRIPT = workloads.path("counter", "counter.sh")
MODULUS = 1_000_000_007
RUNC = "/usr/sbin/runc"
COMPAT = "/opt/snapguard/compat"  # packaging/install-deps.sh: Debian unstable's containerd and runc


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
    """containerd in its own root under `workdir`, stopped (with its tasks) by `stop`.

    `stack` picks the containerd, ctr and real runc (`STACKS`): "debian12" (the default) or
    "compat". On the compat stack containerd gets its own shim first in PATH, and snapguard-runc
    (which containerd's environment reaches through the shim) `SNAPGUARD_RUNC` set to the stack's
    runc, unless `env` names another."""

    def __init__(self, workdir: str, env: dict[str, str] | None = None, stack: str = "debian12") -> None:
        self.workdir = Path(workdir)
        self.stack = STACKS[stack]
        self.socket = str(self.workdir / "containerd.sock")
        stack_env: dict[str, str] = {}
        if self.stack.bin_dir:
            stack_env = {"PATH": f"{self.stack.bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                         "SNAPGUARD_RUNC": self.stack.runc}
        self.env = {**os.environ, **stack_env, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        # its own namespace per stack: runc's root (below) is shared by every containerd on the host
        self.namespace = "snapguard" if stack == "debian12" else f"snapguard-{stack}"

    @property
    def runc(self) -> str:
        """The real runc of this stack."""
        return self.stack.runc

    @property
    def runc_root(self) -> str:
        """runc's --root for this namespace: the shim keeps its containers there."""
        return f"/run/containerd/runc/{self.namespace}"

    def _config(self) -> str:
        common = (f'root = "{self.workdir}/root"\n'
                  f'state = "{self.workdir}/state"\n')
        listen = (f'[grpc]\n  address = "{self.socket}"\n'
                  f'[ttrpc]\n  address = "{self.socket}.ttrpc"\n'
                  '[debug]\n  address = ""\n'
                  '[metrics]\n  address = ""\n')
        if self.stack.config_version == 2:
            return ("version = 2\n" + common +
                    'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n' + listen +
                    '[plugins."io.containerd.runtime.v2.task"]\n'
                    f'  state = "{self.workdir}/state/v2"\n')
        # containerd 2.x: the CRI service and NRI off (NRI's socket is host-wide); its temp dir
        # (TMPDIR of the shim: `ctr containers checkpoint` images) and opt dir inside workdir
        return ("version = 3\n" + common + f'temp = "{self.workdir}/tmp"\n'
                'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.nri.v1.nri"]\n' + listen +
                "[plugins.'io.containerd.internal.v1.opt']\n"
                f'  path = "{self.workdir}/opt"\n')

    def start(self, timeout: float = 20.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.stack.config_version >= 3:
            (self.workdir / "tmp").mkdir(exist_ok=True)
        config = self.workdir / "config.toml"
        config.write_text(self._config())
        log = open(self.workdir / "containerd.log", "ab")
        self.proc = subprocess.Popen([self.stack.containerd, "--config", str(config)], stdout=log, stderr=log,
                                     env=self.env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
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
            raise RuntimeError(f"ctr {' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
        return out

    def import_counter_image(self) -> str:
        tarball = self.workdir / "counter-image.tar"
        name = build_counter_image(str(tarball))
        # ctr 2.x imports through containerd's transfer service, which unpacks only for the
        # platforms and snapshotters its config names; --local imports as ctr 1.6 does
        local = ["--local"] if self.stack.config_version >= 3 else []
        self.ctr("images", "import", *local, "--snapshotter", "native", str(tarball))
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

    def stop(self) -> None:
        if self.proc is None:
            return
        listing = self.ctr("containers", "ls", "-q", check=False).stdout.split()
        for cid in listing:
            self.remove(cid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        # native snapshots and bundles may leave bind mounts behind on a killed run
        subprocess.run(["umount", "-R", "-l", str(self.workdir / "state")], capture_output=True, check=False)


def cleanup_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


DDP_LAUNCH = workloads.path("ddp", "launch.py")


@dataclass
class DdpJob:
    """A run of the ddp workload (torch.distributed, gloo) whose ranks log their loss bits per step."""

    out: Path
    world: int
    steps: int
    device: str = "cpu"
    backend: str = "gloo"

    def start(self, take_dir: str | None) -> subprocess.Popen[bytes]:
        """Launch it; with take_dir, every process runs snapguard's take-point hook."""
        self.out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if take_dir:
            env["PYTHONPATH"] = os.pathsep.join([site_dir(), product_root()])
            env["SNAPGUARD_TAKE_DIR"] = take_dir
        log = open(self.out / "launcher.out", "ab")
        proc = subprocess.Popen([sys.executable, str(DDP_LAUNCH), "--world", str(self.world), "--out", str(self.out),
                                 "--steps", str(self.steps), "--device", self.device, "--backend", self.backend],
                                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        return proc

    def run_uninterrupted(self, timeout: float = 300) -> DdpJob:
        """Run it to the end without the hook: the reference a snapshotted run is compared with."""
        rc = self.start(None).wait(timeout=timeout)
        if rc != 0:
            raise RuntimeError(f"reference job in {self.out} exited {rc}")
        self.results()
        return self

    def rows(self, rank: int) -> dict[int, list[str]]:
        """{step: [loss bits, ...]}: a step logged twice (a restore went back) has two entries."""
        got: dict[int, list[str]] = {}
        try:
            lines = (self.out / f"rank{rank}.log").read_text().splitlines()
        except FileNotFoundError:
            return got
        for line in lines:
            _, step, bits, _ = line.split()
            got.setdefault(int(step), []).append(bits)
        return got

    def wait_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(max(self.rows(r), default=0) >= step for r in range(self.world)):
                return
            time.sleep(0.02)
        raise TimeoutError(f"job in {self.out} did not reach step {step}")

    def results(self, timeout: float = 120) -> list[dict[str, str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            paths = [self.out / f"rank{r}.result.json" for r in range(self.world)]
            if all(p.exists() for p in paths):
                return [json.loads(p.read_text()) for p in paths]
            time.sleep(0.05)
        raise TimeoutError(f"job in {self.out} did not finish")

    def mismatches(self, reference: DdpJob) -> list[str]:
        """Where this run differs from the reference: steps, loss bits, final digests."""
        errors = []
        if self.results() != reference.results():
            errors.append("final digests differ")
        for r in range(self.world):
            want, got = reference.rows(r), self.rows(r)
            if set(got) != set(want):
                errors.append(f"rank {r}: steps {sorted(set(want) ^ set(got))[:5]} differ")
            errors += [f"rank {r} step {s}: {bits} != {want.get(s)}" for s, bits in sorted(got.items())
                       if set(bits) != set(want.get(s, []))][:5]
        return errors


def _mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    with open(mountinfo) as f:
        # the fifth field, with mountinfo's octal escapes (\040 for a space) decoded
        return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]


def release_mounts(path: Path) -> list[str]:
    """Lazily unmount every mount at or below `path`, deepest first; the mount points released.

    A bundle's rootfs can be left with mounts after a restore; removing the directory tree then
    would go through them into the host's own directories."""
    top = str(path).rstrip("/")
    below = [m for m in _mount_points() if m == top or m.startswith(top + "/")]
    for m in sorted(below, key=lambda m: m.count("/"), reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True, check=False)
    return below


def _with_submounts(dirs: list[str]) -> list[str]:
    """The directories, each followed by the mount points below it, parents before children."""
    points = _mount_points()
    out: list[str] = []
    for d in dirs:
        below = sorted({m for m in points if m.startswith(d.rstrip("/") + "/") and os.path.exists(m)},
                       key=lambda m: (m.count("/"), m))
        out += [d, *below]
    return out


def host_bundle(bundle: Path, args: list[str], env: list[str], host_dirs: list[str], *,
                writable: dict[str, str] | None = None, devices: list[str] | None = None,
                runc: str = RUNC) -> Path:
    """A runc bundle whose rootfs binds the host's own directories read-only (nothing pulled).

    `writable` maps container paths to host directories bound read-write; `devices` are host
    character devices (the GPU's /dev/nvidia*) bound at the same path and allowed in the device
    cgroup. The container stays in the host's network namespace: gloo talks over loopback, and a
    new namespace has lo down and would need iptables for CRIU's network lock.
    """
    rootfs = bundle / "rootfs"
    for d in ["proc", "dev", "sys", "tmp", "run/snapguard/take"]:
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    binds: list[str] = []
    # parents first, so a directory inside another bound one (a venv inside the repository) is
    # skipped: runc restore mounts such nested binds in the host's namespace and leaves them there
    for d in sorted(host_dirs, key=lambda p: p.rstrip("/").count("/")):
        if any(d == b or d.startswith(b.rstrip("/") + "/") for b in binds):
            continue  # already inside a bound directory
        inside = rootfs / d.lstrip("/")
        inside.parent.mkdir(parents=True, exist_ok=True)
        # merged-/usr hosts have /lib, /bin... as symlinks: the same links in the rootfs, real
        # directories bound (CRIU cannot restore a bind mount of a symlink)
        if os.path.islink(d):
            if not inside.is_symlink():
                inside.symlink_to(os.readlink(d))
        elif os.path.isdir(d):
            inside.mkdir(parents=True, exist_ok=True)
            binds.append(d)
    subprocess.run([runc, "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"]["readonly"] = False
    spec["process"].update(terminal=False, cwd="/", args=args, env=env)
    # Each mount under a bound directory (the driver's /usr/local/nvidia on the GPU machines) gets
    # a bind of its own: runc hands CRIU every spec bind as external, while a recursive bind's
    # submounts would be dumped, and CRIU cannot dump every filesystem.
    spec["mounts"] += [{"destination": d, "type": "bind", "source": d, "options": ["bind", "ro"]}
                       for d in _with_submounts(binds)]
    for inside_path, host in (writable or {}).items():
        (rootfs / inside_path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        spec["mounts"].append({"destination": inside_path, "type": "bind", "source": host, "options": ["rbind", "rw"]})
    allowed = spec["linux"]["resources"].setdefault("devices", [])
    for dev in devices or []:
        st = os.stat(dev)
        spec["mounts"].append({"destination": dev, "type": "bind", "source": dev, "options": ["bind", "rw"]})
        allowed.append({"allow": True, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev),
                        "access": "rwm"})
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle
