"""The transfer between a block's host buffer and the device its parameters are used on
(``lightning_nvme.params.transfer``): on CPU no copy at all; the CUDA implementation's ordering (copy on a
side stream (uploads and downloads on two), the compute stream waits on its event before the parameters point at the device buffer, a
dirty block's store write only after its device -> host copy completed, a bounded pinned pool) checked
on CPU with recorded streams and events in place of CUDA's, and training through it (the device copy a
separate buffer, the source of truth while bound) bitwise equal to in-memory training."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCudaRuntime, FakeOps, fake_cuda_transfer, install
from torch import nn

from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.params import find_blocks, is_placeholder
from lightning_nvme.params.layout import plan_layout
from lightning_nvme.params.residency import BlockResidency
from lightning_nvme.params.transfer import CudaTransfer, HostTransfer
from lightning_nvme.store import FlatStore

CPU = torch.device("cpu")


def _blocks_in_store(tmp_path, stager_of):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
    layout = plan_layout(model, find_blocks(model, None))
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    store.add_regions([(b.region, b.nbytes) for b in layout.blocks])
    capacity = max(store.region(b.region).capacity for b in layout.blocks)
    residency = BlockResidency(store, layout.blocks, max_pending_writes=2, transfer=stager_of(capacity))
    for block in layout.blocks:
        residency.place(block)
    residency.drain()
    for name in ("read", "write"):  # log the store requests in the same sequence as the CUDA calls
        def logged(region, t, offset=0, _do=getattr(store, name), _name=name, **kwargs):
            log = getattr(residency.transfer, "ops", None)
            if log is not None:
                log.log.append((_name, region))
            return _do(region, t, offset, **kwargs)
        setattr(store, name, logged)
    return model, layout.blocks, residency, store


def test_cuda_transfer_orders_copies_with_events(tmp_path, monkeypatch):
    rt = install(monkeypatch)
    ops = FakeOps()
    model, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: CudaTransfer(CPU, cap, pool_size=3, ops=ops))
    block, weight = blocks[0], model[0].weight
    assert is_placeholder(weight)  # placed: the module holds placeholders
    ops.log.clear()
    res.prefetch(block)
    res.acquire(block, "forward")
    # read into a pinned host buffer; copy to the device buffer on the upload stream (side0) between two events;
    # the compute stream waits on the copy's event; the device buffer is recorded on the compute stream
    assert ops.log == [("read", block.region), ("record", 1, "side0"), ("record", 2, "side0"), ("wait", "compute", 2),
                       ("record_stream", "compute")]
    assert weight.untyped_storage().data_ptr() not in rt.live  # views of the device copy, not of the host buffer
    expected = weight.detach() + 1
    weight.data.add_(1)  # the update, on the device copy
    res.mark_dirty(block)
    ops.log.clear()
    res.release(block, "forward")
    # the download stream (side1, not the uploads') waits for the compute stream's work (the update), then
    # copies device -> host;
    # the device copy is recorded on the download stream (the allocator must not reuse it while the copy reads it);
    # the store write waits for that copy: not issued while its event has not completed
    assert ops.log == [("record", 3, "compute"), ("wait", "side1", 3), ("record", 4, "side1"),
                       ("record", 5, "side1"), ("record_stream", "side1")]
    assert is_placeholder(weight)
    ops.log.clear()
    res.prefetch(block)  # reading it back: the write-back goes first, after its copy completed
    assert ops.log == [("sync", 5), ("write", block.region), ("read", block.region)]
    res.acquire(block, "forward")
    assert torch.equal(weight, expected)
    weight.data.add_(1)  # changed on the device only: what a state dict reads is the device copy
    assert torch.equal(res.read_values(block)["0.weight"], expected + 1)
    res.release(block, "forward")
    res.drain()
    store.close()
    stats = res.transfer.stats
    assert stats.pinned_buffers <= 3 and stats.pageable_buffers == 0
    res.transfer.close()
    assert rt.live == {}  # the pool is unregistered
    assert stats.h2d_bytes == 2 * block_capacity(store, block) and stats.d2h_bytes == 2 * block_capacity(store, block)


def test_device_copy_is_protected_on_the_stream_that_copies_it_back(tmp_path, monkeypatch):
    """Issue #33, defect 1: a dirty block's device copy is read by the device -> host copy on the download
    stream after the residency drops its last reference. The caching allocator only waits for the streams
    it knows (the upload stream it was made on, and ``record_stream``), so without the download stream among
    them the next upload could be handed that memory while the copy still reads it: the store would receive
    another block's bytes."""
    install(monkeypatch)
    ops = FakeOps()
    model, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: CudaTransfer(CPU, cap, pool_size=3, ops=ops))
    for block in blocks:
        res.acquire(block, "forward")
        with torch.no_grad():
            model[block.index].weight.add_(1)
        res.mark_dirty(block)
        res.release(block, "forward")  # evicted: the copy back is queued on ``down``, the device copy dropped
    assert len(ops.device_buffers) == len(blocks)
    # every device copy is seen read by its copy back on the download stream (side1), so the check below has
    # something to check (a copy of a view, ``device[lo:]``, counts for its allocation)
    assert all(ops.streams_using(i)[-1] == "side1" for i in range(len(blocks)))
    try:
        assert ops.unprotected_uses() == []
    finally:
        res.drain()
        store.close()


