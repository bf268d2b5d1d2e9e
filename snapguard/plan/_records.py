"""Costs read from snapguard's own records: a checkpoint or restore result, or a drill's rows."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ._model import usage

__all__ = ["costs_from_record"]


def _num(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def _snapshot_rank(arm: str, want_stop: bool) -> tuple[Any, ...]:
    # trimmed (the take point's release: the product's snapshot) first, then the kind wanted
    # (a stop snapshot is the one taken on notice), then the plain eager trainer
    trimmed = "trimmed" in arm and "untrimmed" not in arm
    return (not trimmed, ("stop" in arm) != want_stop, "container" in arm, "expandable" in arm,
            "compiled" in arm, arm)


def _file_rank(arm: str) -> tuple[Any, ...]:
    return ("warm" in arm, "compiled" in arm, arm != "file-checkpoint", arm)


def _from_drill(rows: list[Any]) -> tuple[dict[str, float], dict[str, str]]:
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("arm"), str)]
    snaps = [r for r in rows if "file" not in r["arm"] and r["arm"] not in ("reference", "compiled-reference")]
    files = [r for r in rows if "file" in r["arm"]]
    wanted: list[tuple[str, list[dict[str, Any]], str, Any]] = [
        ("snapshot_stall", snaps, "stall_s", lambda a: _snapshot_rank(a, want_stop=False)),
        ("snapshot_lag", snaps, "request_to_complete_image_s", lambda a: _snapshot_rank(a, want_stop=True)),
        ("snapshot_restore", snaps, "restore_to_first_new_step_s", lambda a: _snapshot_rank(a, want_stop=True)),
        ("file_stall", files, "stall_s", _file_rank),
        # measured from the resumed trainer's launch: it holds the start, so cold_start stays unset
        ("file_restore", files, "resume_to_first_new_step_s", _file_rank),
    ]
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    for name, pool, key, rank in wanted:
        have = sorted((r for r in pool if _num(r, key) is not None), key=lambda r: rank(r["arm"]))
        if have:
            values[name] = _num(have[0], key)  # type: ignore[assignment]
            sources[name] = f"{have[0]['arm']} {key}"
    return values, sources


def _from_result(record: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    timings = record.get("timings")
    if not isinstance(timings, dict) or _num(timings, "total_s") is None:
        raise usage("a result record without timings.total_s")
    total = _num(timings, "total_s") or 0.0
    op = record.get("operation")
    if op == "checkpoint":
        values = {"snapshot_lag": total}
        sources = {"snapshot_lag": "checkpoint timings.total_s"}
        if record.get("leave_running"):
            # the workload runs through the preflight, the image directory and the seal
            running = sum(_num(timings, k) or 0.0 for k in ("preflight_s", "image_dir_s", "seal_s"))
            values["snapshot_stall"] = max(total - running, 0.0)
            sources["snapshot_stall"] = "checkpoint timings.total_s - preflight_s - image_dir_s - seal_s"
        return values, sources
    if op == "restore":
        return {"snapshot_restore": total}, {"snapshot_restore": "restore timings.total_s"}
    raise usage(f"a result record of operation {op!r}, not checkpoint or restore")


def costs_from_record(record: Any) -> tuple[dict[str, float], dict[str, str]]:
    """Costs measured in one of snapguard's records, and where each came from.

    A `snapguard-result.json` (``operation``, ``timings``): a checkpoint gives the snapshot lag
    (total_s: request to complete image) and, left running, its stall (total_s less the steps
    during which the workload runs); a restore gives the snapshot restore (total_s). A drill
    record (``rows``, `snapguard drill --workload torch`): the trimmed leave-running row's
    stall_s, the trimmed stop row's request_to_complete_image_s and restore_to_first_new_step_s,
    the file arm's stall_s and resume_to_first_new_step_s. A failure record has no costs."""
    if not isinstance(record, dict):
        raise usage("not a JSON object")
    if isinstance(record.get("rows"), list):
        values, sources = _from_drill(record["rows"])
    elif record.get("ok") is False:
        raise usage(f"the record of a failed run ({record.get('reason', 'no reason')}): it measured no costs")
    elif "operation" in record:
        values, sources = _from_result(record)
    else:
        raise usage("neither a snapguard result (operation, timings) nor a drill record (rows)")
    if not values:
        raise usage("no cost in it (stall_s, request_to_complete_image_s, restore_to_first_new_step_s, "
                     "resume_to_first_new_step_s)")
    return values, sources
