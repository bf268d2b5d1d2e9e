"""Shared by the benchmarks: where results go, and a stable summary of timings."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"host": platform.node(), "kernel": platform.release(), "cpu": cpu, "cpus": os.cpu_count(),
            "python": platform.python_version()}


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"n": len(s), "median": statistics.median(s), "p10": s[len(s) // 10], "p90": s[(len(s) * 9) // 10],
            "min": s[0], "max": s[-1]}


def write(name: str, payload: dict[str, Any], path: Path | str | None = None) -> Path:
    """`payload` as JSON under the benchmark's name, today's date (UTC) and this machine, at `path`
    (default: bench/results/NAME-DATE.json)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    if path is None:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{name}-{stamp}.json"
    path = Path(path)
    payload = {"benchmark": name, "date": stamp, "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def git_rev() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip()
