"""The import graph: layers that point down and a product that never imports the lab (the
import-linter contracts in pyproject.toml), no cycles between modules, and no module importing
another package's private module (`pkg._x` belongs to `pkg`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("snapguard", "snapguard_lab")


def test_import_linter_contracts_hold() -> None:
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "2 kept, 0 broken" in out.stdout


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
