"""Storages the hold's move keeps at half their size, losslessly: those whose every 4-byte word has
its low 16 bits zero, which is what a float32 tensor holding bfloat16 values looks like (the
gradients of a trainer under bfloat16 autocast: each weight's gradient is computed in bfloat16 and
widened into the float32 parameter's gradient). Only the high halves go into the arena; on the
reload they are put back beside zero halves, so the storage gets the very bytes it had (no
rounding is involved anywhere: a storage with one nonzero low half is kept whole).

Little-endian hosts only (x86-64, arm64): the high half of a word is its second 16-bit unit."""

from __future__ import annotations

import sys
from typing import Any, Sequence

__all__ = ["MIN_BYTES", "exact", "high_halves", "widen"]

# smaller storages are kept whole: what they would save is not worth a check's kernel each
MIN_BYTES = 1 << 16


def _units(torch: Any, storage: Any, n: int) -> Any:
    """The first n bytes of an untyped storage as int16 units (n a multiple of 4)."""
    return torch.empty(0, dtype=torch.int16, device=storage.device).set_(storage, 0, (n // 2,), (1,))


def exact(torch: Any, storages: Sequence[Any]) -> list[bool]:
    """For each storage, whether its bytes can be kept as their high halves: at least MIN_BYTES, a
    whole number of 4-byte words, and every word's low 16 bits zero. One reduction per storage on
    its device's stream (after what the trainer queued there) and one wait for all the answers."""
    if sys.byteorder != "little":
        return [False] * len(storages)
    asked = [i for i, st in enumerate(storages) if st.nbytes() >= MIN_BYTES and st.nbytes() % 4 == 0]
    if not asked:
        return [False] * len(storages)
    # per storage: any nonzero low half (the even units), as one flag on the CPU
    flags = [_units(torch, storages[i], storages[i].nbytes())[0::2].any() for i in asked]
    try:
        nonzero = torch.stack(flags).tolist()  # one wait for all of them
    except RuntimeError:  # storages on more than one device: one wait each
        nonzero = [bool(f) for f in flags]
    out = [False] * len(storages)
    for i, bad in zip(asked, nonzero):
        out[i] = not bad
    return out


def high_halves(torch: Any, storage: Any, n: int) -> Any:
    """A new uint8 tensor on the storage's device holding the high 16 bits of each of its n // 4
    words, in order (n // 2 bytes): what the arena keeps of a storage `exact` passed."""
    return _units(torch, storage, n)[1::2].contiguous().view(torch.uint8)


def widen(torch: Any, storage: Any, n: int, halves: Any) -> None:
    """Put the storage's n bytes back from `halves` (uint8, n // 2, on its device): each word's high
    16 bits from them, its low 16 bits zero. Queued on the device's stream, after the copy into
    `halves`."""
    units = _units(torch, storage, n)
    units[1::2].copy_(halves.view(torch.int16))
    units[0::2].zero_()
