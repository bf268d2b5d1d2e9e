"""The whole Kubernetes loop with a PyTorch trainer pod, against the trainer's own file checkpoint.

One command, as root, on the machine whose GPU the trainer uses (`--device cuda`, the default) or on
the CPU (`--device cpu`, a small model: the same machinery where there is no GPU):

  reference  the trainer (lab workload torch/train.py) uninterrupted, a plain process on the host
  snapguard  node A (containerd 2.1.9 with CRI, runtime handler `snapguard` = snapguard-runc, its own
             root, sockets and network namespace: snapguard_lab.k8s_nodes.TwoNodes) runs the trainer
             pod from the pod spec as the kubelet would send it (RunPodSandbox, CreateContainer,
             StartContainer; the GPU's device files as the pod's devices, the host's Python and torch
             bound read-only as hostPath mounts). At step --at the notice: the agent's CRI step
             (snapguard.notice._cri.snapshot_pod: CRI CheckpointContainer through snapguard-runc,
             CUDA state included by CRIU's CUDA plugin, StopContainer, the archive made an OCI
             checkpoint image, pushed to the registry, Debian's docker-registry, digest-checked,
             recorded in the job's file:// store entry with its epoch). Node B: the replacement pod,
             its container's image that reference by digest (what the admission webhook writes):
             PullImage, RunPodSandbox, CreateContainer, StartContainer; containerd restores it
             through snapguard-runc.
  file       the trainer's own path: a pod on node A with --save-dir on a hostPath both nodes share;
             at step --at the notice: SIGUSR1 (the trainer's urgent save, as a preStop hook would ask),
             the save waited for, the pod stopped; node B's new pod cold-starts from the file.

Reported: notice -> image whole (recorded in the store) and notice -> first new step on node B for
snapguard; notice -> file saved and notice -> first new step for the file path; steps lost; loss
bits at every step and the state digests at the end against the reference. No kubelet and no API
server run: the CRI calls are what the kubelet makes for those pod specs; the notice is this script's
moment of deciding (a node's agent would have it from its notice source). A table, and JSON (--json).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import os
import signal
import stat
import sys
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

from snapguard.notice._cri import snapshot_pod
from snapguard.store import newest_published, open_store
from snapguard_lab.cri import _image_blobs
from snapguard_lab.k8s_nodes import Node, TwoNodes
from snapguard_lab.testbed import compat_missing
from snapguard_lab.torch_drill import CONTAINER_ENV_PREFIXES, TRAIN, TRAINER_ENV, Trainer, compare

JOB, NAMESPACE, CONTAINER = "train-gpu", "ml", "trainer"
REPOSITORY = f"snapguard/ckpt/{JOB}"
IMAGE_REPO = "snapguard/trainer"
SHARED = "/ckpt"  # the file path's hostPath in both nodes' pods


def _layer() -> bytes:
    """The trainer image's one layer: the top-level directories, and the host's /bin, /lib, ...
    symlinks where it has them (merged /usr), so that the bound /usr serves them."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in ("usr", "etc", "out", "tmp", "proc", "sys", "dev", "run", "root", SHARED.strip("/")):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name in ("tmp", "out") else 0o755
            tf.addfile(info)
        for name in ("bin", "sbin", "lib", "lib64"):
            info = tarfile.TarInfo(name)
            if os.path.islink("/" + name):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink("/" + name)
            else:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(info)
    return buf.getvalue()


def push_trainer_image(nodes: TwoNodes) -> str:
    layer = _layer()
    config, manifest = _image_blobs(layer, ["/bin/sh"])
    digest = nodes.registry.push(IMAGE_REPO, "1", manifest, {
        "sha256:" + hashlib.sha256(b).hexdigest(): b for b in (config, layer)})
    return f"{nodes.host}/{IMAGE_REPO}@{digest}"


