"""Workload checks on real planted processes, and on procfs fixtures for NVIDIA shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapguard import procfs
from snapguard.preflight import workload
from snapguard.preflight import Report
from snapguard.reasons import Reason, Severity, SnapguardError
from snapguard_lab.planted import DELETED_SHM, IDLE, IO_URING, TCP_PAIR, WRITABLE, planted


def _findings(pid: int, **kw: object) -> dict[Reason, list]:
    report = Report("test")
    workload.run_checks(report, procfs.inventory([pid]), **kw)
    assert all(c.error is None for c in report.checks), [c.error for c in report.checks]
    out: dict[Reason, list] = {}
    for f in report.findings:
        out.setdefault(f.reason, []).append(f)
    return out


def test_io_uring_is_a_blocker() -> None:
    with planted(IO_URING) as pid:
        f = _findings(pid)[Reason.IO_URING_PRESENT][0]
        assert f.severity is Severity.BLOCKER and f.evidence["pid"] == pid


def test_established_tcp_blocks_unless_carried() -> None:
    with planted(TCP_PAIR) as pid:
        f = _findings(pid)[Reason.TCP_ESTABLISHED][0]
        assert f.severity is Severity.BLOCKER
        assert len(f.evidence["connections"]) == 2  # both ends live in the one process
        carried = _findings(pid, tcp_established=True)[Reason.TCP_ESTABLISHED][0]
        assert carried.severity is Severity.WARNING


def test_listening_socket_alone_is_fine() -> None:
    with planted("import socket\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n") as pid:
        assert Reason.TCP_ESTABLISHED not in _findings(pid)


def test_deleted_shm_mapping_is_reported() -> None:
    with planted(DELETED_SHM) as pid:
        f = _findings(pid)[Reason.SHM_DELETED_FILE][0]
        assert f.evidence["path"].startswith("/dev/shm/snapguard-test-") and f.evidence["path"].endswith("(deleted)")


def test_writable_files_without_append(tmp_path: Path) -> None:
    trunc, app = tmp_path / "trunc.log", tmp_path / "append.log"
    with planted(WRITABLE, str(trunc), str(app)) as pid:
        paths = [f.evidence["path"] for f in _findings(pid).get(Reason.FILE_CHANGED, [])]
        assert paths == [str(trunc)]


def test_ld_preload_interposer() -> None:
    lib = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6")
               if os.path.exists(p))
    with planted(IDLE, env={"LD_PRELOAD": lib}) as pid:
        f = _findings(pid)[Reason.INTERPOSER_PRESENT][0]
        # not a CUDA process: noted, not blocking
        assert f.severity is Severity.WARNING and f.evidence["value"] == lib


def test_process_tree_and_vanished_root() -> None:
    with planted("import subprocess\nkid = subprocess.Popen(['/bin/sleep', '100'])\n") as pid:
        tree = procfs.process_tree(pid)
        assert tree[0] == pid and len(tree) == 2
    with pytest.raises(SnapguardError) as e:
        procfs.process_tree(pid)
    assert e.value.reason is Reason.PROCESS_NOT_FOUND


def test_inventory_skips_processes_that_exit() -> None:
    with planted(IDLE) as pid:
        pass
    assert procfs.inventory([pid, os.getpid()]).procs[0].pid == os.getpid()


# --- procfs fixtures: the NVIDIA shapes this machine cannot produce ---------------------------

LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"
LIBNVML = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.159.04"
LIBNCCL = "/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"


def _fake_proc(root: Path, pid: int, comm: str, maps: list[str], fds: list[str], env: dict[str, str] | None = None,
               children: list[int] = ()) -> None:
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "fdinfo").mkdir()
    (d / "task" / str(pid)).mkdir(parents=True)
    (d / "task" / str(pid) / "children").write_text(" ".join(map(str, children)))
    (d / "status").write_text(f"Name:\t{comm}\nTgid:\t{pid}\nPPid:\t1\nVmRSS:\t  1024 kB\nSeccomp:\t0\n")
    (d / "stat").write_text(f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0\n")
    (d / "environ").write_text("\0".join(f"{k}={v}" for k, v in (env or {}).items()))
    (d / "maps").write_text("".join(
        f"7f00{i:08x}000-7f00{i:08x}fff rw-s 00000000 00:05 {100 + i}                     {p}\n"
        for i, p in enumerate(maps)))
    for i, target in enumerate(fds, start=3):
        os.symlink(target, d / "fd" / str(i))
        (d / "fdinfo" / str(i)).write_text("pos:\t0\nflags:\t02\n")


@pytest.fixture
def gpu_proc(tmp_path: Path) -> Path:
    """A PyTorch trainer (100) with a forked DataLoader worker (101) and an NVML monitor (102)."""
    root = tmp_path / "proc"
    devices = ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"]
    _fake_proc(root, 100, "python3", [LIBCUDA, LIBNVML, *devices], devices, children=[101, 102])
    # fork after CUDA init: libcuda and the fds are inherited, the device mappings are not
    _fake_proc(root, 101, "pt_data_worker", [LIBCUDA, LIBNVML], devices)
    _fake_proc(root, 102, "gpu-monitor", [LIBNVML], ["/dev/nvidiactl", "/dev/nvidia0"])
    return root


def _fixture_findings(root: Path, pids: list[int], cuda_pids: set[int] | None = None) -> dict[Reason, list]:
    inv = procfs.inventory(pids, proc=str(root))
    inv.cuda_pids_from_driver = cuda_pids
    report = Report("fixture")
    workload.run_checks(report, inv, proc=str(root))
    out: dict[Reason, list] = {}
    for f in report.findings:
        out.setdefault(f.reason, []).append(f)
    return out


def test_stray_handles_from_procfs_evidence(gpu_proc: Path) -> None:
    tree = procfs.process_tree(100, proc=str(gpu_proc))
    assert tree == [100, 101, 102]
    found = _fixture_findings(gpu_proc, tree)
    stray = {f.evidence["pid"]: f for f in found[Reason.STRAY_GPU_DEVICE_HANDLE]}
    assert set(stray) == {101, 102}
    assert "holds fds of" in stray[102].detail and "/dev/nvidiactl" in stray[102].evidence["paths"]
    assert Reason.NCCL_UNSUPPORTED not in found


def test_driver_list_of_cuda_pids_wins(gpu_proc: Path) -> None:
    found = _fixture_findings(gpu_proc, [100, 101, 102], cuda_pids={100})
    assert {f.evidence["pid"] for f in found[Reason.STRAY_GPU_DEVICE_HANDLE]} == {101, 102}
    found = _fixture_findings(gpu_proc, [100, 101, 102], cuda_pids={100, 101})
    assert Reason.NCCL_UNSUPPORTED in found  # two CUDA contexts cannot be locked as one


def test_nccl_and_mps(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    devices = ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"]
    _fake_proc(root, 200, "rank0", [LIBCUDA, LIBNCCL, "/dev/shm/nccl-Ab12Cd (deleted)", *devices], devices)
    # every PyTorch CUDA process maps libnccl, and images set NCCL_* node-wide: neither is NCCL in use
    _fake_proc(root, 250, "trainer", [LIBCUDA, LIBNCCL, *devices], devices, env={"NCCL_NVLS_ENABLE": "0"})
    _fake_proc(root, 300, "mps-client", [LIBCUDA, *devices], devices,
               env={"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"})
    nccl = _fixture_findings(root, [200])[Reason.NCCL_UNSUPPORTED][0]
    assert nccl.evidence["pids"] == [200] and "NCCL communicator" in nccl.detail
    assert Reason.NCCL_UNSUPPORTED not in _fixture_findings(root, [250])
    mps = _fixture_findings(root, [300])[Reason.MPS_UNSUPPORTED][0]
    assert mps.evidence["evidence"] == ["CUDA_MPS_PIPE_DIRECTORY"]


def test_interposer_in_cuda_process_blocks(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    devices = ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"]
    _fake_proc(root, 400, "trainer", [LIBCUDA, *devices], devices, env={"LD_PRELOAD": "/opt/hook/libcudahook.so"})
    f = _fixture_findings(root, [400])[Reason.INTERPOSER_PRESENT][0]
    assert f.severity is Severity.BLOCKER


def test_gpu_memory_against_host_memory(gpu_proc: Path) -> None:
    (gpu_proc / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable:     1024 kB\n")
    inv = procfs.inventory([100], proc=str(gpu_proc))
    inv.cuda_pids_from_driver, inv.gpu_memory_by_pid = {100}, {100: 8 << 30}
    found = workload.check_host_memory(inv, proc=str(gpu_proc))
    assert found[0].reason is Reason.HOST_MEMORY_INSUFFICIENT and found[0].evidence["needed"] == 8 << 30


def test_maps_parsing_keeps_spaces_and_deleted_marker() -> None:
    text = ("55d0-55d1 r--p 00000000 08:01 1 /usr/bin/python3\n"
            "7f00-7f01 rw-s 00000000 00:01 5 /dev/shm/a b (deleted)\n"
            "7f02-7f03 rw-p 00000000 00:00 0 \n")
    assert procfs.parse_maps(text) == {"/usr/bin/python3", "/dev/shm/a b (deleted)"}


def test_tcp_between_processes_of_the_tree_needs_no_lock() -> None:
    a = {"table": "tcp", "local": "0100007F:9C40", "remote": "0100007F:D431"}
    b = {"table": "tcp", "local": "0100007F:D431", "remote": "0100007F:9C40"}
    outside = {"table": "tcp", "local": "0100007F:D432", "remote": "0A000001:01BB"}
    assert procfs.internal_only([a, b])
    assert not procfs.internal_only([a, b, outside])
    assert not procfs.internal_only([])


def test_nccl_group_reported_by_the_take_point(gpu_proc: Path) -> None:
    inv = procfs.inventory([100], proc=str(gpu_proc))
    assert workload.check_multi_cuda(inv, {100: {"trainer": True, "nccl": False}}) == []
    (f,) = workload.check_multi_cuda(inv, {100: {"trainer": True, "nccl": True}})
    assert f.reason is Reason.NCCL_UNSUPPORTED and "cannot checkpoint" in f.detail


def test_amx_noted_for_onednn_users_without_a_cap(gpu_proc: Path) -> None:
    """CRIU restores neither AMX permission nor tile state: oneDNN users on an AMX CPU are noted,
    unless their ISA is capped below AMX; no AMX, no note."""
    torch_cpu = "/opt/venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so"
    root = gpu_proc.parent / "amxproc"
    _fake_proc(root, 300, "trainer", [torch_cpu], [])
    _fake_proc(root, 301, "capped", [torch_cpu], [], env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    _fake_proc(root, 302, "shell", ["/usr/bin/bash"], [])
    inv = procfs.inventory([300, 301, 302], proc=str(root))
    (f,) = workload.check_amx(inv, ["avx512f", "amx_tile", "amx_bf16"])
    assert f.reason is Reason.AMX_STATE_UNSUPPORTED and f.evidence["pid"] == 300
    assert f.severity is Severity.WARNING
    assert workload.check_amx(inv, ["avx512f"]) == []
