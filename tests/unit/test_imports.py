"""The import graph: layers that point down, a take point whose workload side (it runs inside the
user's trainer) imports nothing of snapguard but the take point's protocol, and a product that
never imports the lab (the import-linter contracts in pyproject.toml); no cycles between modules,
and no module importing another package's private module (`pkg._x` belongs to `pkg`)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("snapguard", "snapguard_lab", cache_dir=None)  # nothing written: any user runs it


def test_import_linter_contracts_hold() -> None:
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "3 kept, 0 broken" in out.stdout


# what the trainer's interpreter loads of snapguard: the packages on the way and the protocol
WORKLOAD_MAY_LOAD = {"snapguard", "snapguard.takepoint", "snapguard.takepoint.protocol"}


def test_the_take_points_package_imports_only_its_protocol_and_workload_side(graph: grimp.ImportGraph) -> None:
    """Importing snapguard.takepoint.protocol runs the package's __init__ first: it stays light."""
    assert graph.find_modules_directly_imported_by("snapguard.takepoint") <= {
        "snapguard.takepoint.protocol", "snapguard.takepoint.workload"}
    assert {i for i in graph.find_modules_directly_imported_by("snapguard.takepoint.protocol")
            if i.startswith("snapguard")} == set()
    assert graph.find_modules_directly_imported_by("snapguard") == set()


def test_the_site_hook_imports_the_take_points_face_alone() -> None:
    """sitecustomize (a directory put on the trainer's PYTHONPATH, not a package import-linter
    sees) imports of snapguard the take point's package and its protocol, nothing else."""
    site = REPO / "snapguard" / "takepoint" / "site" / "sitecustomize.py"
    imported = set()
    for node in ast.walk(ast.parse(site.read_text(), str(site))):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    ours = {m for m in imported if m == "snapguard" or m.startswith("snapguard.")}
    assert ours and ours <= {"snapguard.takepoint", "snapguard.takepoint.protocol"}, ours


def test_the_workload_side_loads_nothing_of_snapguard_but_the_protocol() -> None:
    """In a fresh interpreter, as in the trainer: the workload side and what it pulls in."""
    code = ("import sys, snapguard.takepoint.workload\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] == 'snapguard')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert "snapguard.takepoint.workload" in loaded
    assert {m for m in loaded if not m.startswith("snapguard.takepoint.workload")} <= WORKLOAD_MAY_LOAD, loaded


def _owner_of_private(module: str) -> str | None:
    """The package a private module belongs to (`a.b._c.d` -> `a.b`), None if nothing is private."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def test_no_module_imports_another_packages_private_module(graph: grimp.ImportGraph) -> None:
    offences = []
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            owner = _owner_of_private(imported)
            if owner is not None and not (importer == owner or importer.startswith(owner + ".")):
                offences.append(f"{importer} imports {imported}")
    assert offences == []


def test_the_private_module_rule_can_fail() -> None:
    assert _owner_of_private("snapguard.cuda._symbols") == "snapguard.cuda"
    assert _owner_of_private("snapguard.preflight.workload") is None


def test_no_import_cycles(graph: grimp.ImportGraph) -> None:
    modules = sorted(m for m in graph.modules if m.startswith(("snapguard.", "snapguard_lab.")))
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i in modules and i != m} for m in modules}
    # a package's __init__ re-exporting its own submodules is not a cycle between modules
    cycles = []
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in edges[m]:
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                if not all(c.startswith(cycle[0] + ".") or cycle[0].startswith(c + ".") or c == cycle[0]
                           for c in cycle):
                    cycles.append(" -> ".join(cycle))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in modules:
        if m not in state:
            visit(m, [m])
    assert cycles == []
