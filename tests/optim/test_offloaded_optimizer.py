"""OffloadedOptimizer without Lightning: the fence (a chunk is never updated from stale state even when
its write-back is slow), memory bounded by the ring, and params larger than a chunk."""

from __future__ import annotations

import threading
import time

import torch

from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.store import FlatStore
from lightning_nvme.store import file_io as file_io_mod
from lightning_nvme.store import flat_store as flat_store_mod


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 200), torch.nn.Tanh(), torch.nn.Linear(200, 3))


def _train(model, opt, steps=8, closure_style=True):
    torch.manual_seed(1)
    data = [(torch.randn(16, 48), torch.randint(0, 3, (16,))) for _ in range(steps)]
    for x, y in data:
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        if closure_style:
            opt.step(closure)
        else:
            closure()
            opt.step()


def test_slow_writes_are_fenced(tmp_path, monkeypatch):
    """Writes are delayed so that step N+1's prefetch is issued while step N's writes are still in
    flight; the result must still equal in-memory training (the read waits for the write)."""
    original = file_io_mod.StoreFile.pwrite_full
    in_flight_at_prefetch = []

    def slow_write(self, mv, offset, region):
        time.sleep(0.01)
        return original(self, mv, offset, region)

    monkeypatch.setattr(file_io_mod.StoreFile, "pwrite_full", slow_write)
    ref_model, model = _model(), _model()
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    _train(ref_model, ref)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    off = OffloadedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), store, chunk_bytes=8 << 10,
                             prefetch_depth=3)
    original_prefetch = off.prefetch

    def spy():
        writes = [b.pending_write for b in off.ring._free if b.pending_write is not None]  # the ring's write-backs
        in_flight_at_prefetch.append(len([h for h in writes if not h.done()]))
        original_prefetch()

    off.prefetch = spy
    _train(model, off.optimizer)
    assert max(in_flight_at_prefetch) > 0  # the overlap really happened
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    store.close()


def test_resident_memory_is_the_ring_not_the_model(tmp_path):
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    model = _model()
    off = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), store, chunk_bytes=8 << 10, prefetch_depth=2)
    _train(model, off.optimizer, steps=2, closure_style=False)
    assert off.ring.count == 4
    assert off.ring.total_bytes <= 4 * (8 << 10) + 4 * 4096
    assert off.state_bytes > 5 * off.ring.total_bytes // 4
    assert len(off.optimizer.state) == 0
    big = [c for c in off.chunks for p in c.pieces if not p.whole]
    assert big, "the 48x200 weight must have been cut into pieces"
    store.close()


def test_io_error_in_write_back_reaches_the_next_step(tmp_path, monkeypatch):
    import errno

    import pytest

    from lightning_nvme.store import StoreError

    before = {t for t in threading.enumerate() if t.name.startswith("lightning-nvme-io")}
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    model = _model()
    off = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), store, chunk_bytes=8 << 10)
    _train(model, off.optimizer, steps=1)

    def failing(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(flat_store_mod.os, "pwrite", failing)
    with pytest.raises(StoreError) as info:
        _train(model, off.optimizer, steps=2)
    assert store.path in str(info.value)
    monkeypatch.undo()
    with pytest.raises(StoreError):
        store.close()
    assert store.dispatch.engine.alive_threads == 0  # its own workers stopped (threads of other tests' stores are not ours)
    assert not [t for t in threading.enumerate() if t.name.startswith("lightning-nvme-io") and t not in before]


def test_first_update_in_backward_allocates_off_the_heap_at_the_lower_threshold(tmp_path, monkeypatch):
    """The optimizer creates its state at a chunk's first update; inside backward that state (4 MiB moments at
    chunk_bytes 8 MiB) landed on the heap under the 8 MiB off-heap threshold and stayed, pinned by backward's
    allocations: nvme_offload_fsdp's peak RSS grew ~50 MiB a block (docs/performance.md). Each chunk's first update
    in backward runs at FIRST_UPDATE_OFF_HEAP_THRESHOLD, the later ones at OFF_HEAP_THRESHOLD; training unchanged."""
    from contextlib import contextmanager

    import lightning_nvme.optim.chunk_update as offloaded_mod
    from lightning_nvme.memory import FIRST_UPDATE_OFF_HEAP_THRESHOLD, OFF_HEAP_THRESHOLD

    thresholds: list[int] = []

    @contextmanager
    def spy(threshold: int = OFF_HEAP_THRESHOLD):
        thresholds.append(threshold)
        yield

    monkeypatch.setattr(offloaded_mod, "temporaries_off_heap", spy)
    ref_model, model = _model(), _model()
    _train(ref_model, torch.optim.AdamW(ref_model.parameters()), steps=3)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    off = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), store, chunk_bytes=8 << 10, overlap="backward")
    _train(model, off.optimizer, steps=3)
    chunks = len(off.chunks)
    assert FIRST_UPDATE_OFF_HEAP_THRESHOLD < OFF_HEAP_THRESHOLD and chunks > 3
    assert thresholds[:chunks] == [FIRST_UPDATE_OFF_HEAP_THRESHOLD] * chunks  # the first step: every chunk's state new
    assert thresholds[chunks:] == [OFF_HEAP_THRESHOLD] * (2 * chunks)
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    store.close()


def test_update_temporaries_stay_off_the_heap_during_backward(tmp_path, monkeypatch):
    """overlap='backward': chunk updates interleave with backward's allocations, which pin the heap above each
    chunk's freed temporaries, so the heap grew with the model (3 GiB at 2.5 B params). Updates during backward
    therefore keep glibc's fixed mmap threshold (temporaries are returned when freed); the updates after
    backward (overlap='step') still put them on the heap. Training is unchanged (equal to in-memory AdamW)."""
    from contextlib import contextmanager

    import lightning_nvme.optim.chunk_update as offloaded_mod

    for overlap in ("backward", "step"):
        entered = []

        @contextmanager
        def spy():
            entered.append(1)
            yield

        monkeypatch.setattr(offloaded_mod, "temporaries_on_heap", spy)
        ref_model, model = _model(), _model()
        _train(ref_model, torch.optim.AdamW(ref_model.parameters()), steps=3)
        store = FlatStore(tmp_path / overlap, io_chunk_bytes=4096)
        off = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), store, chunk_bytes=8 << 10, overlap=overlap)
        _train(model, off.optimizer, steps=3)
        chunks = len(off.chunks)
        assert chunks > 3
        # backward: only the unchunked update after backward; step: every chunk too
        assert len(entered) <= 3 if overlap == "backward" else len(entered) >= 3 * chunks, (overlap, entered)
        for p, q in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(p, q)
        store.close()
