"""TOML out: the writer of the drop-in, and the in-place edit of the main config's `imports`.

dump_toml() writes a whole table (checked by reading it back equal); set_imports() changes one
top-level key of a file it did not write, every other line as it was.
"""

from __future__ import annotations

import re

try:
    import tomllib
except ImportError:  # Python < 3.11: the same parser, as the tomli package
    import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
from typing import Any

from .base import fail

__all__ = ["dump_toml", "set_imports", "toml_value"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_str(k)


def toml_value(v: Any) -> str:
    """`v` as a TOML value (inline tables and arrays included)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v in (float("inf"), float("-inf")):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    if hasattr(v, "isoformat"):
        return v.isoformat()
    raise fail(f"cannot write a TOML value of type {type(v).__name__}")


def dump_toml(data: dict[str, Any]) -> str:
    """TOML text for `data` (scalars of a table before its sub-tables); tomllib reads it back equal."""
    lines: list[str] = []

    def table(path: list[str], d: dict[str, Any]) -> None:
        scalars = [(k, v) for k, v in d.items() if not isinstance(v, dict)]
        tables = [(k, v) for k, v in d.items() if isinstance(v, dict)]
        if path and (scalars or not tables):
            if lines:
                lines.append("")
            lines.append("[" + ".".join(_toml_key(p) for p in path) + "]")
        for k, v in scalars:
            lines.append(f"{'  ' * min(len(path), 1)}{_toml_key(k)} = {toml_value(v)}")
        for k, v in tables:
            table([*path, k], v)

    table([], data)
    text = "\n".join(lines) + "\n"
    if tomllib.loads(text) != data:
        raise fail("internal error: the TOML written does not read back equal")
    return text


# --- the imports line of the main config

_HEADER = re.compile(r"^\s*\[")


_IMPORTS_KEY = re.compile(r"""^\s*(imports|"imports"|'imports')\s*=""")


_VERSION_KEY = re.compile(r"""^\s*(version|"version"|'version')\s*=""")


def _loads_ok(text: str) -> bool:
    try:
        tomllib.loads(text)
        return True
    except tomllib.TOMLDecodeError:
        return False


def _top_level_end(lines: list[str]) -> int:
    """Index of the first table header that is not inside a multi-line value."""
    for i, line in enumerate(lines):
        if _HEADER.match(line) and _loads_ok("".join(lines[:i])):
            return i
    return len(lines)


def _key_span(lines: list[str], key: re.Pattern[str], end: int) -> tuple[int, int] | None:
    for i in range(end):
        if key.match(lines[i]) and _loads_ok("".join(lines[:i])):
            for j in range(i + 1, end + 1):
                if _loads_ok("".join(lines[i:j])):
                    return i, j
    return None


def set_imports(text: str, imports: list[str] | None) -> str:
    """`text` with its top-level `imports` set to `imports` (None: the key removed), every other
    line as it was; checked by reading both back."""
    before = tomllib.loads(text)
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    end = _top_level_end(lines)
    span = _key_span(lines, _IMPORTS_KEY, end)
    new = [] if imports is None else [f"imports = {toml_value(imports)}\n"]
    if span is not None:
        lines[span[0]:span[1]] = new
    elif new:
        version = _key_span(lines, _VERSION_KEY, end)
        at = version[1] if version is not None else 0
        lines[at:at] = new
    out = "".join(lines)
    expected = dict(before)
    if imports is None:
        expected.pop("imports", None)
    else:
        expected["imports"] = imports
    if tomllib.loads(out) != expected:
        raise fail("cannot edit `imports` of containerd's config in place; add the drop-in to it by hand")
    return out
