"""GPU-side logic that runs without a GPU: image-vs-host GPU comparison, the driver checks on
fixture facts, libcuda's exported symbols read from a real ELF, and the cuda-checkpoint CLI's
contract with CRIU's plugin. (The driver calls themselves ran on the H200: bench/results/h200/.)"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cffi import FFI

from snapguard.cuda import CHECKPOINT_SYMBOLS, libcuda_checkpoint_symbols, uuid_bytes
from snapguard.cuda._driver import _CDEF
from snapguard.preflight import gpu
from snapguard.reasons import Reason, Severity

H200 = {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-8c3b4b7e-1111-2222-3333-444455556666",
        "pci_bus_id": "00000000:00:06.0", "minor": 0, "compute_capability": "9.0",
        "memory_total": 150_323_855_360, "memory_free": 150_000_000_000, "persistence_mode": True,
        "mig_mode": False, "processes": {}}
HOST = {"driver_version": "580.159.04", "cuda_driver_version": 13000, "gpus": [H200]}


def image_of(host: dict, used: int = 4 << 30) -> dict:
    img = gpu.image_gpu_facts(copy.deepcopy(host), [])
    for g in img["gpus"]:
        g["used_by_image"] = used
    return img


def reasons(findings) -> set[Reason]:
    return {f.reason for f in findings}


def test_same_host_restores() -> None:
    assert gpu.compare_gpu(image_of(HOST), HOST) == []


def test_model_driver_count_and_memory() -> None:
    img = image_of(HOST)
    h100 = copy.deepcopy(HOST)
    h100["gpus"][0]["name"] = "NVIDIA H100 80GB HBM3"
    f = gpu.compare_gpu(img, h100)
    assert reasons(f) == {Reason.GPU_MODEL_MISMATCH}
    assert f[0].detail == "image taken on NVIDIA H200, this host has NVIDIA H100 80GB HBM3"
    other_driver = copy.deepcopy(HOST)
    other_driver["driver_version"] = "575.51.03"
    assert reasons(gpu.compare_gpu(img, other_driver)) == {Reason.DRIVER_VERSION_MISMATCH}
    two = copy.deepcopy(HOST)
    two["gpus"].append(dict(H200, index=1, uuid="GPU-00000000-0000-0000-0000-000000000001"))
    assert reasons(gpu.compare_gpu(image_of(two), HOST)) == {Reason.GPU_COUNT_MISMATCH}
    full = copy.deepcopy(HOST)
    full["gpus"][0]["memory_free"] = 1 << 30
    assert reasons(gpu.compare_gpu(img, full)) == {Reason.GPU_MEMORY_INSUFFICIENT}
    assert reasons(gpu.compare_gpu(img, None)) == {Reason.GPU_COUNT_MISMATCH}


def test_other_gpu_same_model_gets_a_device_map() -> None:
    other = copy.deepcopy(HOST)
    other["gpus"][0]["uuid"] = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    (f,) = gpu.compare_gpu(image_of(HOST), other)
    assert f.reason is Reason.GPU_IDENTITY_MISMATCH and f.severity is Severity.WARNING
    assert f.evidence["device_map"] == [(H200["uuid"], other["gpus"][0]["uuid"])]


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two real shared objects: one exporting the checkpoint API's names, one an older driver's."""
    d = tmp_path_factory.mktemp("libcuda")
    full, old = d / "full.c", d / "old.c"
    full.write_text("".join(f"int {s}(void) {{ return 0; }}\n" for s in CHECKPOINT_SYMBOLS))
    old.write_text("int cuInit(void) { return 0; }\nint cuCheckpointProcessLock;\n")
    for src in (full, old):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(src.with_suffix(".so")), str(src)], check=True)
    return full.with_suffix(".so"), old.with_suffix(".so")


def test_checkpoint_symbols_read_from_elf(fake_libcuda: tuple[Path, Path]) -> None:
    full, old = fake_libcuda
    assert all(libcuda_checkpoint_symbols(str(full)).values())
    # a data object of the same name is not the function
    assert not any(libcuda_checkpoint_symbols(str(old)).values())
    with pytest.raises(ValueError, match="not a readable ELF"):
        libcuda_checkpoint_symbols(__file__)


