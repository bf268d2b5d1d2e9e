"""Records read back from an image store, parsed as the untrusted input they are.

Anyone who can write to the store can put anything under a key snapguard reads, so every record is
parsed with a size cap (`MAX_RECORD_BYTES`), a nesting bound (`MAX_DEPTH`), no NaN or Infinity,
and then checked against a JSON Schema of the shape snapguard writes (integers are ints, never
1.0 or true). A record that fails any of these is STORE_RECORD_INVALID, one line naming the key
and the first thing wrong; the caller skips it and goes on with the others.

    STORE_RECORD      <job>/images/<name>/snapguard-store.json    epoch, sizes, source
    MARKER            <job>/images/<name>/snapguard-complete.json the manifest's sha256
    FILE_CHECKPOINT   <job>/file-checkpoints/<name>.json          where the file checkpoint is
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..reasons import Reason, SnapguardError

__all__ = ["FILE_CHECKPOINT", "MARKER", "MAX_DEPTH", "MAX_MARKER_BYTES", "MAX_RECORD_BYTES", "STORE_RECORD",
           "load_record", "no_constant", "read_record"]

log = logging.getLogger("snapguard.store")  # what was refused, for the agent's log

MAX_RECORD_BYTES = 1 << 20
MAX_MARKER_BYTES = 4096
MAX_DEPTH = 16
_DETAIL = 200

_SHA256 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_NAME = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"}
_COUNT = {"type": "integer", "minimum": 0}
_TIME = {"type": "number", "minimum": 0}
_HOST = {"type": "string", "maxLength": 255}

STORE_RECORD: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "an image's store record",
    "type": "object",
    "required": ["epoch"],
    "properties": {"epoch": _COUNT, "job": _NAME, "name": _NAME, "files": _COUNT, "image_bytes": _COUNT,
                   "host": _HOST, "time": _TIME, "manifest_sha256": _SHA256},
    "maxProperties": 64,
}
MARKER: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "an image's completion marker",
    "type": "object",
    "required": ["manifest_sha256"],
    "properties": {"manifest_sha256": _SHA256, "schema": {"type": "string", "maxLength": 64}},
    "maxProperties": 16,
}
FILE_CHECKPOINT: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "a file checkpoint's record",
    "type": "object",
    "required": ["location"],
    "properties": {"location": {"type": "string", "minLength": 1, "maxLength": 4096, "pattern": "^[^\\x00-\\x1f]*$"},
                   "time": _TIME, "host": _HOST},
    "maxProperties": 64,
}

_validators: dict[str, Any] = {}


def _validator(schema: dict[str, Any]) -> Any:
    v = _validators.get(schema["title"])
    if v is None:
        import jsonschema
        from jsonschema import validators

        base = jsonschema.Draft202012Validator
        base.check_schema(schema)
        strict = base.TYPE_CHECKER.redefine("integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool))
        strict = strict.redefine("number", lambda _, x: isinstance(x, (int, float)) and not isinstance(x, bool))
        v = _validators[schema["title"]] = validators.extend(base, type_checker=strict)(schema)
    return v


def no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in a parsed value (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        todo.extend((x, d + 1) for x in items)
    return deepest


def _refuse(what: str, detail: str, evidence: dict[str, Any]) -> SnapguardError:
    detail = " ".join(detail.split())
    return SnapguardError(Reason.STORE_RECORD_INVALID, f"{what}: {detail[:_DETAIL]}", evidence=evidence)


def load_record(data: bytes, schema: dict[str, Any], what: str, *, cap: int = MAX_RECORD_BYTES,
                evidence: dict[str, Any] | None = None) -> dict[str, Any]:
    """`data` (a record's bytes from the store) as the object `schema` describes; anything else is
    STORE_RECORD_INVALID naming `what` (the key)."""
    evidence = evidence or {}
    if len(data) > cap:
        raise _refuse(what, f"{len(data)} bytes, over the {cap} a record may have", evidence)
    try:
        value = json.loads(data, parse_constant=no_constant)
    except RecursionError:
        raise _refuse(what, f"nested deeper than {MAX_DEPTH} levels", evidence) from None
    except ValueError as e:  # not UTF-8, not JSON
        raise _refuse(what, f"not JSON ({e})", evidence) from None
    if _depth(value) > MAX_DEPTH:
        raise _refuse(what, f"nested deeper than {MAX_DEPTH} levels", evidence)
    from jsonschema.exceptions import best_match

    error = best_match(_validator(schema).iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        shown = repr(error.instance)
        message = error.message.replace(shown, shown[:60] + "...") if len(shown) > 60 else error.message
        raise _refuse(what, f"{'field ' + where + ': ' if where else ''}{message} (not {schema['title']})", evidence)
    return value  # type: ignore[no-any-return]


def read_record(store: Any, key: str, schema: dict[str, Any], *, cap: int = MAX_RECORD_BYTES) -> dict[str, Any] | None:
    """The record at `key` in `store` (a Store: its `_get`), parsed and checked as `load_record`
    does; None when there is none. An object over `cap`, or one that is not a regular file, is
    STORE_RECORD_INVALID too."""
    evidence = {"store": getattr(store, "url", ""), "key": key}
    try:
        data = store._get(key, cap)
    except SnapguardError as e:
        if e.reason is not Reason.IMAGE_CORRUPT:  # the store's own size and type refusals
            raise
        raise _refuse(key, e.failure.detail, evidence) from None
    return None if data is None else load_record(data, schema, key, cap=cap, evidence=evidence)
