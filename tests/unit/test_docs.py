"""The documentation: the generated reference matches the code, the site builds with
`mkdocs build --strict` (every nav entry exists, every relative link and anchor resolves), the
README stays a short front door with the two commands, the prose narrates no history, and every
repository path the pages name in backticks exists."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
COMMANDS = (
    "./packaging/setup.sh && .venv/bin/snapguard drill",
    "./packaging/setup.sh && .venv/bin/python -m pytest",
)


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks, indented code blocks or inline code spans."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`\n]*`", "", text)


def test_reference_is_not_stale() -> None:
    gen = _generator()
    stale = gen.stale()
    assert not stale, ("docs/reference is stale: " + ", ".join(stale)
                       + "; run .venv/bin/python docs/gen_reference.py")


def test_every_environment_variable_is_described() -> None:
    text = _generator().render_environment()
    assert "not described" not in text, [line for line in text.splitlines() if "not described" in line]


def test_every_reason_has_a_runbook_entry() -> None:
    from snapguard.reasons import Reason

    runbook = (DOCS / "operations.md").read_text(encoding="utf-8")
    table = (DOCS / "reference" / "reasons.md").read_text(encoding="utf-8")
    missing = [r.name for r in Reason if f"#### {r.name}\n" not in runbook or f"[`{r.name}`]" not in table]
    assert not missing, missing


def test_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "reasons" / "index.html").is_file()


def test_readme_is_a_front_door() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for command in COMMANDS:
        assert command in text, command
    assert "../shared" not in text


HISTORY = [
    re.compile(r"\b[Rr]uns? \d+[a-z]?\b"),          # "run 14d", "runs 13a-13e"
    re.compile(r"\b[Ii]ssue #?\d+"),                # "issue 12's targets"
    re.compile(r"\bEarlier runs\b"),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),            # dated narratives (dates in result paths are code)
]


@pytest.mark.parametrize("path", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_prose_narrates_no_history(path: Path) -> None:
    prose = _prose(path.read_text(encoding="utf-8"))
    hits = [m.group(0) for pattern in HISTORY for m in pattern.finditer(prose)]
    assert not hits, hits


# paths a built package has that a checkout does not
ONLY_IN_PACKAGES = {"snapguard/_c_helpers/"}
PATH_IN_CODE = re.compile(r"`((?:snapguard|lab|tests|packaging|c_helpers|docs|bench/gpu)/[A-Za-z0-9_./-]*)`")


@pytest.mark.parametrize("path", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_named_paths_exist(path: Path) -> None:
    missing = []
    for m in PATH_IN_CODE.finditer(path.read_text(encoding="utf-8")):
        name = m.group(1)
        if name in ONLY_IN_PACKAGES or not (REPO / name.rstrip("/")).exists():
            if name not in ONLY_IN_PACKAGES:
                missing.append(name)
    assert not missing, missing


DOTTED_IN_CODE = re.compile(r"`(snapguard(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")


def _resolves(dotted: str) -> bool:
    """A module, or an attribute of the longest module prefix (`snapguard.reasons.Reason`)."""
    try:
        if importlib.util.find_spec(dotted) is not None:  # a module: found, not run
            return True
    except ImportError:
        pass
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("path", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_named_modules_exist(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    missing = sorted({m.group(1) for m in DOTTED_IN_CODE.finditer(text) if not _resolves(m.group(1))})
    assert not missing, missing
