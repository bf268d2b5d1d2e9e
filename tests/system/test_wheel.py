"""The wheel built from the repository (not editable) is the product: it carries everything snapguard
needs at run time (the take point's sitecustomize, the manifest schema, py.typed, the C helper built
for the stable ABI and tagged abi3, the pass-through launcher's C sources for `snapguard install`),
`snapguard install` from a fresh venv installed from it builds the launcher and makes it containerd's
BinaryName where a compiler exists, and that venv runs the take-point flow of
test_container_take.py: a PyTorch job in a runc container, its hook and snapguard imported from that
install alone, held at a step boundary by that install's snapguard-runc, checkpointed, restored and
continuing bit for bit."""

from __future__ import annotations

import email.parser
import io
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from snapguard_lab.bundles import host_bundle, release_mounts
from snapguard_lab.ddp import DDP_LAUNCH, DdpJob
from tests.launcher_compiler import pinned_compiler_usable

REPO = Path(__file__).resolve().parents[2]
STEPS = 80
RUNTIME_FILES = ["snapguard/takepoint/site/sitecustomize.py", "snapguard/image/manifest.schema.json", "snapguard/py.typed",
                 "snapguard/_procscan.abi3.so", "snapguard/takepoint/workload/server.py", "snapguard/install/__init__.py",
                 "snapguard/metrics.py", "snapguard/shim/entry.py"]
# the pass-through launcher's sources (c_helpers/), which `snapguard install` compiles on the node;
# setup.py's build_py copies them there (the source tree has no snapguard/_c_helpers)
LAUNCHER_FILES = {"snapguard/_c_helpers/runc_launcher.c": "c_helpers/runc_launcher.c",
                  "snapguard/_c_helpers/runc_argv_table.h": "c_helpers/runc_argv_table.h"}


SOURCES = ["pyproject.toml", "setup.py", "README.md", "snapguard", "c_helpers"]


