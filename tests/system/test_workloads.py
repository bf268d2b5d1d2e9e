"""The workload matrix on the CPU (lab/snapguard_lab/matrix.py, the scripts of
workloads/matrix): the rows that make sense without a GPU, each snapshotted through snapguard's
pipeline leave-running and stopped + restored, compared bit for bit with an uninterrupted run.

And the take point's resolution of the GPU-handle blockers where no GPU is: the fork handler on a
process that holds descriptors and mappings of paths the preflight takes for NVIDIA device files
(regular files at /dev/nvidia* in a tmpfs /dev of a private mount namespace: the handler and the
preflight match paths, as CRIU's failure does), and the preflight's decision on procfs fixtures of
a trainer with torch.compile's pool.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from snapguard import procfs
from snapguard.config import load
from snapguard.takepoint import RESOLVE_ENV, site_dir
from snapguard.takepoint import client as take
from snapguard.preflight import workload
from snapguard.reasons import Reason, Severity, SnapguardError
from snapguard_lab import matrix
from snapguard_lab.matrix import ROWS, run_row, table
from tests.unit.test_workload import _fake_proc

pytest.importorskip("torch")  # in the test extra: a skip here means the install is broken

pytestmark = pytest.mark.stack  # CRIU, and mount namespaces for the fork handler

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    (tmp_path / "config.toml").write_text("")
    monkeypatch.setenv("SNAPGUARD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("SNAPGUARD_STATE_DIR", str(tmp_path / "state"))
    return load()


@pytest.fixture(autouse=True)
def warm_page_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop arms restore with the page cache as it is: run_row's drop of it before each restore
    (`sync`, then drop_caches) is for the GPU matrix's figure of a restore from the disk; here it
    proves nothing more and costs the stop arms seconds of reading torch's libraries (and
    transformers') back from the disk, many more on a loaded machine, and slows whatever else runs
    on it."""
    monkeypatch.setattr(matrix, "drop_page_cache", lambda: False)


def _check_arms(r: dict[str, Any], modes: tuple[str, ...] = ("leave-running", "stop")) -> None:
    assert r.get("ok"), table([r]) + "\n" + json.dumps(r, indent=1, default=str)[:6000]
    for mode in modes:
        arm = r[mode]
        assert arm["bit_identical"] and arm["steps_compared"] == r["steps"], arm
        (figures,) = arm["take_point"].values()
        assert figures["ok"]
    if "stop" in modes:
        assert r["stop"]["first_new_step"] > r["snapshot_after"]
        assert r["stop"]["restore_to_first_step_s"] > 0


# --- the matrix's CPU rows ----------------------------------------------------------------------


def test_dataloader_with_forked_persistent_workers(config, tmp_path: Path) -> None:
    """The trainer and its 4 forked DataLoader workers are one tree: dumped together, restored
    together, bit for bit."""
    r = run_row(ROWS["dataloader"], tmp_path / "m", config, device="cpu", steps=40, at=15)
    _check_arms(r)
    for mode in ("leave-running", "stop"):
        assert r[mode]["processes_dumped"] == 5, r[mode]  # the trainer and its four workers are in the image
        assert len(r[mode]["result"]["worker_pids"]) == 4


def test_compile_pool_is_shut_down_off_the_stall_and_comes_back(config, tmp_path: Path) -> None:
    """torch.compile with inductor's worker pool (started as inductor starts it on a GPU): the take
    point shuts the pool down once compilation is idle, or at the take; no pool process is in the
    image; the compile after the snapshot (step 80) brings a new pool, lazily, in the run left
    running and in the restored one."""
    r = run_row(ROWS["compile"], tmp_path / "m", config, device="cpu", steps=90, at=45)
    _check_arms(r)
    for mode in ("leave-running", "stop"):
        arm = r[mode]
        (figures,) = arm["take_point"].values()
        assert figures["compile_pool"]["state"] in ("shut-down", "none"), figures
        assert arm["processes_dumped"] == 1, arm  # the pool's processes were gone before the freeze
        result = arm["result"]
        first, again = result["pool_pids_at_start"], result["pool_pids_after_recompile"]
        assert first and again and set(first).isdisjoint(again), result
    # the reference (no hook) kept its one pool all along
    ref = r["reference"]["result"]
    assert ref["pool_pids_at_start"] == ref["pool_pids_at_end"]


