"""The manifest's digest scheme, computed on bytes as they stream past.

snapguard.image hashes a file as the sha256 of the concatenated sha256s of its 64 MiB spans (an
empty file: the sha256 of the sha256 of nothing). A store computes the same digest while it
copies, uploads or downloads, so that an image is verified in the one pass that moves it
(tests/system/test_store.py checks this equals what image.seal records).
"""

from __future__ import annotations

import hashlib

__all__ = ["SPAN", "SpanHasher", "combine", "spans"]

SPAN = 64 << 20  # snapguard.image's span: the manifest's digest scheme


def spans(size: int) -> list[tuple[int, int]]:
    """(offset, length) of each span of a file of `size` bytes; one empty span for an empty file."""
    return [(off, min(SPAN, size - off)) for off in range(0, size, SPAN)] or [(0, 0)]


def combine(span_digests: list[bytes]) -> str:
    """A file's manifest digest from its spans' sha256 digests, in order."""
    return hashlib.sha256(b"".join(span_digests)).hexdigest()


class SpanHasher:
    """Bytes of one whole file fed in order; the manifest digest at the end."""

    def __init__(self) -> None:
        self._done: list[bytes] = []
        self._h = hashlib.sha256()
        self._in_span = 0
        self.total = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), SPAN - self._in_span)
            self._h.update(view[:take])
            self._in_span += take
            self.total += take
            view = view[take:]
            if self._in_span == SPAN:
                self._done.append(self._h.digest())
                self._h = hashlib.sha256()
                self._in_span = 0

    def hexdigest(self) -> str:
        tail = [self._h.digest()] if self._in_span or not self._done else []
        return combine(self._done + tail)