def test_shelved_dirty_block_comes_back_asynchronously_through_pinned_memory(tmp_path, monkeypatch):
    """Issue #33, finding 7: a block kept on the shelf (``host_memory_budget``) whose device copy changed was
    copied back into the shelf itself, pageable memory, and waited for at eviction: on CUDA such a copy is
    synchronous, so the host stalled on the GPU at every dirty eviction. Now the copy goes into a pinned pool
    buffer on the download stream without waiting, the device copy recorded there (the allocator waits for
    it); the shelf receives the bytes (the store write, a memory copy) once the copy's event completed, at
    the latest before the block is read again."""
    rt = install(monkeypatch)
    ops = FakeOps(runtime=rt)
    model, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: CudaTransfer(CPU, cap, pool_size=3, ops=ops))
    store.shelve([b.region for b in blocks])
    try:
        block, weight = blocks[0], model[0].weight
        shelf = store.shelved(block.region)
        assert shelf is not None
        before = shelf.clone()
        res.acquire(block, "forward")
        expected = weight.detach() + 1
        weight.data.add_(1)  # the update, on the device copy
        res.mark_dirty(block)
        ops.log.clear()
        copies = len(ops.host_ends)
        res.release(block, "forward")
        assert not [e for e in ops.log if e[0] == "sync"]  # eviction waited for nothing
        assert [s for s, _ in ops.host_ends[copies:]] == ["side1"]  # one copy back, on the download stream
        assert ops.pageable_copies("side1") == []  # into pinned memory: asynchronous on CUDA
        assert ops.unprotected_uses() == []  # the device copy is protected until that copy is done
        assert torch.equal(shelf, before)  # the shelf is written once the copy completed, not before
        ops.log.clear()
        res.prefetch(block)  # the block again: its write-back into the shelf goes first, after the copy's event
        sync = [e for e in ops.log if e[0] == "sync"]
        assert len(sync) == 1 and ops.log.index(sync[0]) < ops.log.index(("write", block.region))
        res.acquire(block, "forward")
        assert torch.equal(weight, expected)
        res.release(block, "forward")
        assert torch.equal(res.read_values(block)["0.weight"], expected)
        assert res.transfer.stats.pageable_buffers == 0
    finally:
        res.drain()
        store.close()


def block_capacity(store: FlatStore, block) -> int:
    return store.region(block.region).capacity