@pytest.mark.parametrize("name", ["hf-trainer", "lightning"])
def test_framework_trainers_stop_and_restore(name: str, config, tmp_path: Path) -> None:
    """A Hugging Face Trainer and a Lightning Trainer, stopped and restored (the leave-running arm
    of these rows runs on the GPU: bench/gpu/workloads.py; here CI's minutes go to the restore)."""
    row = ROWS[name]
    r = run_row(row, tmp_path / "m", config, device="cpu", steps=40, at=15, modes=("stop",))
    if r.get("skipped"):
        pytest.skip(r["skipped"])
    _check_arms(r, ("stop",))


def test_snapshot_asked_mid_accumulation_holds_at_the_optimizer_step(config, tmp_path: Path) -> None:
    """The snapshot is asked during the first micro-batch of a step; the take point holds at the
    end of that step's optimizer step, never between micro-batches (the run stays bit-identical)."""
    r = run_row(ROWS["accumulation"], tmp_path / "m", config, device="cpu", steps=22, at=10,
                modes=("leave-running",))
    _check_arms(r, ("leave-running",))
    arm = r["leave-running"]
    assert arm["asked_in_micro"][0] == 11
    assert arm["held_at_the_next_optimizer_step"], arm
    assert arm["take_arrived_mid_accumulation"], arm  # the micro-batches are slow: it lands among them


def test_gpu_only_rows_are_skipped_on_the_cpu(config, tmp_path: Path) -> None:
    r = run_row(ROWS["amp"], tmp_path / "m", config, device="cpu")
    assert r["skipped"] == "needs a GPU"


# --- the fork handler, on NVIDIA-shaped handles ----------------------------------------------

FORK_PARENT = r"""
import ctypes, errno, fcntl, json, mmap, os, sys
# stands in for a CUDA trainer: it holds the device files open and maps two, as a CUDA context does
names = sys.argv[1].split(",")
fds = {n: os.open("/dev/" + n, os.O_RDWR) for n in names}
maps = {n: mmap.mmap(fds[n], 4096) for n in ("nvidia0", "nvidiactl") if n in fds}
addrs = {n: ctypes.addressof(ctypes.c_char.from_buffer(m)) for n, m in maps.items()}
other = open(sys.argv[2], "r+b")  # a file that is no GPU handle: the child keeps it, and its mapping
kept = mmap.mmap(other.fileno(), 4096)
import torch.optim  # a trainer: the take point answers as one
child = os.fork()
if child == 0:
    vmas = []
    for line in open("/proc/self/maps"):
        parts = line.split(None, 5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        vmas.append((lo, hi, parts[1], parts[5].strip() if len(parts) == 6 else ""))
    try:
        fcntl.ioctl(fds[names[0]], 0)
        ioctl = "ok"
    except OSError as e:
        ioctl = errno.errorcode[e.errno]
    os.write(1, json.dumps({"child": os.getpid(), "fd_targets": {n: os.readlink(f"/proc/self/fd/{fds[n]}") for n in names},
                      "read_dropped": os.read(fds[names[0]], 4).decode(), "ioctl_dropped": ioctl,
                      "former_maps": {n: [v[2:] for v in vmas if v[0] <= a < v[1]] for n, a in addrs.items()},
                      "kept_map": kept[:4].decode(),
                      "other_fd": os.readlink(f"/proc/self/fd/{other.fileno()}")}).encode() + b"\n")
    sys.stdin.read()
    os._exit(0)
# each line one write (print writes the line and its end apart where stdout is unbuffered, and
# the child's line could come between them)
os.write(1, json.dumps({"parent": os.getpid()}).encode() + b"\n")
sys.stdin.read()
"""