class Pod:
    """One trainer pod on one node: the kubelet's calls, and the trainer's log read through the
    container's root (/proc/PID/root: no exec into the container while it is snapshotted)."""

    def __init__(self, node: Node, name: str, image: str, args: list[str], shared: Path) -> None:
        self.node, self.name = node, name
        cri = node.cri
        pb = cri.pb
        uid = str(uuid.uuid4())
        logs = node.containerd.workdir.parent / "pods" / f"{NAMESPACE}_{name}_{uid}"
        logs.mkdir(parents=True)
        self.sandbox = cri.sandbox_config(name, NAMESPACE, uid, str(logs))
        self.sandbox.annotations["snapguard.io/job"] = JOB
        self.config = cri.container_config(CONTAINER, image, self.sandbox)
        # the trainer, then the container idles so that its log and result stay readable
        script = " ".join(_quote(a) for a in [sys.executable, str(TRAIN), *args]) + "; exec sleep 100000"
        self.config.command[:] = ["/bin/sh", "-c", script]
        env = {k: v for k, v in os.environ.items() if k.startswith(CONTAINER_ENV_PREFIXES)}
        env.update(TRAINER_ENV)
        env.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "PYTHONUNBUFFERED": "1"})
        self.config.envs.extend(pb.KeyValue(key=k, value=v) for k, v in sorted(env.items()))
        for host in _host_binds():
            self.config.mounts.append(pb.Mount(container_path=host, host_path=host, readonly=True))
        self.config.mounts.append(pb.Mount(container_path=SHARED, host_path=str(shared)))
        for dev in sorted(glob.glob("/dev/nvidia*")):
            if stat.S_ISCHR(os.stat(dev).st_mode):
                self.config.devices.append(pb.Device(container_path=dev, host_path=dev, permissions="rwm"))
        self.sandbox_id = cri.run_sandbox(self.sandbox)
        self.id = ""

    def start(self, image: str | None = None) -> None:
        cri = self.node.cri
        if image is not None:
            self.config.image.image = image
            self.config.image.user_specified_image = image  # the kubelet's: the pod spec's image
        cri.pull(self.config.image.image)  # the kubelet's PullImage (imagePullPolicy IfNotPresent)
        self.id = cri.create(self.sandbox_id, self.sandbox, self.config)
        cri.start(self.id)

    def pid(self) -> int:
        cri = self.node.cri
        st = cri.runtime.ContainerStatus(cri.pb.ContainerStatusRequest(container_id=self.id, verbose=True), timeout=10)
        return int(json.loads(st.info["info"])["pid"])

    def trainer_pid(self) -> int:
        sh = self.pid()
        with open(f"/proc/{sh}/task/{sh}/children") as f:
            kids = [int(x) for x in f.read().split()]
        if len(kids) != 1:
            raise RuntimeError(f"{self.name}: the pod's shell has children {kids}, not the one trainer")
        return kids[0]

    def read(self, name: str) -> str | None:
        try:
            return Path(f"/proc/{self.pid()}/root/out/{name}").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None

    def stop(self) -> None:
        try:
            self.node.cri.stop_and_remove(self.id)
        except Exception:  # a container the agent already stopped
            pass


def _quote(a: str) -> str:
    return "'" + a.replace("'", "'\\''") + "'"


def _host_binds() -> list[str]:
    """The host's Python and torch for the pod: /usr (with the image's /bin, /lib... symlinks), the
    interpreter's prefixes, the trainer's directory, the loader's cache and the user database."""
    import importlib.util
    import site

    torch = importlib.util.find_spec("torch")
    out = ["/usr"]
    out += [f"/{d}" for d in ("bin", "sbin", "lib", "lib64") if os.path.isdir(f"/{d}") and not os.path.islink(f"/{d}")]
    tops = [sys.base_prefix, sys.prefix, str(TRAIN.parent), *site.getsitepackages()]
    if torch is not None and torch.origin:
        tops.append(os.path.dirname(os.path.dirname(torch.origin)))
    for p in tops:
        if not os.path.isdir(p):
            continue
        real = os.path.realpath(p)
        if not any(real == d or real.startswith(d + "/") for d in out):
            out.append(real)
    out += _submounts(out)
    out += [f for f in ("/etc/ld.so.cache", "/etc/passwd", "/etc/group") if os.path.exists(f)]
    return out


def _submounts(binds: list[str]) -> list[str]:
    """The host's mounts below the bound directories (the GPU machine's /usr/local/nvidia under
    /usr): containerd binds a hostPath recursively, and CRIU refuses a mount of the container it
    is not told about (run16c: `mnt: FS mnt ./usr/local/nvidia ... unsupported`). Named as mounts
    of their own, runc hands each to CRIU as an external bind."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point not in binds and any(point.startswith(d.rstrip("/") + "/") for d in binds):
                found.append(point)
    return sorted(set(found), key=lambda p: (p.count("/"), p))


class PodRun:
    """Trainer-like rows() over a pod's log (torch_drill.compare reads nothing else)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def rows(self) -> list[tuple[int, str, float, int]]:
        out = []
        for line in self.text.splitlines():
            p = line.split()
            if len(p) == 5 and p[0] == "step":
                out.append((int(p[1]), p[2], float(p[3]), int(p[4])))
        return out


