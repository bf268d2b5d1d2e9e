"""The lab (lab/: snapguard_lab, the drills, the test rig, the example workloads) stands apart from
the product: snapguard never imports it, its workloads are package data, and `snapguard-lab` is
installed beside this Python with its help and typed usage errors."""

from __future__ import annotations

import ast
import fnmatch
import os
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest

import snapguard
from snapguard_lab import workloads

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PRODUCT = Path(snapguard.__file__).resolve().parent
LAB_PYPROJECT = Path(__file__).resolve().parents[2] / "lab" / "pyproject.toml"


def _lab_imports(path: Path) -> list[str]:
    """Where a module imports snapguard_lab: import statements, and __import__/import_module calls."""
    found = []
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"{path.relative_to(PRODUCT.parent)}:{node.lineno}: {n}" for n in names
                  if n == "snapguard_lab" or n.startswith("snapguard_lab.")]
    return found


def test_product_never_imports_the_lab() -> None:
    modules = sorted(PRODUCT.rglob("*.py"))
    assert len(modules) > 20, f"found only {len(modules)} modules under {PRODUCT}"
    assert [hit for m in modules for hit in _lab_imports(m)] == []


def test_lab_uses_only_public_product_modules() -> None:
    public = {"snapguard", "snapguard.config", "snapguard.reasons", "snapguard.takepoint", "snapguard.pipeline",
              "snapguard.notice", "snapguard.store", "snapguard.plan",  # the goodput drill: agent, store, planner
              "snapguard.gpu_suspend"}  # its context parity: the executor's own lock + checkpoint + restore
    lab_dir = workloads.path().parent
    used = set()
    for module in lab_dir.rglob("*.py"):
        if "workloads" in module.relative_to(lab_dir).parts:
            continue  # the workloads run as scripts, not as the lab's modules
        for node in ast.walk(ast.parse(module.read_bytes(), str(module))):
            if isinstance(node, ast.Import):
                used |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                used.add(node.module)
                # `from snapguard import cuda` uses the module snapguard.cuda, not only the package
                used |= {f"{node.module}.{a.name}" for a in node.names
                         if _is_product_module(f"{node.module}.{a.name}")}
    assert "snapguard.gpu_suspend" in used  # the check sees `from snapguard import X`
    assert {m for m in used if m.split(".")[0] == "snapguard"} <= public


def _is_product_module(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "snapguard":
        return False
    path = PRODUCT.joinpath(*parts[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_the_drills_left_the_product() -> None:
    assert [n for n in ("testbed.py", "drill.py", "torch_drill.py") if (PRODUCT / n).exists()] == []


@pytest.mark.parametrize("parts", [("counter", "counter.sh"), ("torch", "train.py"), ("ddp", "launch.py"),
                                   ("ddp", "train.py")])
def test_workloads_are_package_data(parts: tuple[str, ...]) -> None:
    resource = files("snapguard_lab.workloads")
    for part in parts:
        resource = resource / part
    assert resource.is_file()
    found = workloads.path(*parts)
    assert found.is_absolute() and found.is_file()
    assert found == Path(os.fspath(resource)).resolve()
    assert PRODUCT not in found.parents  # not found in (or through) the product's tree


def test_every_workload_file_is_declared_package_data() -> None:
    """A wheel of the lab carries what lab/pyproject.toml declares, and nothing else."""
    globs = tomllib.loads(LAB_PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]["snapguard_lab.workloads"]
    root = workloads.path()
    shipped = [p.relative_to(root).as_posix() for p in root.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc" and p.name != "__init__.py"]
    assert shipped and [f for f in shipped if not any(fnmatch.fnmatch(f, g) for g in globs)] == []


def test_lab_modules_find_their_workloads() -> None:
    from snapguard_lab import ddp, testbed

    assert testbed.COUNTER_SCRIPT == workloads.path("counter", "counter.sh")
    assert ddp.DDP_LAUNCH == workloads.path("ddp", "launch.py")


def lab(*args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "snapguard-lab")
    if not os.path.exists(exe):
        pytest.fail(f"snapguard-lab is not installed next to {sys.executable}: pip install -e ./lab")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [["--help"], ["drill", "--help"]])
def test_help_explains(args: list[str]) -> None:
    out = lab(*args)
    assert out.returncode == 0, out.stderr
    assert "drill" in out.stdout and out.stderr == ""
    if args[0] == "drill":
        for flag in ("--workload", "--json", "--workdir", "--steps", "--at", "--arms"):
            assert flag in out.stdout


@pytest.mark.parametrize("args", [["drill", "--arms", "bogus", "--workload", "torch"],
                                  ["drill", "--workload", "torch", "--at", "300"],
                                  ["drill", "--workload", "gpu"], ["nope"], []])
def test_usage_errors_are_one_typed_line(args: list[str]) -> None:
    out = lab(*args)
    assert out.returncode == 2
    assert out.stderr.startswith("snapguard-lab USAGE_ERROR: ") and out.stderr.count("\n") == 1, out.stderr
    assert out.stdout == ""