@contextmanager
def nvidia_shaped(tmp_path: Path, names: list[str], env: dict[str, str]) -> Iterator[dict[str, Any]]:
    """FORK_PARENT in a mount namespace of its own whose /dev is a tmpfs with regular files named as
    the NVIDIA device nodes (and null, zero, urandom); yields {parent, child, report}."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.fail("needs root and unshare (util-linux), as the system tests do")
    other = tmp_path / "other.bin"
    other.write_bytes(b"keep" + bytes(4092))
    files = " ".join(f"/dev/{n}" for n in names)
    setup = (f"mount -t tmpfs -o mode=755 tmpfs /dev && mknod -m 666 /dev/null c 1 3 && mknod -m 666 /dev/zero c 1 5 "
             f"&& mknod -m 666 /dev/urandom c 1 9 && for f in {files}; do head -c 4096 /dev/zero > $f; done && "
             f'exec "$0" -c "$1" "$2" "$3"')
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", setup, sys.executable,
                             FORK_PARENT, ",".join(names), str(other)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    info: dict[str, Any] = {}
    try:
        lines = [json.loads(proc.stdout.readline() or "{}") for _ in range(2)]  # type: ignore[union-attr]
        info = {k: v for line in lines for k, v in line.items()}
        if "parent" not in info or "child" not in info:
            proc.kill()
            raise AssertionError(f"the planted process failed: {lines} {proc.stderr.read()}")  # type: ignore[union-attr]
        yield {"parent": info["parent"], "child": info["child"], "report": info}
    finally:
        for pid in (info.get("child"), proc.pid):  # our child (unshare exec'd into the parent) and its fork
            if pid:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        proc.wait()


def _env(tmp_path: Path, hooked: bool, resolve: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SNAPGUARD_TAKE_DIR", RESOLVE_ENV, "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([site_dir(), str(REPO)])
    if hooked:
        env["SNAPGUARD_TAKE_DIR"] = str(tmp_path / "take")
    if not resolve:
        env[RESOLVE_ENV] = "0"
    return env


def _stray(parent: int, child: int) -> tuple[dict[int, Any], list[Any]]:
    """The preflight's check on the planted pair, the parent taken as the CUDA process (as the
    driver's list would say), with the take point's status."""
    trainers = take.trainers([parent, child])
    inv = procfs.inventory([parent, child])
    inv.cuda_pids_from_driver = {parent}
    return trainers, workload.check_stray_gpu_handles(inv, trainers)


GPU_NAMES = ["nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"]


def test_forked_child_of_a_cuda_process_drops_its_gpu_handles(tmp_path: Path) -> None:
    with nvidia_shaped(tmp_path, [*GPU_NAMES, "nvidia-other"], _env(tmp_path, hooked=True)) as planted:
        report = planted["report"]
        # each descriptor on a GPU path now reads /dev/null, with its number; anything else stays
        assert report["fd_targets"] == {**{n: "/dev/null" for n in GPU_NAMES}, "nvidia-other": "/dev/nvidia-other"}
        assert report["read_dropped"] == "" and report["ioctl_dropped"] == "ENOTTY"
        # its mappings of them are inaccessible anonymous reservations now; the other mapping is intact
        assert report["former_maps"] == {"nvidia0": [["---p", ""]], "nvidiactl": [["---p", ""]]}, report
        assert report["kept_map"] == "keep" and report["other_fd"] == str(tmp_path / "other.bin")
        # the executor's view: the hook is there, resolves, and the tree is clean
        trainers, findings = _stray(planted["parent"], planted["child"])
        st = trainers[planted["parent"]]
        assert st["resolve"] and st["gpu_handles_dropped_in_children"] and st["compile_pool"]["state"] == "none"
        assert findings == []
        assert take.stray_under([planted["parent"]], [planted["parent"]]) == []


def test_with_resolution_off_the_child_keeps_them_and_is_refused(tmp_path: Path) -> None:
    with nvidia_shaped(tmp_path, GPU_NAMES, _env(tmp_path, hooked=True, resolve=False)) as planted:
        assert all(t.startswith("/dev/nvidia") for t in planted["report"]["fd_targets"].values())
        trainers, findings = _stray(planted["parent"], planted["child"])
        assert trainers[planted["parent"]]["resolve"] is False
        (f,) = findings
        assert f.severity is Severity.BLOCKER and f.evidence["pid"] == planted["child"]
        assert f.evidence["cause"] == "hook-resolve-off" and RESOLVE_ENV in f.detail
        # and what the take would find after a hold
        (s,) = take.stray_under([planted["parent"]], [planted["parent"]])
        assert s["pid"] == planted["child"] and "/dev/nvidia-uvm" in s["paths"]


def test_without_the_hook_the_child_is_refused_with_the_remedy(tmp_path: Path) -> None:
    with nvidia_shaped(tmp_path, GPU_NAMES, _env(tmp_path, hooked=False)) as planted:
        trainers, findings = _stray(planted["parent"], planted["child"])
        assert trainers == {}
        (f,) = findings
        assert f.evidence == {**f.evidence, "pid": planted["child"], "cause": "unhooked", "trainer": None}
        assert "spawn" in f.detail and "hook" in f.detail
        assert "take-point hook" in Reason.STRAY_GPU_DEVICE_HANDLE.remedy


def test_child_of_an_nvml_only_process_keeps_its_handles(tmp_path: Path) -> None:
    """No /dev/nvidia-uvm and no CUDA initialised in PyTorch: the parent has no CUDA context, the
    child may still use CUDA itself, so nothing is dropped (and the preflight names it)."""
    with nvidia_shaped(tmp_path, ["nvidiactl", "nvidia0"], _env(tmp_path, hooked=True)) as planted:
        assert all(t.startswith("/dev/nvidia") for t in planted["report"]["fd_targets"].values())
        _, findings = _stray(planted["parent"], planted["child"])
        assert [f.evidence["cause"] for f in findings] == ["opened-in-child"]


# --- the preflight's decision on a trainer with torch.compile's pool (procfs fixtures) ---------


def _pool_tree(root: Path) -> None:
    devices = ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"]
    nvml = ["/dev/nvidiactl", "/dev/nvidia0"]
    libcuda = "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"
    _fake_proc(root, 100, "python3", [libcuda, *devices], devices, children=[110, 120])
    _fake_proc(root, 110, "python3", [], nvml, children=[111])  # inductor's SubprocPool sidecar
    _fake_proc(root, 111, "python3", [], nvml)  # one of its workers
    _fake_proc(root, 120, "pt_data_worker", [libcuda], [])  # a DataLoader worker after the fork handler
    for pid, ppid in ((110, 100), (111, 110), (120, 100)):
        status = root / str(pid) / "status"
        status.write_text(status.read_text().replace("PPid:\t1", f"PPid:\t{ppid}"))


def _status(resolve: bool) -> dict[int, dict[str, Any]]:
    return {100: {"trainer": True, "resolve": resolve, "gpu_handles_dropped_in_children": resolve,
                  "compile_pool": {"state": "running", "pids": [110], "shutdown_at_take": True}}}


def test_preflight_lets_a_pool_the_take_shuts_down_through(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    _pool_tree(root)
    inv = procfs.inventory([100, 110, 111, 120], proc=str(root))
    inv.cuda_pids_from_driver = {100}
    findings = workload.check_stray_gpu_handles(inv, _status(resolve=True))
    assert {f.evidence["pid"]: (f.severity, f.evidence["cause"]) for f in findings} == {
        110: (Severity.WARNING, "compile-pool"), 111: (Severity.WARNING, "compile-pool")}
    # the same tree from a trainer that does not resolve: refused, pids named
    findings = workload.check_stray_gpu_handles(inv, _status(resolve=False))
    assert {f.evidence["pid"] for f in findings if f.severity is Severity.BLOCKER} == {110, 111}
    # no status at all (the hook is not there)
    assert all(f.evidence["cause"] == "unhooked" for f in workload.check_stray_gpu_handles(inv))


def test_take_refuses_when_the_pool_is_still_there_after_the_hold(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    _pool_tree(root)
    stray = take.stray_under([100], [100], proc=str(root))
    assert sorted(s["pid"] for s in stray) == [110, 111]
    with pytest.raises(SnapguardError) as e:
        take._refuse_stray(stray, {}, {})
    assert e.value.reason is Reason.STRAY_GPU_DEVICE_HANDLE and e.value.failure.evidence["pids"] == [110, 111]
    assert e.value.failure.workload_intact