def test_checkpoint_symbols_read_once_per_file_identity(fake_libcuda: tuple[Path, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived process (the agent) parses a libcuda once; one replaced (a driver upgrade) anew."""
    from snapguard.cuda import _symbols

    full, old = fake_libcuda
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(full.read_bytes())
    reads: list[str] = []
    real = _symbols._read_symbols
    monkeypatch.setattr(_symbols, "_read_symbols", lambda path: reads.append(path) or real(path))
    assert all(libcuda_checkpoint_symbols(str(lib)).values())
    assert all(libcuda_checkpoint_symbols(str(lib)).values()) and len(reads) == 1
    replaced = tmp_path / "new"
    replaced.write_bytes(old.read_bytes())
    os.replace(replaced, lib)
    assert not any(libcuda_checkpoint_symbols(str(lib)).values()) and len(reads) == 2


def test_driver_checks(fake_libcuda: tuple[Path, Path]) -> None:
    full, old = fake_libcuda
    assert gpu.check_driver(HOST, str(full)) == []
    (f,) = gpu.check_driver(HOST, str(old))
    assert f.reason is Reason.DRIVER_TOO_OLD and "cuCheckpointProcessLock" in f.evidence["missing"]
    mig = copy.deepcopy(HOST)
    mig["gpus"][0].update(mig_mode=True, persistence_mode=False)
    assert reasons(gpu.check_driver(mig, str(full))) == {Reason.MIG_UNSUPPORTED, Reason.PERSISTENCE_MODE_OFF}
    assert gpu.check_driver(None, None) == []


def test_driver_struct_layout_matches_cuda_13_header() -> None:
    ffi = FFI()
    ffi.cdef(_CDEF)
    for name in ("CUcheckpointLockArgs", "CUcheckpointCheckpointArgs", "CUcheckpointRestoreArgs",
                 "CUcheckpointUnlockArgs"):
        assert ffi.sizeof(name) == 64, name
    assert ffi.offsetof("CUcheckpointRestoreArgs", "gpuPairsCount") == 8
    assert ffi.offsetof("CUcheckpointRestoreArgs", "reserved1") == 56
    assert ffi.sizeof("CUcheckpointGpuPair") == 32


def test_uuid_bytes() -> None:
    assert uuid_bytes("GPU-00112233-4455-6677-8899-aabbccddeeff") == bytes.fromhex("00112233445566778899aabbccddeeff")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "snapguard-cuda-checkpoint")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LD_LIBRARY_PATH": ""})


def test_cli_contract_with_criu_plugin() -> None:
    assert "--action" in cli("-h").stdout  # the plugin's capability probe
    out = cli("--get-restore-tid", "--pid", "1")
    # no driver here: a non-zero exit, which the plugin reads as "not a CUDA process"
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("cuda-checkpoint: cannot load the CUDA driver")
    assert cli("--action", "lock").returncode == 2
    bad = cli("--action", "restore", "--pid", "1", "--device-map", "GPU-a")
    assert bad.returncode == 2 and "OLD_UUID=NEW_UUID" in bad.stderr
    assert cli("--action", "freeze", "--pid", "1").returncode == 2


def test_device_map_from_environment_is_parsed() -> None:
    """CRIU's plugin passes no --device-map: snapguard's cuda-checkpoint takes it from its environment."""
    exe = os.path.join(os.path.dirname(sys.executable), "snapguard-cuda-checkpoint")
    bad = subprocess.run([exe, "--action", "restore", "--pid", "1"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SNAPGUARD_DEVICE_MAP": "GPU-a"})
    assert bad.returncode == 2 and "SNAPGUARD_DEVICE_MAP" in bad.stderr
    good = subprocess.run([exe, "--action", "restore", "--pid", "1"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SNAPGUARD_DEVICE_MAP": "GPU-a=GPU-b", "LD_LIBRARY_PATH": ""})
    assert good.returncode == 1 and "cannot load the CUDA driver" in good.stderr  # parsed, then no driver here
    assert "SNAPGUARD_DEVICE_MAP" in subprocess.run([exe, "-h"], capture_output=True, text=True).stdout


def test_criu_environment_carries_the_device_map(tmp_path: Path) -> None:
    from snapguard import criu

    options = criu.CriuOptions(images_dir=str(tmp_path), work_dir=str(tmp_path), libdir="/usr/local/lib/criu",
                               timeout_s=5)
    with criu.RunDir(str(tmp_path / "state"), "/usr/local/sbin/criu", None) as run_dir:
        env = run_dir.environment(options, [("GPU-a", "GPU-b"), ("GPU-c", "GPU-d")])
        assert env["SNAPGUARD_DEVICE_MAP"] == "GPU-a=GPU-b,GPU-c=GPU-d"
        # a map in the caller's own environment never reaches CRIU's plugin: only the executor's
        assert "SNAPGUARD_DEVICE_MAP" not in run_dir.environment(options, base={"SNAPGUARD_DEVICE_MAP": "x=y"})
        assert os.readlink(os.path.join(env["PATH"].split(":")[0], "criu")) == "/usr/local/sbin/criu"
    assert not os.path.exists(run_dir.path), "a run's private directory outlives it"


def test_cuda_plugin_check_probes_cuda_checkpoint_like_the_plugin(tmp_path: Path) -> None:
    from snapguard.config import load
    from snapguard.preflight.host import check_cuda_plugin

    cfg = tmp_path / "c.toml"
    cfg.write_text('cuda_checkpoint = "/bin/true"\n')
    (f,) = check_cuda_plugin(load({"SNAPGUARD_CONFIG": str(cfg)}), required=True)
    assert f.reason is Reason.CUDA_PLUGIN_UNAVAILABLE and "does not mention --action" in f.detail
    assert f.severity is Severity.BLOCKER
    cfg.write_text(f'cuda_checkpoint = "{tmp_path}/none"\n')  # falls back to snapguard's own
    assert check_cuda_plugin(load({"SNAPGUARD_CONFIG": str(cfg)}), required=True) == []


FAKE_DRIVER = r"""
/* The driver calls Driver makes, with the one behaviour under test: before cuInit a checkpoint
   call answers CUDA_ERROR_NOT_INITIALIZED (3) when built with -DNEEDS_INIT. */
static int initialised, init_calls;
int cuInit(unsigned int flags) { (void)flags; initialised = 1; return ++init_calls, 0; }
int fake_init_calls(void) { return init_calls; }
int cuGetErrorName(int e, const char **s) { (void)e; *s = "CUDA_ERROR_FAKE"; return 0; }
int cuGetErrorString(int e, const char **s) { (void)e; *s = "fake"; return 0; }
int cuCheckpointProcessGetState(int pid, int *state) {
#ifdef NEEDS_INIT
    if (!initialised) return 3;
#endif
    if (pid <= 0) return 1;
    *state = 1;
    return 0;
}
"""


@pytest.mark.parametrize("needs_init", [False, True], ids=["without-cuinit", "needs-cuinit"])
def test_driver_calls_cuinit_only_when_a_call_asks(needs_init: bool, tmp_path: Path) -> None:
    from snapguard.cuda import CudaError, Driver

    src = tmp_path / "fake.c"
    src.write_text(FAKE_DRIVER)
    lib = tmp_path / "libfakecuda.so"
    subprocess.run(["gcc", "-shared", "-fPIC", *(["-DNEEDS_INIT"] if needs_init else []), "-o", str(lib), str(src)],
                   check=True)
    driver = Driver(str(lib))
    driver.ffi.cdef("int fake_init_calls(void);")
    assert driver.state(1234) == "locked"
    assert driver.state(1234) == "locked"
    assert driver.lib.fake_init_calls() == (1 if needs_init else 0)
    with pytest.raises(CudaError, match=r"cuCheckpointProcessGetState \(pid 0\): CUDA_ERROR_FAKE \(1\)"):
        driver.state(0)


def _facts(n_image: int, n_host: int, name: str = "NVIDIA H200") -> object:
    class Report:
        facts = {"manifest": {"gpu": {"gpus": [{"index": i, "uuid": f"GPU-old-{i}", "name": name}
                                               for i in range(n_image)]}},
                 "gpu": {"gpus": [{"index": i, "uuid": f"GPU-new-{i}", "name": "NVIDIA H200"} for i in range(n_host)]}}
    return Report()


def test_device_map_is_completed_into_one_naming_every_gpu_of_the_old_node() -> None:
    from snapguard.devicemap import DeviceMap
    from snapguard.pipeline._devices import resolve_device_map

    def _resolve_device_map(given: tuple, report: object) -> list:  # the image's GPUs and this host's, as the report has them
        return list(resolve_device_map(DeviceMap(given), report.facts["manifest"]["gpu"]["gpus"],  # type: ignore[attr-defined]
                                       report.facts["gpu"]["gpus"]))
    from snapguard.reasons import Reason, SnapguardError

    # driver 580 refuses a map leaving a GPU of the old node out: 0=1 on two GPUs is the swap
    assert _resolve_device_map((("0", "1"),), _facts(2, 2)) == [("GPU-old-0", "GPU-new-1"), ("GPU-old-1", "GPU-new-0")]
    assert _resolve_device_map((("GPU-old-1", "0"),), _facts(2, 2)) == [("GPU-old-1", "GPU-new-0"),
                                                                       ("GPU-old-0", "GPU-new-1")]
    assert _resolve_device_map((("0", "2"),), _facts(1, 4)) == [("GPU-old-0", "GPU-new-2")]
    for given, facts, reason in (((("0", "5"),), _facts(2, 2), Reason.GPU_IDENTITY_MISMATCH),
                                 ((("3", "0"),), _facts(2, 2), Reason.GPU_IDENTITY_MISMATCH),
                                 ((("0", "1"), ("1", "1")), _facts(2, 2), Reason.USAGE_ERROR),
                                 ((("0", "0"),), _facts(2, 1), Reason.GPU_COUNT_MISMATCH),
                                 ((("0", "1"),), _facts(2, 2, name="NVIDIA A100"), Reason.GPU_MODEL_MISMATCH)):
        try:
            _resolve_device_map(given, facts)  # type: ignore[arg-type]
        except SnapguardError as e:
            assert e.reason is reason, (given, e)
        else:
            raise AssertionError(f"{given} was accepted")