def test_cuda_transfer_pool_is_bounded_and_reused(tmp_path, monkeypatch):
    rt = install(monkeypatch)
    ops = FakeOps()
    _, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: CudaTransfer(CPU, cap, pool_size=2, ops=ops))
    pinned_after_setup, pageable = set(rt.live), res.transfer.stats.pageable_buffers
    assert len(pinned_after_setup) == 2
    for block in blocks:  # three blocks resident at once: the third host buffer is pageable
        res.acquire(block, "user")
    assert res.transfer.stats.pageable_buffers == pageable + 1
    for block in blocks:
        res.release(block, "user")
    for block in blocks:  # the pool's buffers are reused, none registered again
        res.acquire(block, "user")
        res.release(block, "user")
    assert set(rt.live) == pinned_after_setup and res.transfer.stats.pinned_buffers == len(pinned_after_setup)
    assert res.stats.peak_bound_blocks == 3
    res.drain()
    store.close()


def test_cuda_transfer_without_registration_falls_back_to_pageable_buffers_once(monkeypatch):
    rt = install(monkeypatch, FakeCudaRuntime(refuse=True))
    stage = CudaTransfer(CPU, 8192, pool_size=2, ops=FakeOps())
    bufs = [stage.host_buffer(8192) for _ in range(3)]
    assert len(rt.failures) == 1 and stage.stats.pageable_buffers == 3 and stage.stats.pinned_buffers == 0
    for b in bufs:
        stage.recycle(b)  # pageable buffers are not pooled
    assert stage.host_buffer(4096).numel() == 4096 and len(rt.failures) == 1


class RecordingHostTransfer(HostTransfer):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __getattribute__(self, name: str):
        attr = super().__getattribute__(name)
        if name in ("host_buffer", "caller_buffer", "recycle", "to_device", "to_host"):
            super().__getattribute__("calls").append(name)
        return attr


def test_host_transfer_is_the_same_call_sequence_without_copies(tmp_path):
    model, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: RecordingHostTransfer())
    block, weight = blocks[0], model[0].weight
    res.transfer.calls.clear()
    res.prefetch(block)
    res.acquire(block, "forward")
    host = res.read_values(block, copy=False)["0.weight"]
    assert weight.data_ptr() == host.data_ptr()  # the parameter *is* the host buffer: no copy on CPU
    weight.data.add_(1)
    res.mark_dirty(block)
    res.release(block, "forward")
    res.drain()
    assert res.transfer.calls == ["host_buffer", "to_device", "to_host", "recycle"]
    assert torch.equal(res.read_values(block)["0.weight"], host)
    store.close()


def test_training_through_cuda_transfer_is_bitwise_equal(tmp_path, tmp_path_factory, monkeypatch):
    """The whole training path with the CUDA transfer's logic (device copies as separate CPU buffers,
    events recorded): the device copy is what is updated and written back."""
    from test_param_offload import assert_same_params, fit, offload, reference

    rt, made = fake_cuda_transfer(monkeypatch)
    ref, _ = reference(tmp_path_factory, checkpointing=True)  # required on CUDA (tests/params/test_cuda_path.py)
    strategy = offload(tmp_path)
    off, t = fit(tmp_path / "off", strategy, {"checkpointing": True})
    assert_same_params(ref, off)
    stats = strategy.param_offload.stats
    assert len(made) == 1 and rt.live == {} and rt.registers > 0  # unregistered at the end of fit
    assert stats.peak_bound_blocks <= 1 + 2  # device copies: param_prefetch + 2 blocks at most
    assert 0 < stats.transfer.pinned_buffers <= 1 + 2 + 2 and stats.transfer.pageable_buffers == 0  # the pool's size
    assert stats.transfer.h2d_bytes > 0 and stats.transfer.d2h_bytes > 0
    assert made[0].ops.unprotected_uses() == []  # every device copy protected on each stream that used it


