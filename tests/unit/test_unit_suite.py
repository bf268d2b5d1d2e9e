"""tests/unit runs as any user: none of its tests is marked for root, the real stack or a GPU (those
live in tests/system), and none skips or fails for want of root."""

from __future__ import annotations

import re
from pathlib import Path

UNIT = Path(__file__).resolve().parent
ROOT_GATE = re.compile(r"skipif\(\s*os\.geteuid\(\)|if os\.geteuid\(\) != 0:\s*\n\s*pytest\.(skip|fail)\(")
MARKED = re.compile(r"pytest\.mark\.(root|stack|gpu)\b")


def test_no_unit_test_needs_root_the_stack_or_a_gpu() -> None:
    offences = []
    for path in sorted(UNIT.glob("*.py")):
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        offences += [f"{path.name}: {m.group(0)!r}" for m in ROOT_GATE.finditer(text)]
        offences += [f"{path.name}: {m.group(0)!r}" for m in MARKED.finditer(text)]
    assert offences == [], "move these to tests/system, marked root, stack or gpu"


def test_the_check_can_fail() -> None:
    assert ROOT_GATE.search('needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="x")')
    assert ROOT_GATE.search('    if os.geteuid() != 0:\n        pytest.skip("mknod needs root")')
    assert MARKED.search("pytestmark = pytest.mark.stack")
