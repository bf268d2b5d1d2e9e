"""The take point's move of tensor bytes off the device for the hold (`Offload`), on real PyTorch.

The machine running these has no GPU, so the same code moves CPU storages (device_type "cpu"):
what is tested is what does not depend on the device: every storage is emptied in place, views
and optimizer state stay valid through it, the bytes come back exact, the trainer then steps as a
twin that never moved, and what must not move does not. The CUDA path runs on the H200
(bench/gpu/workloads.py, bench/gpu/scaling.py)."""

from __future__ import annotations

import gc
import time

import pytest

torch = pytest.importorskip("torch")

from snapguard.takepoint.workload import offload as offload_module  # noqa: E402
from snapguard.takepoint.workload.offload import Offload, host_room, optimizer_tensors  # noqa: E402
from snapguard.takepoint.workload.point import TakePoint  # noqa: E402
from snapguard.takepoint.workload.ring import Ring  # noqa: E402
from snapguard.takepoint.workload.server import answer  # noqa: E402


def _trainer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    torch.manual_seed(1000 + i)
    opt.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    for state in opt.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def test_storages_are_emptied_in_place_and_come_back_exact() -> None:
    model, opt = _trainer(0)
    twin, twin_opt = _trainer(0)
    for i in range(3):
        _step(model, opt, i)
        _step(twin, twin_opt, i)
    weight = model[0].weight
    view = weight[3:5]  # a view shares the storage: it must see the bytes again after the reload
    before = [t.detach().clone() for t in _tensors(model, opt)]
    storages = {t.untyped_storage()._cdata for t in _tensors(model, opt)}

    offload = Offload("cpu")
    figures = offload.take(torch, optimizer_tensors(torch, opt), [view])
    assert figures["state"] == "moved", figures
    assert figures["storages"] == len(storages)  # each storage once; the view's is its base's
    assert figures["bytes"] == sum(t.untyped_storage().nbytes() for t in before)
    assert all(t.untyped_storage().nbytes() == 0 for t in _tensors(model, opt))
    assert view.untyped_storage().nbytes() == 0

    offload.reload(torch)
    assert offload.moved == []
    after = _tensors(model, opt)
    assert {t.untyped_storage()._cdata for t in after} == storages  # the same storage objects
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert torch.equal(view, weight[3:5]) and view.untyped_storage()._cdata == weight.untyped_storage()._cdata
    for i in range(3, 6):
        _step(model, opt, i)
        _step(twin, twin_opt, i)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(model, opt), _tensors(twin, twin_opt)))


def test_storages_it_does_not_own_stay_and_other_devices_are_not_touched() -> None:
    numpy = pytest.importorskip("numpy")
    shared = torch.from_numpy(numpy.arange(64, dtype=numpy.float32))  # numpy's memory: not resizable
    mine = torch.arange(32, dtype=torch.float64)
    meta = torch.empty(1000, device="meta")
    figures = Offload("cpu").take(torch, [shared, mine, meta, "not a tensor", 7])
    assert figures["state"] == "moved" and figures["storages"] == 1, figures
    assert figures["kept_bytes"] == 64 * 4 and figures["bytes"] == 32 * 8
    assert shared.untyped_storage().nbytes() == 64 * 4 and torch.equal(shared, torch.arange(64.0))
    assert meta.untyped_storage().nbytes() == 4000


def test_a_storage_whose_memory_another_storage_covers_stays() -> None:
    """A DLPack export (or from_blob) is a second storage over the same memory: moving the first
    would leave the second reading the old address after the reload."""
    exported = torch.arange(64.0)
    alias = torch.from_dlpack(exported)
    alone = torch.arange(16.0)
    figures = Offload("cpu").take(torch, [exported, alone], [alias])
    assert figures["storages"] == 1 and figures["kept_bytes"] == 64 * 4, figures
    exported.add_(1)
    assert torch.equal(alias, torch.arange(64.0) + 1)  # still the same memory
    part = torch.from_dlpack(exported)[8:16]  # an alias of a part of it counts as well
    assert Offload("cpu").take(torch, [exported], [part])["kept_bytes"] == 64 * 4


def test_nothing_moves_while_a_cuda_graph_exists() -> None:
    graph = object.__new__(torch.cuda.CUDAGraph)  # the type is what is checked: this machine has no GPU
    mine = torch.arange(8.0)
    figures = Offload("cpu").take(torch, [mine], [graph])
    assert figures == {"state": "skipped", "why": "a CUDA graph exists (it replays kernels at fixed addresses)"}
    assert mine.untyped_storage().nbytes() == 32


