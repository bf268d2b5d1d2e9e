"""The steps of one checkpoint or restore: each timed, and any OS error escaping it typed with
that step's reason, so that nothing below the entry points reaches a user untyped; and the
result record built from them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .. import criu
from ..reasons import Reason, SnapguardError
from ..trust import UntrustedPathError

__all__ = ["Steps", "criu_errors"]


class Steps:
    """Timings of the steps of one run, counts of what happened in them, and the step's reason for
    any OS error inside it."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextmanager
    def step(self, name: str, reason: Reason, **evidence: Any) -> Iterator[None]:
        """A step: timed, and any OS error inside it typed with `reason`."""
        with self.timed(name):
            try:
                yield
            except UntrustedPathError as e:
                if e.unusable:  # missing, not a directory, name too long: not a matter of who controls it
                    raise SnapguardError(reason, f"{name}: {e}",
                                         evidence={**evidence, "step": name, "path": e.path}) from None
                raise SnapguardError(Reason.UNTRUSTED_PATH, str(e), evidence={**evidence, "path": e.path}) from None
            except (OSError, ValueError) as e:
                detail = f"{e.strerror or e}: {e.filename}" if isinstance(e, OSError) and e.filename else \
                    (e.strerror if isinstance(e, OSError) and e.strerror else str(e))
                raise SnapguardError(reason, f"{name}: {detail}", evidence={**evidence, "step": name}) from None

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time what runs inside under `<name>_s` (added to it if it ran before). Also a part of a
        step on its own: `criu_s`, the runner's CRIU (or runc) run within `dump_s` or `restore_s`,
        whose rest is the run directory and the broker; CRIU's own log marks then split `criu_s`
        into CRIU's work and its start and exit."""
        t = time.monotonic()
        try:
            yield
        finally:
            self.timings[f"{name}_s"] = self.timings.get(f"{name}_s", 0.0) + time.monotonic() - t

    def done(self) -> dict[str, float]:
        return {**self.timings, "total_s": time.monotonic() - self.t0}

    def record(self, result: dict[str, Any], log: str) -> dict[str, Any]:
        """The run's result record: `result`, the timings, CRIU's log marks and the counts."""
        return {**result, "ok": True, "timings": self.done(), "criu_marks": criu.log_marks(log),
                **({"counts": self.counts} if self.counts else {})}


def criu_errors(log: str) -> tuple[str, list[dict[str, Any]]]:
    """CRIU's errors in its log: one line quoting them, and each as evidence."""
    errors = criu.read_log_errors(log)
    return "; ".join(str(e) for e in errors), [{"where": e.where, "message": e.message, "context": e.context}
                                               for e in errors]
