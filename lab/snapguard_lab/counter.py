"""The counter workloads' logs as the system tests read them (lines "N VALUE"), and the
environment that makes one directory a snapguard "node" (its own config and state directory)."""

from __future__ import annotations

import time
from pathlib import Path


def values(log: Path) -> list[tuple[int, int]]:
    """The log's complete "N VALUE" lines, as pairs (a line being written is left out)."""
    return [tuple(map(int, line.split())) for line in log.read_text().splitlines() if len(line.split()) == 2]


def wait_lines(log: Path, n: int, timeout: float = 30) -> None:
    """Until the log holds n complete lines; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and len(values(log)) >= n:
            return
        time.sleep(0.01)
    raise TimeoutError(f"{log} has fewer than {n} lines")


def node_env(root: Path) -> dict[str, str]:
    """SNAPGUARD_CONFIG (an empty config) and SNAPGUARD_STATE_DIR under `root`, made now."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.toml").write_text("")
    return {"SNAPGUARD_CONFIG": str(root / "config.toml"), "SNAPGUARD_STATE_DIR": str(root / "state")}