def test_training_with_blocks_on_the_shelf_through_cuda_transfer_is_bitwise_equal(tmp_path, monkeypatch):
    """Every block on the shelf (``host_memory_budget``) with the CUDA transfer's logic: each dirty block's
    device copy comes back through pinned memory (no pageable copy back), protected until copied, and the
    trained weights equal in-memory training's bitwise."""
    from test_param_offload import assert_same_params, fit, offload

    rt, made = fake_cuda_transfer(monkeypatch)
    strategy = offload(tmp_path, host_memory_budget=1 << 30)
    off, _ = fit(tmp_path / "off", strategy, {"checkpointing": True}, steps=8)
    ref8, _ = fit(tmp_path / "ref8", "auto", {"checkpointing": True}, steps=8)
    assert_same_params(ref8, off)
    ops = made[0].ops
    assert strategy.param_offload.stats.loads == 0  # every block on the shelf: never read from the disk
    assert any(s == "side1" for s, _ in ops.host_ends) and ops.pageable_copies("side1") == []
    assert ops.unprotected_uses() == [] and rt.live == {}


def test_blocks_placed_before_the_model_moves(tmp_path):
    """What the strategy does on an accelerator before ``model_to_device``: the blocks go to the store from
    host memory and the module holds placeholders made on the given device (``cuda`` there: moving the
    model then copies no block parameter; only CPU exists here)."""
    from lightning_nvme.params import ParamOffload

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    offload = ParamOffload(model)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    offload.place(store, CPU)
    assert all(is_placeholder(p) for p in model.parameters())
    for block in offload.blocks:
        for name, value in offload.residency.read_values(block).items():
            assert torch.equal(value, before[name]), name
    store.close()


def test_device_types_refused(tmp_path):
    with pytest.raises(ValueError, match="offload_params=True runs on CPU and CUDA"):
        NVMeOffloadStrategy(device="mps", offload_params=True)._check_param_offload_supported()
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.warns(UserWarning):  # no CUDA here: the scaler is built disabled, the refusal only looks at it
        scaler = torch.amp.GradScaler("cuda")
    strategy = NVMeOffloadStrategy(device="cuda:0", offload_params=True,
                                   precision_plugin=MixedPrecision("16-mixed", "cuda", scaler))
    with pytest.raises(ValueError, match="loss scaler"):
        strategy._check_param_offload_supported()
    NVMeOffloadStrategy(device="cuda:0", offload_params=True,
                        overlap="backward")._check_param_offload_supported()  # 32-true: fine


def test_overlap_step_with_offloaded_params_on_cuda_is_refused_naming_backward():
    """Issue #33, item 6: overlap='step' keeps every block's gradient on the device until the step, so device
    memory grows with the model: refused on CUDA, naming overlap='backward' (on CPU the gradients live in
    host memory beside the blocks, and overlap='step' stays allowed)."""
    from lightning_nvme.checks import ConfigError

    with pytest.raises(ConfigError, match="overlap.*overlap='backward'"):
        NVMeOffloadStrategy(device="cuda:0", offload_params=True)._check_param_offload_supported()
    NVMeOffloadStrategy(device="cpu", offload_params=True)._check_param_offload_supported()


def test_upload_starts_when_the_read_ahead_completes_and_compute_waits_only_at_acquire(tmp_path, monkeypatch):
    """A block read ahead is copied to the device as soon as its read has completed (``upload_ready``, called
    by the scheduler at each block's forward and backward), so the copy overlaps the blocks before it; the
    compute stream waits for it only when the block is acquired, and no second copy is made then."""
    install(monkeypatch)
    ops = FakeOps()
    model, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: CudaTransfer(CPU, cap, pool_size=3, ops=ops))
    first, ahead = blocks[0], blocks[1]
    res.acquire(first, "forward")
    res.prefetch(ahead)
    res._state[ahead.index].read.wait()  # the read ahead completes (the disk is faster than the block's compute)
    ops.log.clear()
    res.upload_ready()
    assert ops.log == [("record", 3, "side0"), ("record", 4, "side0")]  # the copy only: nothing waits for it
    assert res.stats.early_uploads == 1 and is_placeholder(model[1].weight)
    ops.log.clear()
    res.upload_ready()  # started already: not again
    assert ops.log == []
    res.acquire(ahead, "forward")
    assert ops.log == [("wait", "compute", 4), ("record_stream", "compute")]  # bound to the early copy
    expected = res.read_values(ahead)["1.weight"]
    assert torch.equal(model[1].weight, expected)
    res.release(ahead, "forward")
    res.release(first, "forward")
    res.prefetch(blocks[2])
    res._state[blocks[2].index].read.wait()
    res.upload_ready()
    res.evict_unheld()  # read ahead, uploaded, never used: dropped, its host buffer back in the pool
    assert res.resident_blocks == [] and res.stats.early_uploads == 2
    res.drain()
    store.close()


