"""Untrusted notice bodies parsed with bounds, then checked against a JSON schema.

A body from a metadata service, an API server or the inbox is bounded in size (`max_bytes`) and
in nesting (`MAX_DEPTH`, counted before `json.loads` runs, so a body nested thousands of levels
deep is refused as NOTICE_MALFORMED, never a RecursionError), then validated against its schema
(snapguard.notice._sources._schemas): the first violation is one line naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ...reasons import SnapguardError
from ._http import malformed

__all__ = ["MAX_DEPTH", "check", "parse"]

MAX_DEPTH = 32  # a Kubernetes Node or Pod is about 8 deep; a metadata answer 3
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(rb"[\[\]{}]")
_validators: dict[int, Any] = {}


def _depth(body: bytes) -> int:
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRINGS.sub(b'""', body)):
        if m.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def parse(name: str, where: str, body: bytes, *, max_bytes: int = 1 << 20, max_depth: int = MAX_DEPTH,
          schema: dict[str, Any] | None = None) -> Any:
    """The JSON document in `body`, refused (NOTICE_MALFORMED) when larger than `max_bytes`,
    nested deeper than `max_depth`, not JSON, or, with `schema`, not of its shape."""
    if len(body) > max_bytes:
        raise malformed(name, where, f"a body of {len(body)} bytes (at most {max_bytes})", body)
    depth = _depth(body)
    if depth > max_depth:
        raise malformed(name, where, f"JSON nested {depth} levels deep (at most {max_depth})", body)
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise malformed(name, where, f"not JSON ({str(e)[:120]})", body) from None
    if schema is not None:
        check(name, where, doc, schema, body)
    return doc


def _validator(schema: dict[str, Any]) -> Any:
    v = _validators.get(id(schema))
    if v is None:
        import jsonschema
        from jsonschema import validators

        base = jsonschema.Draft202012Validator
        base.check_schema(schema)
        # JSON Schema counts 1.0 and true as numbers here and there; a count read from a peer must be an int
        strict = base.TYPE_CHECKER.redefine("integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool))
        v = _validators[id(schema)] = validators.extend(base, type_checker=strict)(schema)
    return v


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out[:120]


def check(name: str, where: str, doc: Any, schema: dict[str, Any], body: bytes | str = b"") -> Any:
    """`doc` when it has `schema`'s shape; else NOTICE_MALFORMED naming the first bad field."""
    from jsonschema.exceptions import best_match

    error = best_match(_validator(schema).iter_errors(doc))
    if error is None:
        return doc
    message = " ".join(str(error.message).split())
    if len(message) > 160:
        message = message[:160] + "..."
    field = _path(error.absolute_path)
    raise malformed(name, where, f"field {field}: {message}" if field else message, body)


def refusal(err: SnapguardError) -> dict[str, Any]:
    """What a journal line says about something refused: the typed reason and its one line."""
    return {"reason": err.reason.name, "detail": err.failure.detail}