def build_wheel(out: Path, python: str = sys.executable) -> Path:
    """`pip wheel` of the repository's product sources, copied first: an in-tree build reuses
    whatever an earlier build left in build/ (and the editable install's helper in snapguard/).
    Without build isolation where this venv has the build tools (no download), else isolated."""
    src = out / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.so", "_build", "*.egg-info"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    probe = subprocess.run([python, "-c", "import cffi, setuptools; assert int(setuptools.__version__.split('.')[0]) >= 77"],
                           capture_output=True)
    isolation = ["--no-build-isolation"] if probe.returncode == 0 else []
    built = subprocess.run([python, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", *isolation,
                            "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = out.glob("snapguard-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A new venv (this interpreter's base Python) with the wheel and its dependencies from the index."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    base = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          "--no-input", f"{wheel}[metrics]"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return venv


def _site(venv: Path) -> Path:
    (site,) = venv.glob("lib/python3*/site-packages")
    return site


def test_wheel_is_abi3_and_carries_the_runtime_files(wheel: Path) -> None:
    assert "-cp310-abi3-linux_x86_64" in wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = email.parser.Parser().parsestr(zf.read("snapguard-0.1.0.dist-info/METADATA").decode())
        tags = email.parser.Parser().parsestr(zf.read("snapguard-0.1.0.dist-info/WHEEL").decode()).get_all("Tag")
        entry_points = zf.read("snapguard-0.1.0.dist-info/entry_points.txt").decode()
        so = zf.read("snapguard/_procscan.abi3.so")
    assert tags == ["cp310-abi3-linux_x86_64"]
    assert [f for f in [*RUNTIME_FILES, *LAUNCHER_FILES] if f not in names] == []
    with zipfile.ZipFile(wheel) as zf:
        for name, source in LAUNCHER_FILES.items():
            assert zf.read(name) == (REPO / source).read_bytes(), name
    assert not (REPO / "snapguard" / "_c_helpers").exists()
    # every module of the product, in every package (a package left out of the list broke the install)
    modules = {str(p.relative_to(REPO)) for p in (REPO / "snapguard").rglob("*.py") if "__pycache__" not in p.parts}
    assert sorted(modules - names) == []
    assert not [n for n in names if n.endswith(".so") and "abi3" not in n]  # no version-specific build
    for script in ("snapguard = snapguard.cli:main", "snapguard-runc = snapguard.shim.entry:main",
                   "snapguard-cuda-checkpoint = snapguard.cuda_tool:main"):
        assert script in entry_points
    assert any(r.startswith("prometheus_client") and "extra == \"metrics\"" in r for r in meta.get_all("Requires-Dist"))
    # built for the stable ABI: the only private CPython symbol it may use is Py_DECREF's _Py_Dealloc
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    elf = ELFFile(io.BytesIO(so))
    undefined = {s.name for sec in elf.iter_sections() if sec.name == ".dynsym" for s in sec.iter_symbols()
                 if s["st_shndx"] == "SHN_UNDEF"}
    assert any(n.startswith("Py") for n in undefined)
    assert sorted(n for n in undefined if n.startswith("_Py") and n != "_Py_Dealloc") == []
    assert not any(isinstance(sec, DynamicSection) and any(t.entry.d_tag in ("DT_RPATH", "DT_RUNPATH")
                                                         for t in sec.iter_tags()) for sec in elf.iter_sections())


def test_fresh_install_runs_from_itself(fresh: Path) -> None:
    py = str(fresh / "bin" / "python")
    out = subprocess.run([py, "-c", "import json, snapguard, snapguard._procscan, snapguard.takepoint as h, os, importlib.resources as r;"
                          "print(json.dumps([snapguard.__file__, h.site_dir(), os.listdir(h.site_dir()),"
                          "r.files('snapguard.image').joinpath('manifest.schema.json').is_file()]))"],
                         capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    module, site_dir, listing, schema = json.loads(out.stdout)
    assert module.startswith(str(_site(fresh))) and "sitecustomize.py" in listing and schema
    version = subprocess.run([str(fresh / "bin" / "snapguard"), "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.strip() == "snapguard 0.1.0"
    reasons = subprocess.run([str(fresh / "bin" / "snapguard"), "reasons", "--json"], capture_output=True, text=True,
                             timeout=60)
    assert any(r["reason"] == "TAKE_POINT_TIMEOUT" for r in json.loads(reasons.stdout))


@pytest.mark.root
def test_snapguard_install_from_the_wheel_builds_the_launcher(fresh: Path, tmp_path: Path) -> None:
    """The wheel's `snapguard install` finds the launcher's sources in its own site-packages (not the
    repository's c_helpers/) and, where the pinned compiler exists, compiles the launcher beside the
    install's snapguard-runc and makes it the drop-in's BinaryName; --no-launcher takes it out."""
    if os.geteuid() != 0:
        pytest.fail("snapguard install writes root's files (CI and the README's test command run as root)")
    found = subprocess.run([str(fresh / "bin" / "python"), "-c",
                            "from snapguard import install; print(install.launcher_source_dir())"],
                           capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert found.stdout.strip() == str(_site(fresh) / "snapguard" / "_c_helpers"), found.stderr
    main = tmp_path / "etc" / "containerd" / "config.toml"
    main.parent.mkdir(parents=True)
    main.write_text('version = 2\n\n[plugins."io.containerd.grpc.v1.cri".cni]\n  conf_dir = "/etc/cni/net.d"\n')
    conf = tmp_path / "etc" / "snapguard" / "config.toml"
    args = [str(fresh / "bin" / "snapguard"), "install", "--containerd-config", str(main), "--config", str(conf),
            "--state-file", str(tmp_path / "var" / "install.json")]
    dropin = main.parent / "conf.d" / "99-snapguard.toml"
    launcher = fresh / "bin" / "snapguard-runc-launcher"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*args, *extra], capture_output=True, text=True, timeout=120, env=env, cwd="/")

    def binary_name() -> str:
        data = tomllib.loads(dropin.read_text())
        return data["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["snapguard"]["options"][
            "BinaryName"]

    if pinned_compiler_usable():
        out = run("--json")
        assert out.returncode == 0, out.stderr
        facts = json.loads(out.stdout)["facts"]
        assert facts["binary_name"] == facts["launcher"] == str(launcher) == binary_name()
        st = os.stat(launcher)
        assert (st.st_mode & 0o7777, st.st_uid) == (0o755, 0)
        assert (conf.parent / "runc-launcher.pin").is_file()
        # a pass-through verb goes to the config's runc without Python: `--version` is runc's own
        ver = subprocess.run([str(launcher), "--version"], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/nonexistent", "SNAPGUARD_CONFIG": str(conf)})
        assert ver.returncode == 0 and "runc version" in ver.stdout, ver.stdout + ver.stderr
    else:  # the default is the launcher where it can be built: without a compiler, a note and Python
        out = run("--json")
        assert out.returncode == 0, out.stderr
        assert binary_name() == str(fresh / "bin" / "snapguard-runc") and not launcher.exists()
        assert any("no C compiler at" in n for n in json.loads(out.stdout)["notes"]), out.stdout
        demanded = run("--launcher")
        assert demanded.returncode == 2 and "no C compiler at" in demanded.stderr, demanded.stderr
    dropped = run("--no-launcher")
    assert dropped.returncode == 0, dropped.stderr
    assert not launcher.exists() and not (conf.parent / "runc-launcher.pin").exists()
    assert binary_name() == str(fresh / "bin" / "snapguard-runc")
    undo = run("--uninstall")
    assert undo.returncode == 0, undo.stderr
    assert not dropin.exists() and not conf.exists()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> DdpJob:
    pytest.importorskip("torch")
    return DdpJob(tmp_path_factory.mktemp("reference"), 1, STEPS).run_uninterrupted()


@pytest.mark.stack
def test_take_point_from_the_wheel_install(tmp_path: Path, fresh: Path, reference: DdpJob) -> None:
    """test_container_take's stop + restore, with everything snapguard from the fresh install: the
    trainer (this venv's Python, for torch) sees only the install's site-packages, not the
    repository, and the executor is the install's snapguard-runc."""
    if os.geteuid() != 0:
        pytest.fail("runc containers need root (CI and the README's test command run as root)")
    site = _site(fresh)
    hooks = site / "snapguard" / "takepoint" / "site"
    out = tmp_path / "out"
    out.mkdir()
    job = DdpJob(out, 1, STEPS)
    # the trainer's interpreter and torch (this venv, inside the repository: only the venv is bound),
    # the workload, and the fresh install; not the repository, so the hook cannot come from there
    venv = Path(sys.prefix)
    host_dirs = ["/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", sys.base_prefix, str(venv), str(DDP_LAUNCH.parent),
                 str(fresh)]
    args = [str(venv / "bin" / "python"), str(DDP_LAUNCH), "--world", "1", "--out", "/out", "--steps", str(STEPS)]
    env = ["PATH=/usr/bin:/bin", "HOME=/root", "PYTHONWARNINGS=ignore", f"PYTHONPATH={hooks}:{site}",
           "SNAPGUARD_TAKE_DIR=/run/snapguard/take"]
    bundle = host_bundle(tmp_path / "bundle", args, env, host_dirs, writable={"/out": str(out)})
    assert not (bundle / "rootfs" / str(REPO / "snapguard").lstrip("/")).exists()
    root, cid = tmp_path / "runc", f"wheel-{os.getpid()}"
    executor = [str(fresh / "bin" / "snapguard-runc"), "--root", str(root)]
    env_host = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
                "SNAPGUARD_STATE_DIR": str(tmp_path / "state")}
    assert subprocess.run([*executor, "run", "--detach", "--bundle", str(bundle), cid], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, env=env_host).returncode == 0
    try:
        job.wait_step(5)
        image, work = tmp_path / "image", tmp_path / "work"
        ck = subprocess.run([*executor, "checkpoint", "--image-path", str(image), "--work-path", str(work),
                             "--tcp-established", cid], capture_output=True, text=True, timeout=120, env=env_host)
        assert ck.returncode == 0, ck.stderr
        result = json.loads((work / "snapguard-result.json").read_text())
        (figures,) = result["take_point"].values()
        assert figures["ok"] and figures["step"] >= 6
        rs = subprocess.run([*executor, "restore", "--image-path", str(image), "--work-path",
                             str(tmp_path / "restore-work"), "--bundle", str(bundle), "--detach",
                             "--tcp-established", cid], capture_output=True, text=True, timeout=120, env=env_host,
                            stdin=subprocess.DEVNULL)
        assert rs.returncode == 0, rs.stderr
        assert job.mismatches(reference) == []
    finally:
        subprocess.run(["/usr/sbin/runc", "--root", str(root), "delete", "--force", cid], capture_output=True)
        release_mounts(bundle)