@pytest.mark.parametrize("device", ["host", "cuda-logic"])
def test_update_reads_only_the_trainable_tail(tmp_path, monkeypatch, device):
    """``acquire(tail=True)`` (an optimizer update) of a block not in memory reads its trainable tail alone: the
    frozen parameters stay placeholders. The block's true values while so (``read_values``), once needed whole
    (an acquire for forward: the changed tail written back, the block read), and after eviction are the updated
    ones, through either transfer."""
    if device == "cuda-logic":
        install(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2)) for _ in range(2)))
    for block in model:
        block[0].requires_grad_(False)  # a frozen head, a trainable tail (LoRA's shape)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    layout = plan_layout(model, find_blocks(model, None))
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    store.add_regions([(b.region, b.nbytes) for b in layout.blocks])
    capacity = max(store.region(b.region).capacity for b in layout.blocks)
    mover = CudaTransfer(CPU, capacity, pool_size=3, ops=FakeOps()) if device == "cuda-logic" else HostTransfer()
    res = BlockResidency(store, layout.blocks, max_pending_writes=2, transfer=mover)
    for block in layout.blocks:
        res.place(block)
    res.drain()
    block = layout.blocks[1]
    assert 0 < block.writable_offset < block.nbytes
    res.acquire(block, "update", tail=True)
    frozen, trainable = model[1][0], model[1][1]
    assert is_placeholder(frozen.weight) and is_placeholder(frozen.bias)
    assert torch.equal(trainable.weight, original["1.1.weight"])
    assert res.stats.tail_loads == 1 and res.stats.resident_blocks == 0
    assert res.stats.bytes_read == capacity - block.writable_offset  # the tail's pages, not the block
    with torch.no_grad():
        trainable.weight.add_(1)  # the update
    res.mark_dirty(block)
    values = res.read_values(block)
    assert torch.equal(values["1.0.weight"], original["1.0.weight"])
    assert torch.equal(values["1.1.weight"], original["1.1.weight"] + 1)
    res.acquire(block, "forward")  # needed whole: the tail written back, the block read
    assert torch.equal(frozen.weight, original["1.0.weight"])
    assert torch.equal(trainable.weight, original["1.1.weight"] + 1)
    assert dict(+res.holders(block)) == {"update": 1, "forward": 1}
    res.release(block, "update")
    with torch.no_grad():
        trainable.bias.add_(2)
    res.mark_dirty(block)
    res.release(block, "forward")
    res.drain()
    assert is_placeholder(frozen.weight) and is_placeholder(trainable.weight)
    values = res.read_values(block)
    assert torch.equal(values["1.0.weight"], original["1.0.weight"])
    assert torch.equal(values["1.1.weight"], original["1.1.weight"] + 1)
    assert torch.equal(values["1.1.bias"], original["1.1.bias"] + 2)
    store.close()


