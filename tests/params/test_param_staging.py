"""The staging between a block's host buffer and the device its parameters are used on
(``lightning_nvme.params.staging``): on CPU no copy at all; the CUDA implementation's ordering (copy on a
side stream, the compute stream waits on its event before the parameters point at the device buffer, a
dirty block's store write only after its device -> host copy completed, a bounded pinned pool) checked
on CPU with recorded streams and events in place of CUDA's, and training through it (the device copy a
separate buffer, the source of truth while bound) bitwise equal to in-memory training."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.params import find_blocks, is_placeholder, staging
from lightning_nvme.params.layout import plan_layout
from lightning_nvme.params.residency import BlockResidency
from lightning_nvme.params.staging import CudaStaging, HostStaging
from lightning_nvme.store import FlatStore

CPU = torch.device("cpu")


class FakeEvent:
    """A CUDA event that completes only when synchronized (so nothing may rely on it having run)."""

    def __init__(self, log: list, n: int) -> None:
        self.log, self.n, self.done = log, n, False

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.n, stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.log.append(("sync", self.n))
            self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.0  # ms


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.n))


class FakeOps:
    """Records the CUDA calls of ``CudaStaging``; the copies themselves run on CPU tensors."""

    def __init__(self) -> None:
        self.log: list = []
        self.events = 0
        self.compute = FakeStream(self.log, "compute")
        self.pinned: set[int] = set()

    def stream(self, device: torch.device) -> FakeStream:
        return FakeStream(self.log, "side")

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.compute

    def on(self, stream: FakeStream) -> nullcontext:
        return nullcontext()

    def event(self, timing: bool = False) -> FakeEvent:
        self.events += 1
        return FakeEvent(self.log, self.events)

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name))

    def pin(self, t: torch.Tensor) -> bool:
        self.pinned.add(t.data_ptr())
        return True

    def unpin(self, t: torch.Tensor) -> None:
        self.pinned.remove(t.data_ptr())


def _blocks_in_store(tmp_path, stager_of):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
    layout = plan_layout(model, find_blocks(model, None))
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    store.add_regions([(b.region, b.nbytes) for b in layout.blocks])
    capacity = max(store.region(b.region).capacity for b in layout.blocks)
    residency = BlockResidency(store, layout.blocks, max_pending_writes=2, staging=stager_of(capacity))
    for block in layout.blocks:
        residency.place(block)
    residency.drain()
    for name in ("read", "write"):  # log the store requests in the same sequence as the CUDA calls
        def logged(region, t, offset=0, _do=getattr(store, name), _name=name):
            log = getattr(residency.staging, "ops", None)
            if log is not None:
                log.log.append((_name, region))
            return _do(region, t, offset)
        setattr(store, name, logged)
    return model, layout.blocks, residency, store


def test_cuda_staging_orders_copies_with_events(tmp_path):
    ops = FakeOps()
    model, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: CudaStaging(CPU, cap, pool_size=3, ops=ops))
    block, weight = blocks[0], model[0].weight
    assert is_placeholder(weight)  # placed: the module holds placeholders
    ops.log.clear()
    res.prefetch(block)
    res.acquire(block, "forward")
    # read into a pinned host buffer; copy to the device buffer on the side stream between two events;
    # the compute stream waits on the copy's event; the device buffer is recorded on the compute stream
    assert ops.log == [("read", block.region), ("record", 1, "side"), ("record", 2, "side"), ("wait", "compute", 2),
                       ("record_stream", "compute")]
    assert weight.untyped_storage().data_ptr() not in ops.pinned  # views of the device copy, not of the host buffer
    expected = weight.detach() + 1
    weight.data.add_(1)  # the update, on the device copy
    res.mark_dirty(block)
    ops.log.clear()
    res.release(block, "forward")
    # the side stream waits for the compute stream's work (the update), then copies device -> host;
    # the store write waits for that copy: not issued while its event has not completed
    assert ops.log == [("record", 3, "compute"), ("wait", "side", 3), ("record", 4, "side"), ("record", 5, "side")]
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
    stats = res.staging.stats
    assert stats.pinned_buffers <= 3 and stats.pageable_buffers == 0
    res.staging.close()
    assert ops.pinned == set()  # the pool is unregistered
    assert stats.h2d_bytes == 2 * block_capacity(store, block) and stats.d2h_bytes == 2 * block_capacity(store, block)


def block_capacity(store: FlatStore, block) -> int:
    return store.region(block.region).capacity


def test_cuda_staging_pool_is_bounded_and_reused(tmp_path):
    ops = FakeOps()
    _, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: CudaStaging(CPU, cap, pool_size=2, ops=ops))
    pinned_after_setup, pageable = set(ops.pinned), res.staging.stats.pageable_buffers
    assert len(pinned_after_setup) == 2
    for block in blocks:  # three blocks resident at once: the third host buffer is pageable
        res.acquire(block, "user")
    assert res.staging.stats.pageable_buffers == pageable + 1
    for block in blocks:
        res.release(block, "user")
    for block in blocks:  # the pool's buffers are reused, none registered again
        res.acquire(block, "user")
        res.release(block, "user")
    assert ops.pinned == pinned_after_setup and res.staging.stats.pinned_buffers == len(pinned_after_setup)
    assert res.stats.peak_bound_blocks == 3
    res.drain()
    store.close()


def test_cuda_staging_without_registration_falls_back_to_pageable_buffers_once():
    class Refusing(FakeOps):
        def pin(self, t: torch.Tensor) -> bool:
            self.log.append("pin")
            return False

    ops = Refusing()
    stage = CudaStaging(CPU, 8192, pool_size=2, ops=ops)
    bufs = [stage.host_buffer(8192) for _ in range(3)]
    assert ops.log == ["pin"] and stage.stats.pageable_buffers == 3 and stage.stats.pinned_buffers == 0
    for b in bufs:
        stage.recycle(b)  # pageable buffers are not pooled
    assert stage.host_buffer(4096).numel() == 4096 and ops.log == ["pin"]


class RecordingHostStaging(HostStaging):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __getattribute__(self, name: str):
        attr = super().__getattribute__(name)
        if name in ("host_buffer", "caller_buffer", "recycle", "to_device", "to_host"):
            super().__getattribute__("calls").append(name)
        return attr


def test_host_staging_is_the_same_call_sequence_without_copies(tmp_path):
    model, blocks, res, store = _blocks_in_store(tmp_path, lambda cap: RecordingHostStaging())
    block, weight = blocks[0], model[0].weight
    res.staging.calls.clear()
    res.prefetch(block)
    res.acquire(block, "forward")
    host = res.read_values(block, copy=False)["0.weight"]
    assert weight.data_ptr() == host.data_ptr()  # the parameter *is* the host buffer: no copy on CPU
    weight.data.add_(1)
    res.mark_dirty(block)
    res.release(block, "forward")
    res.drain()
    assert res.staging.calls == ["host_buffer", "to_device", "to_host", "recycle"]
    assert torch.equal(res.read_values(block)["0.weight"], host)
    store.close()


def test_training_through_cuda_staging_is_bitwise_equal(tmp_path, tmp_path_factory, monkeypatch):
    """The whole training path with the CUDA staging's logic (device copies as separate CPU buffers,
    events recorded): the device copy is what is updated and written back."""
    from test_param_offload import assert_same_params, fit, offload, reference

    made: list[CudaStaging] = []

    def fake_cuda(device, buffer_bytes, pool_size):
        made.append(CudaStaging(device, buffer_bytes, pool_size, ops=FakeOps()))
        return made[-1]

    monkeypatch.setattr(staging, "staging_for", fake_cuda)
    ref, _ = reference(tmp_path_factory)
    strategy = offload(tmp_path)
    off, t = fit(tmp_path / "off", strategy)
    assert_same_params(ref, off)
    stats = strategy.param_offload.stats
    assert len(made) == 1 and made[0].ops.pinned == set()  # unregistered at the end of fit
    assert stats.peak_bound_blocks <= 1 + 2  # device copies: param_prefetch + 2 blocks at most
    assert 0 < stats.staging.pinned_buffers <= 1 + 2 + 2 and stats.staging.pageable_buffers == 0  # the pool's size
    assert stats.staging.h2d_bytes > 0 and stats.staging.d2h_bytes > 0


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
    NVMeOffloadStrategy(device="cuda:0", offload_params=True)._check_param_offload_supported()  # 32-true: fine
