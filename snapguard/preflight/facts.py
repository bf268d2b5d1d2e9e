"""What the host checks found out about this host: `HostFacts`, beside a preflight `Report`.

The checks in `host` note what they find into a plain mapping (`runc_version`, `criu_version`,
...); `HostFacts.noting` runs one such check and keeps what it noted. A fact found to be None (no
NVIDIA driver: `gpu` None) is a fact too: `to_dict` gives the facts found, in the order found,
as the report's JSON carries them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..reasons import Finding

__all__ = ["HostFacts"]

_NAMES = ("host", "criu_version", "runc_version", "containerd_path", "containerd_version", "containerd_problem",
          "gpu", "spill")


@dataclass
class HostFacts:
    host: dict[str, Any] | None = None  # procfs.host_facts(): kernel, arch, hostname, cpu
    criu_version: str | None = None
    runc_version: str | None = None
    containerd_path: str | None = None
    containerd_version: str | None = None
    containerd_problem: str | None = None
    gpu: dict[str, Any] | None = None  # NVML's inventory (preflight.gpu.gpu_facts); None: no NVIDIA driver
    spill: dict[str, Any] | None = None  # where take-point spills go (host.spill_tmpfs)
    found: list[str] = field(default_factory=list)  # the facts found, in order

    def update(self, facts: Mapping[str, Any]) -> None:
        """Take these facts (names of this record's fields)."""
        for name, value in facts.items():
            if name not in _NAMES:
                raise KeyError(f"not a host fact: {name}")
            setattr(self, name, value)
            if name not in self.found:
                self.found.append(name)

    def knows(self, name: str) -> bool:
        return name in self.found

    def noting(self, check: Callable[[dict[str, Any]], list[Finding]]) -> Callable[[], list[Finding]]:
        """A check that notes facts into a mapping, as one that keeps them here."""
        def run() -> list[Finding]:
            noted = self.to_dict()
            try:
                return check(noted)
            finally:
                self.update({k: v for k, v in noted.items() if not self.knows(k) or getattr(self, k) is not v})
        return run

    @property
    def cpu_flags(self) -> list[str]:
        return list(((self.host or {}).get("cpu") or {}).get("flags", []))

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.found}