def test_dirty_tail_copies_only_the_tail_back(tmp_path, monkeypatch):
    """Issue #33, item 11: a block bound whole whose trainable tail changed (a LoRA block after its update)
    copies only that tail device -> host: the frozen head is not written back, so it does not come back."""
    install(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2)) for _ in range(2)))
    for block in model:
        block[0].requires_grad_(False)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    layout = plan_layout(model, find_blocks(model, None))
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    try:
        store.add_regions([(b.region, b.nbytes) for b in layout.blocks])
        capacity = max(store.region(b.region).capacity for b in layout.blocks)
        mover = CudaTransfer(CPU, capacity, pool_size=3, ops=FakeOps())
        res = BlockResidency(store, layout.blocks, max_pending_writes=2, transfer=mover)
        for block in layout.blocks:
            res.place(block)
        res.drain()
        block = layout.blocks[0]
        res.acquire(block, "forward")
        with torch.no_grad():
            model[0][1].weight.add_(1)
        res.mark_dirty(block)
        mover.collect(wait=True)
        before = mover.stats.d2h_bytes
        res.release(block, "forward")
        res.drain()
        mover.collect(wait=True)
        tail = store.region(block.region).capacity - block.writable_offset
        assert 0 < tail < capacity and mover.stats.d2h_bytes - before == tail
        values = res.read_values(block)  # from the store: the updated tail, the head unchanged
        assert torch.equal(values["0.1.weight"], original["0.1.weight"] + 1)
        assert torch.equal(values["0.0.weight"], original["0.0.weight"])
    finally:
        store.close()


def test_early_upload_fires_at_the_default_prefetch(tmp_path, monkeypatch):
    """Issue #33, item 4: at ``param_prefetch=1`` the next block's read is issued at a block's pre-forward, right
    before the upload check there, so that check never found it complete and the block was bound before the
    next check: no early upload at all. A read here completes during the block's compute (``done()`` is False
    when first asked, right after it was issued); the post-forward check (and the ones at the top of ``acquire``
    and post-backward) starts its copy one block's compute before it is needed."""
    from lightning_nvme.params.schedule import BlockScheduler

    install(monkeypatch)
    ops = FakeOps()
    model, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: CudaTransfer(CPU, cap, pool_size=4, ops=ops))
    read = store.read

    def read_completing_during_compute(region, t, offset=0):
        handle = read(region, t, offset)
        asked = []

        def done() -> bool:
            if not asked:
                asked.append(True)
                return False  # just issued
            store.wait(handle)
            return True
        handle.done = done
        return handle

    store.read = read_completing_during_compute
    scheduler = BlockScheduler(res, prefetch=1)
    scheduler.install()
    try:
        with torch.no_grad():
            model(torch.randn(2, 64))
        scheduler.finish_step()
        assert res.stats.early_uploads == len(blocks) - 1  # every block after the first
        assert res.stats.peak_bound_blocks <= 1 + 2
    finally:
        scheduler.remove()
        res.drain()
        store.close()


def test_host_staging_pools_block_buffers_and_passes_over_held_ones():
    """CPU block buffers are recycled (no fresh mapping to fault in per read), within the pool's size; a buffer
    something still holds (autograd's saved view) is not handed out until it is let go; small requests are not
    pooled."""
    stage = HostTransfer(buffer_bytes=1 << 16, pool_size=2)
    a, b = stage.host_buffer(1 << 16), stage.host_buffer((1 << 16) - 4096)
    assert stage.host_buffer(1 << 16).data_ptr() not in (a.data_ptr(), b.data_ptr())  # beyond the pool: its own
    assert stage.stats.pool_buffers == 2
    small = stage.host_buffer(4096)  # a LoRA tail: its own small mapping
    stage.recycle(small)
    a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
    stage.recycle(a)
    stage.recycle(a)  # twice (a clean eviction, then a drain): pooled once
    del a
    again = stage.host_buffer(1 << 15)
    assert again.data_ptr() == a_ptr and again.numel() == 1 << 15  # reused: no new mapping
    held = b[:1024].view(torch.float32)  # what autograd's saved tensor would keep
    held.fill_(1.0)
    stage.recycle(b)
    del b
    other = stage.host_buffer(1 << 16)
    assert other.data_ptr() != b_ptr and stage.stats.pool_buffers_held == 1  # not overwritten under its holder
    assert stage.stats.pool_buffers == 2 and bool((held == 1.0).all())
    del held
    assert stage.host_buffer(1 << 16).data_ptr() == b_ptr  # let go: reused
    stage.close()
    stage.host_buffer(1 << 16)
    assert stage.stats.pool_buffers == 2  # closed: later needs get their own mappings
