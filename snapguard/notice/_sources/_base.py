"""What every notice source shares: the Notice record, the Source protocol, the lead bound and
the list of what a source refused (read by the agent, which journals it)."""

from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ...reasons import SnapguardError
from ._parse import refusal

__all__ = ["Notice", "Refusals", "Source", "bounded", "with_deadline"]


@dataclass(frozen=True)
class Notice:
    """One reclaim notice. `id` is stable for one event (two reads of it give the same id), so the
    agent snapshots once however often it is seen. `deadline` is wall-clock (epoch seconds) when the
    source gives or documents one; `lead_s` what was left of it when the notice was read."""

    id: str
    source: str
    kind: str
    detail: str
    deadline: float | None = None
    lead_s: float | None = None
    raw: Any = None
    seen_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Notice:
        return cls(str(d["id"]), str(d["source"]), str(d["kind"]), str(d["detail"]), d.get("deadline"),
                   d.get("lead_s"), d.get("raw"), float(d.get("seen_at") or time.time()))


def with_deadline(nid: str, source: str, kind: str, detail: str, deadline: float | None, raw: Any) -> Notice:
    now = time.time()
    return Notice(nid, source, kind, detail, deadline, None if deadline is None else round(deadline - now, 3), raw,
                  now)


class Source(Protocol):
    name: str

    def poll(self, deadline: float) -> Notice | None: ...


def bounded(deadline: float, lead_s: float | None) -> float:
    """`deadline` (monotonic), and no later than half the source's documented lead from now: a
    poll stuck on a peer never outlasts half the time a notice it would miss leaves to act."""
    return deadline if lead_s is None else min(deadline, time.monotonic() + lead_s / 2)


class Refusals:
    """What a source refused and went on past (an inbox entry, one watch event): each a dict with
    the typed reason, its line and where; `take()` empties it (the agent journals each once)."""

    def __init__(self) -> None:
        self._refused: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)

    def refuse(self, err: SnapguardError, where: str) -> None:
        self._refused.append({**refusal(err), "where": where})

    def take(self) -> list[dict[str, Any]]:
        out = []
        while self._refused:
            out.append(self._refused.popleft())
        return out