def _wait(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.01)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


def _step_at_least(pod: Pod, step: int) -> Any:
    rows = PodRun(pod.read("trainer.log") or "").rows()
    return rows if rows and rows[-1][0] >= step else None


def _first_after(pod: Pod, moment: float) -> Any:
    new = [r for r in PodRun(pod.read("trainer.log") or "").rows() if r[2] > moment]
    return new[0] if new else None


def _done(pod: Pod) -> Any:
    text = pod.read("result.json")
    return json.loads(text) if text else None


def trainer_args(a: argparse.Namespace) -> list[str]:
    return ["--steps", str(a.steps), "--device", a.device, "--width", str(a.width), "--layers", str(a.layers)]


def snapguard_arm(nodes: TwoNodes, a: argparse.Namespace, image: str, shared: Path, store: Any,
                  ref: Trainer, ref_result: dict[str, Any]) -> dict[str, Any]:
    args = [*trainer_args(a), "--log", "/out/trainer.log", "--result", "/out/result.json",
            "--stderr", "/out/trainer.err"]
    pa = Pod(nodes["a"], "trainer-sg-0", image, args, shared)
    pa.start()
    t = a.timeout
    _wait(f"node A's trainer at step {a.at}", lambda: _step_at_least(pa, a.at), t)
    before = PodRun(pa.read("trainer.log") or "").rows()
    t_notice = time.time()
    published = nodes.in_node("a", lambda: snapshot_pod(
        cri_socket=pa.node.containerd.socket, container_id=pa.id, job=JOB, store=store,
        epoch=store.current_epoch(JOB), registry_url=f"http://{nodes.host}", repository=REPOSITORY,
        workdir=str(pa.node.state_dir / "cri"), deadline_s=a.deadline))
    t_image = time.time()
    assert newest_published(store, JOB) == published
    state_a = pa.node.cri.state(pa.id)
    b = nodes["b"]
    pb_ = Pod(b, "trainer-sg-0", published.reference, args, shared)
    pb_.start(published.reference)
    t_started = time.time()
    first = _wait("node B's first new step", lambda: _first_after(pb_, t_image), t)
    result = _wait("node B's trainer to finish", lambda: _done(pb_), t)
    status = b.cri.status(pb_.id)
    run = PodRun(pb_.read("trainer.log") or "")
    cmp = _compare(ref, run, ref_result, result)
    pa.stop()
    pb_.stop()
    return {"arm": "snapguard-oci-image", "notice_at_step": before[-1][0], "reference": published.reference,
            "digest": published.digest, "epoch": published.epoch, "image_bytes": published.size,
            "node_a_after": state_a, "restored_annotation": status.annotations.get("restored"),
            "notice_to_image_whole_s": t_image - t_notice, "notice_to_first_new_step_s": first[2] - t_notice,
            "image_to_first_new_step_s": first[2] - t_image, "node_b_create_start_s": t_started - t_image,
            "first_new_step": first[0], "steps_lost": before[-1][0] + 1 - first[0] if first[0] <= before[-1][0]
            else 0, **cmp}


def file_arm(nodes: TwoNodes, a: argparse.Namespace, image: str, shared: Path,
             ref: Trainer, ref_result: dict[str, Any]) -> dict[str, Any]:
    ckdir = f"{SHARED}/file-arm"
    args = [*trainer_args(a), "--log", "/out/trainer.log", "--result", "/out/result.json",
            "--stderr", "/out/trainer.err", "--save-dir", ckdir]
    pa = Pod(nodes["a"], "trainer-file-0", image, args, shared)
    pa.start()
    t = a.timeout
    _wait(f"node A's trainer at step {a.at}", lambda: _step_at_least(pa, a.at), t)
    t_notice = time.time()
    os.kill(pa.trainer_pid(), signal.SIGUSR1)  # the trainer's urgent save after the step it is in

    def saved() -> Any:
        lines = [ln.split() for ln in (pa.read("trainer.log") or "").splitlines() if ln.startswith("saved ")]
        return lines[0] if lines else None

    line = _wait("node A's urgent save", saved, t)
    t_saved = time.time()
    saved_step = int(line[1])
    last_a = PodRun(pa.read("trainer.log") or "").rows()[-1][0]
    pa.stop()
    path = f"{ckdir}/ckpt-{saved_step:09d}.pt"
    pb_ = Pod(nodes["b"], "trainer-file-0", image, [*args[:-2], "--resume", path], shared)
    pb_.start()
    first = _wait("node B's first new step", lambda: _first_after(pb_, t_saved), t)
    result = _wait("node B's trainer to finish", lambda: _done(pb_), t)
    run = PodRun(pb_.read("trainer.log") or "")
    cmp = _compare(ref, run, ref_result, result)
    cmp["missing_steps"] = []  # the steps up to the save are node A's
    cmp["bit_identical"] = not cmp["loss_mismatches"] and cmp["digests_equal"]
    pb_.stop()
    return {"arm": "file-checkpoint", "notice_at_step": a.at, "saved_step": saved_step,
            "image_bytes": (shared / "file-arm" / os.path.basename(path)).stat().st_size,
            "save_stall_s": float(line[2]), "notice_to_file_saved_s": t_saved - t_notice,
            "notice_to_first_new_step_s": first[2] - t_notice, "first_new_step": first[0],
            "steps_lost": max(last_a - saved_step, 0), **cmp}


