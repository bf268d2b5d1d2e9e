"""The take point's protocol: the executor's request lines read back as the trainer reads them, and
the two ends tied by nothing but snapguard.takepoint.protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from snapguard.takepoint import protocol

TAKEPOINT = Path(protocol.__file__).resolve().parent


@pytest.mark.parametrize(("wait_s", "spill", "at"), [(10.0, False, None), (2.5, True, None), (30.0, True, 7),
                                                     (5.0, False, 12)])
def test_a_take_request_reads_back_as_it_was_asked(wait_s: float, spill: bool, at: int | None) -> None:
    line = protocol.take_request(wait_s, spill, at)
    assert line.endswith("\n") and len(line) < protocol.MAX_REQUEST
    words = line.split()
    assert words[0] == (protocol.TAKE if at is None else protocol.TAKE_AT)
    read = protocol.parse_take(words)
    assert (read.at, read.wait_s, read.spill) == (at, wait_s, spill)


def test_a_take_without_its_wait_waits_the_default() -> None:
    read = protocol.parse_take([protocol.TAKE])
    assert (read.at, read.wait_s, read.spill) == (None, protocol.DEFAULT_WAIT_S, False)


def test_the_other_requests_are_one_word() -> None:
    assert protocol.status_request().split() == [protocol.STATUS]
    assert protocol.release_request().split() == [protocol.RELEASE]


def _snapguard_imports(path: Path) -> set[str]:
    """The snapguard modules (or names in them) a file imports, relative imports resolved."""
    package = ["snapguard", *path.relative_to(TAKEPOINT.parent).parent.parts]  # the file's package
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            if node.module:
                out.add(".".join([*base, node.module]))
            else:  # `from .. import x`: the module x of that package
                out |= {".".join([*base, a.name]) for a in node.names}
    return {m for m in out if m.split(".")[0] == "snapguard"}


def test_the_workload_side_imports_nothing_of_snapguard_but_the_protocol() -> None:
    workload = [*sorted((TAKEPOINT / "workload").glob("*.py")), TAKEPOINT / "site" / "sitecustomize.py",
                TAKEPOINT / "__init__.py"]
    assert len(workload) > 8
    ours = ("snapguard.takepoint", "snapguard.takepoint.protocol", "snapguard.takepoint.workload")
    outside = {f"{p.relative_to(TAKEPOINT)}: {m}" for p in workload for m in _snapguard_imports(p)
               if m not in ours and not m.startswith("snapguard.takepoint.workload.")}
    assert outside == set()


def test_the_import_check_resolves_relative_imports() -> None:
    assert _snapguard_imports(TAKEPOINT / "workload" / "forks.py") == {
        "snapguard.takepoint.protocol", "snapguard.takepoint.workload.libc"}
    assert "snapguard.procfs" in _snapguard_imports(TAKEPOINT / "spill_paths.py")  # the executor's side may