def test_a_copy_that_fails_changes_nothing_and_says_why() -> None:
    """The device here is "meta": its storages have a size but no bytes to copy, so the copy fails
    and the take says so; a CPU storage is not on that device and stays as it was."""
    mine = torch.arange(8.0)
    offload = Offload("meta")
    figures = offload.take(torch, [mine, torch.empty(4, device="meta")])
    assert figures["state"] == "failed" and figures["error"], figures
    assert offload.moved == [] and torch.equal(mine, torch.arange(8.0))


def test_a_copy_that_fails_part_way_leaves_every_storage_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """No storage is emptied before every copy is done: a failure part way, whether where the
    copies start or in a thread copying into the arena, leaves all of them as they were."""

    first, second, third = torch.arange(64.0), torch.arange(32.0), torch.arange(16.0)
    real, calls = offload_module.as_bytes, []

    def failing_second(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected: the second copy fails")
        return real(*args)

    monkeypatch.setattr(offload_module, "as_bytes", failing_second)
    offload = Offload("cpu")
    figures = offload.take(torch, [third, first, second])
    assert figures["state"] == "failed" and "injected" in figures["error"], figures
    assert figures["bytes"] == 0 and figures["left_bytes"] == (64 + 32 + 16) * 4, figures
    assert offload.moved == [] and offload.arena is None
    assert torch.equal(first, torch.arange(64.0)) and torch.equal(second, torch.arange(32.0))
    monkeypatch.setattr(offload_module, "as_bytes", real)

    real_drain, drains = Ring._drain, []

    def failing_third_drain(self, *args):  # type: ignore[no-untyped-def]
        drains.append(1)
        if len(drains) == 3:
            raise OSError("injected: the host copy fails")
        return real_drain(self, *args)

    monkeypatch.setattr(Ring, "_drain", failing_third_drain)
    figures = offload.take(torch, [third, first, second])
    assert figures["state"] == "failed" and "injected" in figures["error"], figures
    assert all(t.untyped_storage().nbytes() == t.numel() * 4 for t in (first, second, third))
    assert torch.equal(third, torch.arange(16.0))


def test_storages_larger_than_a_slot_go_through_the_ring_in_pieces_and_come_back_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies pass through `Ring`'s few slots: storages many slots long, and ones that end part
    way into a slot, wrap around the ring out and back and keep every byte."""

    monkeypatch.setattr(Ring, "SLOT_BYTES", 4096)
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.rand(n, generator=gen) for n in (40_000, 1024, 5_000, 3, 17_000)]  # 160 KB .. 12 B
    before = [t.clone() for t in tensors]
    offload = Offload("cpu")
    figures = offload.take(torch, tensors)
    assert figures["state"] == "moved" and figures["storages"] == len(tensors), figures
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    arena = offload.arena
    assert arena is not None
    for storage, offset, n in offload.moved:  # the arena holds each one's bytes at its offset
        match = [b for b in before if b.numel() * 4 == n]
        assert torch.equal(arena.view(offset, n).view(torch.float32), match[0])
    offload.reload(torch)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_the_reload_waits_for_memory_then_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """No memory for a storage on the release (another process took what the hold freed): tried
    again until the patience runs out, then the error; what came back stays back."""
    a, b = torch.arange(64.0), torch.arange(32.0)
    offload = Offload("cpu")
    offload.take(torch, [a, b])
    storage = a.untyped_storage()
    real = type(storage).resize_
    failures = [2]

    def short_of_memory(self, n):  # type: ignore[no-untyped-def]
        if self._cdata == storage._cdata and failures[0] > 0:
            failures[0] -= 1
            raise torch.OutOfMemoryError("injected: out of memory")
        return real(self, n)

    monkeypatch.setattr(type(storage), "resize_", short_of_memory)
    t0 = time.monotonic()
    offload.reload(torch, patience_s=5.0)  # two failures, then it fits
    assert time.monotonic() - t0 >= 1.0 and torch.equal(a, torch.arange(64.0)) and torch.equal(b, torch.arange(32.0))

    offload = Offload("cpu")
    offload.take(torch, [a])
    storage = a.untyped_storage()
    failures[0] = 10 ** 6
    with pytest.raises(torch.OutOfMemoryError):
        offload.reload(torch, patience_s=0.6)
    assert len(offload.moved) == 1  # still in host memory: nothing lost


def test_the_whole_heap_of_a_process_is_a_valid_input() -> None:
    """At the hold the objects are gc.get_objects(): whatever the process holds, nothing raises, and
    every CPU storage it moved comes back."""
    model, opt = _trainer(1)
    _step(model, opt, 0)
    before = [t.detach().clone() for t in _tensors(model, opt)]
    offload = Offload("cpu")
    figures = offload.take(torch, optimizer_tensors(torch, opt), gc.get_objects())
    assert figures["state"] == "moved" and figures["storages"] == len(before), figures
    offload.reload(torch)
    assert all(torch.equal(a, b) for a, b in zip(before, _tensors(model, opt)))


def test_past_its_deadline_the_rest_stays_and_the_arena_goes_with_the_reload() -> None:
    big, small = torch.arange(4096.0), torch.arange(16.0)
    offload = Offload("cpu")
    figures = offload.take(torch, [small, big], deadline=0.0)  # long past: nothing moves
    assert figures["state"] == "partial" and figures["storages"] == 0, figures
    assert figures["left_bytes"] == 4096 * 4 + 16 * 4 and big.untyped_storage().nbytes() == 4096 * 4
    offload.reload(torch)

    # one that would not be copied by the deadline at the rate assumed (2 GB/s, with a ring's
    # 256 MiB in flight) stays; a smaller one after it still moves
    large = torch.empty(64 << 20)  # 256 MiB: 0.27 s at that rate with the ring's, the small one 0.13 s
    offload = Offload("cpu")
    figures = offload.take(torch, [small, large], deadline=time.monotonic() + 0.25)
    assert figures["state"] == "partial" and figures["left_bytes"] == 256 << 20, figures
    assert figures["storages"] == 1 and small.untyped_storage().nbytes() == 0
    offload.reload(torch)
    del large

    offload = Offload("cpu")
    assert offload.take(torch, [small, big])["state"] == "moved"
    assert [n for _, _, n in offload.moved] == [4096 * 4, 16 * 4]  # the largest first
    arena = offload.arena
    assert arena is not None and not arena.map.closed
    offload.reload(torch)
    assert arena.map.closed and offload.arena is None  # unmapped: nothing stays resident
    assert torch.equal(big, torch.arange(4096.0)) and torch.equal(small, torch.arange(16.0))


def test_a_hold_the_executor_gave_up_on_does_not_wait_for_a_release() -> None:
    """A hold waits for the executor's release; but when the executor's wait for the take ran out
    (its answer says "no step boundary in time", and it snapshots without the hold) just as the
    trainer got into it, the trainer goes on at once instead of after SNAPGUARD_TAKE_HOLD_S."""
    import threading

    point = TakePoint()
    for give_up in (False, True):
        point.arm(None, 5.0)
        trainer = threading.Thread(target=point.at_step_end, args=(None, (), {}))
        trainer.start()
        assert point.reached.wait(5)
        trainer.join(0.3)
        assert trainer.is_alive()  # held
        if give_up:
            point.disarm()  # what the take's answer does when its wait ran out
        else:
            assert answer(point, ["release"], []) == ({"ok": True}, None)
        trainer.join(5)
        assert not trainer.is_alive()

    reply, handed = answer(point, ["take", "0.2"], [])  # no step comes: the take gives up, nothing holds later
    assert reply["ok"] is False and "no step boundary in time" in reply["error"] and handed is None
    trainer = threading.Thread(target=point.at_step_end, args=(None, (), {}))
    trainer.start()
    trainer.join(5)
    assert not trainer.is_alive()


def test_what_does_not_fit_in_host_memory_stays() -> None:

    big, small = torch.arange(4096.0), torch.arange(16.0)  # 16 KiB and one 4 KiB page of the arena
    offload = Offload("cpu")
    figures = offload.take(torch, [small, big], room=8192)
    assert figures["state"] == "partial" and figures["bytes"] == 64 and figures["left_bytes"] == 4096 * 4, figures
    assert big.untyped_storage().nbytes() == 4096 * 4 and small.untyped_storage().nbytes() == 0
    offload.reload(torch)
    assert torch.equal(small, torch.arange(16.0))
    assert 0 < host_room() < 1 << 50  # this machine's real figure


def test_host_room_is_the_cgroups_when_that_is_less(tmp_path) -> None:  # type: ignore[no-untyped-def]

    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/job/trainer\n")
    group = tmp_path / "cg" / "job" / "trainer"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("3000000\n")
    (group / "memory.current").write_text("1000000\n")
    assert host_room(str(tmp_path / "self"), str(tmp_path / "cg")) == 2000000
    (group / "memory.max").write_text("max\n")
    assert host_room(str(tmp_path / "self"), str(tmp_path / "cg")) > 2000000  # MemAvailable alone


class _Wrapper(torch.Tensor):
    """A wrapper subclass shaped like DTensor: its own storage has a size but no memory; the bytes
    are in `_local_tensor`."""

    @staticmethod
    def __new__(cls, inner):  # type: ignore[no-untyped-def]
        wrapper = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        wrapper._local_tensor = inner
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError(f"{func} on a test wrapper")


def test_wrapper_subclasses_neither_stop_the_move_nor_hide_their_bytes() -> None:
    inner, other = torch.arange(64.0), torch.arange(16.0)
    wrapped = _Wrapper(inner)
    figures = Offload("cpu").take(torch, [other], [wrapped, _Wrapper(torch.arange(4.0))])
    assert figures["state"] == "moved" and figures["storages"] == 1, figures  # not skipped

    class _Opt:
        param_groups = [{"params": [wrapped]}]
        state: dict = {}

    moved = optimizer_tensors(torch, _Opt())
    assert len(moved) == 1 and moved[0] is inner  # the local shard, not the wrapper


def test_an_optimizer_not_shaped_as_torchs_moves_nothing_and_raises_nothing() -> None:
    class _Odd:
        param_groups = ["not a dict"]

    assert optimizer_tensors(torch, _Odd()) == []
    assert optimizer_tensors(torch, None) == []


def test_a_reload_without_a_ring_copies_plainly_and_one_after_a_failure_keeps_what_came_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reload's ring cannot be built (no thread or mapping to spare): the plain copies bring the
    bytes back all the same. And a reload that failed part way, tried again, does not allocate again
    for the storages that already have their memory back."""

    a, b = torch.arange(64.0), torch.arange(32.0)
    offload = Offload("cpu")
    assert offload.take(torch, [a, b])["state"] == "moved"

    def no_ring(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected: can't start new thread")

    monkeypatch.setattr(offload_module, "Ring", no_ring)
    offload.reload(torch)
    assert torch.equal(a, torch.arange(64.0)) and torch.equal(b, torch.arange(32.0)) and offload.arena is None
    monkeypatch.undo()

    offload = Offload("cpu")
    offload.take(torch, [a, b])
    storage_b = b.untyped_storage()
    real = type(storage_b).resize_
    calls: list[int] = []

    def b_fails_once(self, n):  # type: ignore[no-untyped-def]
        calls.append(self._cdata)
        if self._cdata == storage_b._cdata and calls.count(self._cdata) == 1:
            raise torch.OutOfMemoryError("injected: out of memory")
        return real(self, n)

    monkeypatch.setattr(type(storage_b), "resize_", b_fails_once)
    with pytest.raises(torch.OutOfMemoryError):
        offload.reload(torch)  # a got its memory back, b did not
    first_a = a.untyped_storage().data_ptr()
    offload.reload(torch)
    assert calls.count(a.untyped_storage()._cdata) == 1 and a.untyped_storage().data_ptr() == first_a
    assert torch.equal(a, torch.arange(64.0)) and torch.equal(b, torch.arange(32.0))


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_full_collection_runs_ahead_and_the_hold_collects_the_young(monkeypatch: pytest.MonkeyPatch) -> None:
    """A take for the next step boundary: its own thread collects in full as it arrives, and the
    hold only the young generations (its figures say both); a take for a later step, or with
    SNAPGUARD_TAKE_GC_AHEAD=0, is collected in full at the hold. Garbage left before either is
    gone by the hold either way."""
    import threading
    import weakref

    from snapguard.takepoint.workload import env

    def one(point: TakePoint, at: int | None) -> dict:  # type: ignore[type-arg]
        reply: list[tuple] = []  # type: ignore[type-arg]
        taker = threading.Thread(target=lambda: reply.append(answer(point, ["take", "10"] if at is None else
                                                                    ["take-at", str(at), "10"], [])))
        garbage = weakref.ref(_Cycle())  # a cycle: garbage only a collection finds
        taker.start()
        deadline = time.monotonic() + 5
        while point.hold_at is None and time.monotonic() < deadline:
            time.sleep(0.001)
        while point._ahead_done.is_set() is False:
            time.sleep(0.001)
        time.sleep(0.05)  # the ahead collection, where there is one, is done by now
        steps = 0
        while not point.reached.is_set() and steps < 5:
            trainer = threading.Thread(target=point.at_step_end, args=(None, (), {}))
            trainer.start()
            steps += 1
            if point.reached.wait(0.5):
                break
            trainer.join(5)
        figures = dict(point.figures)
        assert answer(point, ["release"], []) == ({"ok": True}, None)
        trainer.join(5)
        taker.join(5)
        assert reply and reply[0][0]["ok"] is True, reply
        assert garbage() is None, "garbage was left at the hold"
        return figures

    point = TakePoint()
    ahead = one(point, None)
    assert ahead["gc_ahead"]["collected"] >= 2 and ahead["gc_ahead"]["s"] >= 0, ahead
    assert set(ahead["trim_parts_s"]) == {"sync", "gc", "move", "caches", "stack"}
    later = one(point, point.step + 3)
    assert "gc_ahead" not in later and later["gc_collected"] >= 2, later
    monkeypatch.setattr(env, "GC_AHEAD", False)
    off = one(point, None)
    assert "gc_ahead" not in off and off["gc_collected"] >= 2, off