def _compare(ref: Trainer, run: PodRun, ref_result: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    if not ref_result:
        return {"loss_mismatches": [], "digests_equal": False, "bit_identical": False, "compared": "no reference"}
    return compare(ref, run, ref_result, result)


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'arm':<22}{'image MB':>10}{'notice->whole s':>17}{'notice->1st new step s':>24}{'lost':>6}  bit-identical"
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['arm']:<22}  FAILED: {r['error'][:200]}")
            continue
        whole = r.get("notice_to_image_whole_s", r.get("notice_to_file_saved_s", float("nan")))
        lines.append(f"{r['arm']:<22}{r['image_bytes'] / 1e6:>10.1f}{whole:>17.2f}"
                     f"{r['notice_to_first_new_step_s']:>24.2f}{r['steps_lost']:>6}  {r['bit_identical']}")
    return "\n".join(lines)


def _start_nodes(work: Path) -> TwoNodes:
    """TwoNodes started; a second try where the first does not come up (a registry relay's start
    in a node is seen to fail now and then in a process that already holds gRPC channels)."""
    for attempt in range(2):
        nodes = TwoNodes(str(work / f"lab{attempt}"), str(work / "config.toml"))
        try:
            return nodes.start()
        except RuntimeError as e:
            nodes.stop()
            if attempt:
                raise
            print(f"k8s_loop: the nodes did not start ({e}); once more", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", required=True, help="a fresh directory for the nodes, the registry and the store")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--at", type=int, default=50, help="the notice comes after this step")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=120, help="the agent's deadline for snapshot + push (s)")
    ap.add_argument("--timeout", type=float, default=300, help="the longest wait for any one step of a pod (s)")
    ap.add_argument("--arms", default="snapguard,file", help="comma-separated: snapguard, file")
    ap.add_argument("--no-reference", action="store_true",
                    help="diagnostics: no uninterrupted run, so no bit comparison (bit_identical stays false)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    why = compat_missing()
    if why:
        print(f"k8s_loop: the compat stack is missing: {why}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("k8s_loop: must run as root (containerd, CRIU)", file=sys.stderr)
        return 2
    work = Path(a.workdir)
    work.mkdir(mode=0o700, parents=True)
    (work / "config.toml").write_text("")
    shared = work / "shared"
    shared.mkdir(mode=0o700)
    out: dict[str, Any] = {"device": a.device, "steps": a.steps, "at": a.at, "width": a.width, "layers": a.layers,
                           "agent_step": "snapguard.notice._cri.snapshot_pod", "rows": []}
    ref = Trainer(work, "reference", a.steps, extra=trainer_args(a)[2:])
    t0 = time.time()
    ref_result: dict[str, Any] = {}
    if not a.no_reference:
        ref.start()
        ref_result = ref.wait_done(timeout=a.timeout * 3)
    out["reference_s"] = time.time() - t0
    nodes = _start_nodes(work)
    try:
        image = push_trainer_image(nodes)
        out["trainer_image"] = image
        store = open_store(f"file://{work / 'store'}")
        arms = a.arms.split(",")
        for arm in arms:
            try:
                if arm == "snapguard":
                    row = snapguard_arm(nodes, a, image, shared, store, ref, ref_result)
                elif arm == "file":
                    row = file_arm(nodes, a, image, shared, ref, ref_result)
                else:
                    raise ValueError(f"no arm {arm!r}")
            except Exception as e:  # reported; the next arm runs
                row = {"arm": arm, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:1500]}"}
            out["rows"].append(row)
            print(json.dumps(row, default=str), flush=True)
    finally:
        nodes.stop()
    table = _table(out["rows"])
    print(table)
    out["table"] = table
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0 if all(r.get("bit_identical") for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
