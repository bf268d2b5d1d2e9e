"""What `snapguard images` and `snapguard inspect` share: kubectl-like columns, sizes, ages, and
one stored image as a JSON-ready row."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["age", "gpus_used", "image_row", "size", "status", "table", "text_row"]


def size(n: int | None) -> str:
    """Bytes as kubectl and du -h write them: 512B, 1.5KiB, 3.2GiB."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return "-"  # not reached


def age(t: float | None, now: float | None = None) -> str:
    """Seconds since t as kubectl's AGE column: 45s, 12m, 5h, 3d."""
    if t is None:
        return "-"
    s = max(0, int((time.time() if now is None else now) - t))
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= span * (2 if unit != "m" else 1):
            return f"{s // span}{unit}"
    return f"{s}s"


def gpus_used(manifest: Any) -> list[dict[str, Any]]:
    """The image node's GPUs the image's processes used (by GPU memory), from the manifest."""
    if manifest is None:
        return []
    return [g for g in manifest.gpus if isinstance(g, dict) and (g.get("used_by_image") or 0) > 0]


def _gpus_text(manifest: Any) -> str:
    used = gpus_used(manifest)
    if not used:
        return "0" if manifest is not None else "-"
    names = sorted({str(g.get("name", "?")).removeprefix("NVIDIA ") for g in used})
    return f"{len(used)}x{names[0]}" if len(names) == 1 else str(len(used))


def status(item: Any) -> str:
    if item.invalid:
        return "Invalid"
    if not item.ref.complete:
        return "Incomplete"
    return "Superseded" if item.superseded else "Whole"


def image_row(item: Any) -> dict[str, Any]:
    """One StoredImage as the JSON `images` and `inspect --json` print."""
    m = item.manifest
    return {"job": item.ref.job, "name": item.ref.name, "url": item.ref.url, "epoch": item.ref.epoch,
            "job_epoch": item.current_epoch, "whole": item.ref.complete and not item.invalid,
            "superseded": item.superseded, "status": status(item).lower(), "bytes": item.size,
            "time": item.time, "host": item.host, "gpus": [{k: g.get(k) for k in ("index", "name", "uuid",
                                                                                    "used_by_image")}
                                                             for g in gpus_used(m)],
            "invalid": item.invalid}


def text_row(item: Any, now: float) -> list[str]:
    return [item.ref.job, item.ref.name, "-" if item.ref.epoch is None else str(item.ref.epoch), size(item.size),
            age(item.time, now), item.host or "-", _gpus_text(item.manifest), status(item)]


def table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns three spaces apart, upper-case headers (kubectl get)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])
