"""The GPU device map of a restore: which GPU of the checkpointed node becomes which GPU here.

One text form, "OLD=NEW,OLD=NEW", each side a GPU index or UUID: the operator's `--device-map`, the
`cuda-checkpoint --device-map` flag, and the environment entry through which CRIU's CUDA plugin
passes it to snapguard's cuda-checkpoint (DeviceMap.ENV). Standard library only: the tool imports it
inside a trainer's stall.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["DeviceMap"]


def _is_name(text: str) -> bool:
    return bool(text) and all(c.isalnum() or c == "-" for c in text)


@dataclass(frozen=True)
class DeviceMap:
    """Pairs of (old GPU, new GPU), in the order given."""

    pairs: tuple[tuple[str, str], ...]

    # the environment entry snapguard sets for the CRIU it runs; one in snapguard's own environment
    # is dropped for CRIU (snapguard.criu) so that only the executor's map reaches the plugin
    ENV: ClassVar[str] = "SNAPGUARD_DEVICE_MAP"

    @classmethod
    def parse(cls, text: str) -> DeviceMap:
        """The map `text` spells; ValueError with a one-line message when an entry is not OLD=NEW."""
        pairs = []
        for item in text.split(","):
            old, sep, new = item.partition("=")
            old, new = old.strip(), new.strip()
            if not sep or not _is_name(old) or not _is_name(new):
                raise ValueError(f"device map entry {item!r} is not OLD_UUID=NEW_UUID "
                                 "(a GPU index or UUID on each side)")
            pairs.append((old, new))
        return cls(tuple(pairs))

    def encode(self) -> str:
        """The text form parse reads."""
        return ",".join(f"{old}={new}" for old, new in self.pairs)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DeviceMap | None:
        """The map in `env`, None when it names none; ValueError as parse."""
        text = env.get(cls.ENV)
        return cls.parse(text) if text else None

    def into_env(self, env: MutableMapping[str, str]) -> None:
        """Set this map in `env` (an empty map sets nothing)."""
        if self.pairs:
            env[self.ENV] = self.encode()

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)
