"""The hold's move keeps a storage whose every 4-byte word has zero low 16 bits (a float32 gradient
of bfloat16 values) as its high halves (`halves`, `Offload(halve=True)`): half the bytes in the
arena and in the spill's file, and on the reload the very bytes it had, through the ring and the
spill's file, through the plain copies, and in batches of bounded device buffers. Real PyTorch on
CPU storages (the GPU path is the same code on the device: bench/gpu/scaling.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from snapguard.takepoint.workload import halves  # noqa: E402
from snapguard.takepoint.workload import offload as offload_module  # noqa: E402
from snapguard.takepoint.workload.offload import Offload  # noqa: E402
from snapguard.takepoint.workload.ring import Ring  # noqa: E402

N = 1 << 16  # floats per tensor: 256 KiB, past halves.MIN_BYTES


@pytest.fixture
def shm() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="snapguard-test-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _state() -> list[torch.Tensor]:
    """A gradient computed in bfloat16 and widened (every low half zero, negative zero, infinities
    and a NaN among them), one with a single nonzero low half, a plain float32 one, a small one."""
    torch.manual_seed(7)
    grad = torch.randn(N).to(torch.bfloat16).float()
    grad[:4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")])
    almost = torch.randn(N).to(torch.bfloat16).float()
    almost.view(torch.int32)[N // 2] |= 1  # one bit below bfloat16's
    return [grad, almost, torch.randn(N), torch.randn(100).to(torch.bfloat16).float()]


def _bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.int32).clone() for t in tensors]


def test_exact_finds_only_storages_whose_every_low_half_is_zero() -> None:
    assert halves.exact(torch, [t.untyped_storage() for t in _state()]) == [True, False, False, False]


@pytest.mark.parametrize("spill", [True, False])
def test_a_halved_storage_takes_half_and_comes_back_bit_exact(shm: Path, spill: bool) -> None:
    tensors = _state()
    before = _bits(tensors)
    offload = Offload("cpu", halve=True)
    figures = offload.take(torch, tensors, spill_dir=str(shm) if spill else None)
    assert figures["state"] == "moved", figures
    assert figures["halved"] == {"storages": 1, "saved_bytes": 2 * N}, figures
    # the arena holds half of the halved one's bytes: 2 N + 4 N + 4 N (+ the small one's 400)
    assert figures["bytes"] == 2 * N + 4 * N + 4 * N + 400
    if spill:
        assert figures["spill"]["bytes"] == os.fstat(offload.spill_fd).st_size < 12 * N + 4096 * 4
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    offload.reload(torch, source_fd=offload.spill_fd)
    if spill:
        os.close(offload.spill_fd)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(_bits(tensors), before))


def test_a_ring_of_small_slots_and_small_batches_still_come_back_exact(monkeypatch: pytest.MonkeyPatch,
                                                                       shm: Path) -> None:
    """Pieces of a slot each, and the reload's buffers for the halved ones a few at a time."""
    monkeypatch.setattr(Ring, "SLOTS", 2)
    monkeypatch.setattr(Ring, "SLOT_BYTES", 4096)
    batches = offload_module._batches
    monkeypatch.setattr(offload_module, "_batches", lambda moved, halved: batches(moved, halved, most=2 * N))
    tensors = [torch.randn(N).to(torch.bfloat16).float() for _ in range(3)] + [torch.randn(N)]
    before = _bits(tensors)
    offload = Offload("cpu", halve=True)
    assert offload.take(torch, tensors, spill_dir=str(shm))["halved"]["storages"] == 3
    offload.reload(torch, source_fd=offload.spill_fd)
    os.close(offload.spill_fd)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(_bits(tensors), before))


def test_batches_bound_the_halved_buffers_and_keep_the_order() -> None:
    moved = [("a", 0, 8), ("b", 8, 8), ("c", 16, 8), ("d", 24, 100)]
    assert offload_module._batches(moved, {0, 8, 16}, most=4) == [[moved[0]], [moved[1]], [moved[2], moved[3]]]
    assert offload_module._batches(moved, set(), most=8) == [moved]
    assert offload_module._batches([], set()) == []


def test_off_by_default_on_a_cpu() -> None:
    tensors = _state()
    figures = Offload("cpu").take(torch, tensors)
    assert "halved" not in figures and figures["bytes"] == sum(t.untyped_storage().nbytes() for t in _state())
