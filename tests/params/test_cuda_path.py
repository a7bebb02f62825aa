"""The CUDA path's defects of issue #24, each checked on CPU through the fake CUDA of ``fake_cuda``:
registered host memory (who pins, unregistering before freeing, errors cleared, portable flag), where the
weights go at the end of fit (``restore_params`` both ways), the device footprint without activation
checkpointing, slot alignment, and the optimizer's state upload."""

from __future__ import annotations

import gc

import pytest
import torch
from fake_cuda import ERROR_ALREADY_REGISTERED, FakeCudaRuntime, FakeOps, install
from torch import nn

from lightning_nvme.params import ParamOffload, is_placeholder, transfer
from lightning_nvme.params.layout import plan_layout
from lightning_nvme.params.policy import find_blocks
from lightning_nvme.params.transfer import CudaTransfer, HostTransfer
from lightning_nvme.store import FlatStore, aligned_empty

CPU = torch.device("cpu")


# ---- 1. registered host memory: only where a device copy uses it, unregistered before it is freed -----------
def test_cpu_run_on_a_gpu_host_registers_no_host_memory(tmp_path, monkeypatch):
    """A CPU-only run (tests, ``doctor``) on a machine with a GPU must not pin: pinning creates a CUDA context
    and pins the store's staging pool, the optimizer's ring and every block buffer for nothing."""
    rt = install(monkeypatch)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    store.add_regions([("r", 1 << 16)])
    data = torch.arange(1 << 14, dtype=torch.float32)
    store.wait(store.write("r", data[1:]))  # not page-aligned: through the staging pool
    out = store.aligned_empty(1 << 16)
    store.wait(store.read("r", out))
    HostTransfer().host_buffer(1 << 16)  # a CPU-device block load
    store.close()
    assert rt.registers == 0 and rt.live == {}


def test_freed_pinned_buffers_are_unregistered_and_their_address_reusable(monkeypatch):
    """A registered buffer freed without ``cudaHostUnregister`` keeps its pages pinned, and the next buffer
    the kernel maps at the same address fails with ``cudaErrorHostMemoryAlreadyRegistered``."""
    rt = install(monkeypatch)
    for _ in range(4):
        buf = aligned_empty(1 << 20, pin=True)
        buf.fill_(1)
        del buf
        gc.collect()
    assert ERROR_ALREADY_REGISTERED not in rt.failures
    assert rt.live == {} and rt.registers == rt.unregisters == 4


def test_cuda_transfer_pool_unregistered_at_close_and_when_dropped(monkeypatch):
    rt = install(monkeypatch)
    stage = CudaTransfer(CPU, 8192, pool_size=2, ops=FakeOps())
    bufs = [stage.host_buffer(8192) for _ in range(2)]
    assert len(rt.live) == 2 and stage.stats.pinned_buffers == 2
    stage.close()
    assert rt.live == {}  # unregistered although the caller still holds the buffers
    del bufs
    stage = CudaTransfer(CPU, 8192, pool_size=2, ops=FakeOps())
    stage.host_buffer(8192)
    del stage  # never closed (an exception in setup): freeing the memory unregisters it first
    gc.collect()
    assert rt.live == {} and rt.registers == rt.unregisters == 3 and rt.failures == []


def test_optimizer_ring_pinned_only_for_cuda_parameters_and_unpinned_at_close(tmp_path, monkeypatch):
    """The optimizer's chunk ring is what a device copies state from when the parameters are on CUDA: pinned
    then (and unregistered when the optimizer closes at the end of fit), never for CPU parameters."""
    from lightning_nvme.optim.buffers import ChunkRing
    from lightning_nvme.optim.offloaded import OffloadedOptimizer

    rt = install(monkeypatch)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    model = nn.Linear(64, 64)
    off = OffloadedOptimizer(torch.optim.AdamW(model.parameters()), store, chunk_bytes=8192)
    model(torch.randn(4, 64)).sum().backward()
    off.optimizer.step()
    off.close()
    assert rt.registers == 0 and not off.ring.pin
    ring = ChunkRing(store, 3, 8192, pin=True)
    assert len(rt.live) == 3
    ring.unpin()
    assert rt.live == {} and rt.unregisters == 3
    store.close()


# ---- 2. a refused registration leaves no CUDA error behind -------------------------------------------------
def test_refused_registration_clears_cuda_last_error(monkeypatch):
    """torch's ``cudaHostRegister`` binding returns the error but leaves it as CUDA's last error: the next
    kernel launch would raise it as its own ("part or all of the requested memory range is already mapped")."""
    rt = install(monkeypatch, FakeCudaRuntime(refuse=True))
    buf = aligned_empty(8192, pin=True)  # falls back to pageable memory
    assert buf.numel() == 8192 and rt.failures
    rt.launch()  # raises if the failure was left as the last error


def test_refused_registration_in_cuda_transfer_falls_back_and_clears(monkeypatch):
    rt = install(monkeypatch, FakeCudaRuntime(refuse=True))
    stage = CudaTransfer(CPU, 8192, pool_size=2, ops=FakeOps())
    bufs = [stage.host_buffer(8192) for _ in range(3)]
    assert len(rt.failures) == 1 and stage.stats.pageable_buffers == 3 and stage.stats.pinned_buffers == 0
    rt.launch()
    del bufs


# ---- 9. portable registration -----------------------------------------------------------------------------
def test_registration_is_portable(monkeypatch):
    """Flag 0 registers for the current context only; ``cudaHostRegisterPortable`` (1) for all of them."""
    rt = install(monkeypatch)
    aligned_empty(8192, pin=True)
    CudaTransfer(CPU, 8192, pool_size=1, ops=FakeOps()).host_buffer(8192)
    gc.collect()
    assert rt.flags == [1, 1]


def test_unregistered_under_the_device_that_registered_it_on_any_thread(monkeypatch):
    """Issue #33, item 11: the last reference to a pinned buffer may go on a thread that never set a device
    (an I/O worker, the garbage collector's); CUDA makes device 0 current there, which on a rank bound to
    another GPU creates a context on a device it does not own. ``CudaRuntime`` unregisters under the device
    current at registration. (A thread-local current device stands in for CUDA's.)"""
    import threading
    from contextlib import contextmanager

    from lightning_nvme.store.pinned import SUCCESS, CudaRuntime

    rt = install(monkeypatch)
    current = threading.local()
    seen: list[int] = []

    def current_device() -> int:
        return getattr(current, "device", 0)  # a fresh thread: device 0, as CUDA's runtime

    @contextmanager
    def device(index: int):
        before, current.device = current_device(), index
        try:
            yield
        finally:
            current.device = before

    binding = rt.binding()
    unregister = binding.cudaHostUnregister
    binding.cudaHostUnregister = lambda ptr: seen.append(current_device()) or unregister(ptr)  # type: ignore[method-assign]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: binding)
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    monkeypatch.setattr(torch.cuda, "device", device)
    cuda = CudaRuntime()
    buf = aligned_empty(8192)
    current.device = 1  # this rank's GPU
    assert cuda.register(buf.data_ptr(), 8192, 1) == SUCCESS
    worker = threading.Thread(target=cuda.unregister, args=(buf.data_ptr(),))
    worker.start()
    worker.join()
    assert seen == [1] and rt.live == {}


# ---- 3 and 4. the end of fit on an accelerator -------------------------------------------------------------
CUDA = torch.device("cuda", 0)


class OnCuda(nn.Parameter):
    """A parameter that says it is on the GPU (its values are in host memory: no GPU here). Placeholders made
    "on" its device come from ``spy_placeholders`` as host tensors, recorded with the device asked for."""

    @property
    def device(self) -> torch.device:
        return CUDA


def spy_placeholders(monkeypatch) -> dict[int, torch.device]:
    """Storage address of each placeholder made by the residency -> the device it was made for."""
    from lightning_nvme.params import block_state as residency  # the residency's placeholders are made there

    made: dict[int, torch.device] = {}
    real = residency.placeholder

    def on_host(shape, dtype, device):
        t = real(shape, dtype, CPU)
        made[t.untyped_storage().data_ptr()] = torch.device(device)
        return t

    monkeypatch.setattr(residency, "placeholder", on_host)
    return made


def _offloaded_on_cuda(tmp_path, monkeypatch):
    """Blocks placed with placeholders on the GPU before the model moves there (``model_to_device`` on CUDA);
    host buffers are bound as they are (the transfer is not what is checked here)."""
    monkeypatch.setattr(transfer, "transfer_for", lambda device, buffer_bytes, pool_size: HostTransfer())
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
    for m in model:
        m.weight, m.bias = OnCuda(m.weight.detach()), OnCuda(m.bias.detach())
    values = {k: v.clone() for k, v in model.state_dict().items()}
    offload = ParamOffload(model, device=CUDA)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    offload.place(store, CUDA)
    offload.start(store)
    return model, values, offload, store


def test_restore_params_true_restores_into_host_memory(tmp_path, monkeypatch):
    """``restore_params=True`` must bring the weights back into host memory: copying every block to the GPU
    at the end of fit is an out-of-memory exactly when offload was needed (Lightning's teardown moves the
    model to the CPU right after anyway)."""
    spy_placeholders(monkeypatch)
    model, values, offload, store = _offloaded_on_cuda(tmp_path, monkeypatch)
    offload.stop(restore=True)  # a copy to CUDA raises here: torch has no CUDA on this machine
    for name, p in model.named_parameters():
        assert p.data.device == CPU and not is_placeholder(p.data), name
        assert torch.equal(p.data, values[name]), name
    store.close()


def test_restore_params_false_leaves_host_placeholders(tmp_path, monkeypatch):
    """``restore_params=False``: the placeholders (one element, stride 0) are rebound to the CPU before
    Lightning's teardown moves the model there; ``.cpu()`` of an expanded device tensor allocates a full-size
    (NaN) tensor for every parameter, i.e. the whole model in host RAM."""
    made = spy_placeholders(monkeypatch)
    model, _, offload, store = _offloaded_on_cuda(tmp_path, monkeypatch)
    assert {made[p.untyped_storage().data_ptr()] for p in model.parameters()} == {CUDA}
    offload.stop(restore=False)
    for name, p in model.named_parameters():
        assert made[p.untyped_storage().data_ptr()] == CPU, f"{name}: its placeholder is still on the GPU"
        assert is_placeholder(p.data) and p.untyped_storage().nbytes() == p.element_size(), name
    store.close()


# ---- 5. device memory without activation checkpointing ---------------------------------------------------
class _Cuda(CudaTransfer):
    """The CUDA transfer's logic on CPU (fake streams and events, registration through the fake runtime)."""

    made: list[_Cuda] = []

    def __init__(self, device, buffer_bytes, pool_size):
        super().__init__(CPU, buffer_bytes, pool_size, ops=FakeOps())
        _Cuda.made.append(self)


def _blocks_on_fake_cuda(tmp_path, monkeypatch, checkpointing: bool):
    from torch.utils.checkpoint import checkpoint

    install(monkeypatch)
    _Cuda.made = []
    monkeypatch.setattr(transfer, "transfer_for", _Cuda)
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))

    def forward(x):
        for b in blocks:
            x = checkpoint(b, x, use_reentrant=False) if checkpointing else b(x)
        return x

    offload = ParamOffload(blocks, prefetch=1)
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    offload.start(store)
    return forward, offload, store


def test_cuda_forward_without_checkpointing_refuses(tmp_path, monkeypatch):
    """``F.linear`` saves a view of the weight (``weight.t()``), not the Parameter: each block's device copy
    would live until its backward (which uploads a second one): the whole model on the GPU. Refused at the
    first block whose copy autograd keeps, naming activation checkpointing."""
    from lightning_nvme.checks import ConfigError

    forward, offload, store = _blocks_on_fake_cuda(tmp_path, monkeypatch, checkpointing=False)
    x = torch.randn(8, 64, requires_grad=True)
    with pytest.raises(ConfigError, match="activation checkpointing"):
        forward(x)
    with torch.no_grad():  # nothing saved: fine
        forward(x)
    store.close()


def test_cuda_device_copies_bounded_with_checkpointing(tmp_path, monkeypatch):
    forward, offload, store = _blocks_on_fake_cuda(tmp_path, monkeypatch, checkpointing=True)
    ops = _Cuda.made[0].ops
    x = torch.randn(8, 64, requires_grad=True)
    out = forward(x)
    assert ops.live_device_buffers() <= offload.prefetch + 1  # the blocks kept for the backward
    out.sum().backward()
    offload.finish_step()
    assert ops.live_device_buffers() == 0
    assert all(p.grad is not None for p in offload.model.parameters())
    offload.stop(restore=True)
    store.close()


# ---- 6. slot alignment -------------------------------------------------------------------------------------
def test_every_slot_is_256_byte_aligned():
    """cuBLASLt picks kernels by pointer alignment (up to 256 B, what the caching allocator gives): a weight
    at a 64-byte offset may run another kernel than in memory and break bitwise equality."""
    sizes = [(3, 5), (7,), (64, 3), (1,), (33, 17), (5,)]
    blocks = nn.ModuleList(nn.ParameterList(nn.Parameter(torch.zeros(s, dtype=dt)) for s in sizes)
                           for dt in (torch.float32, torch.bfloat16))
    layout = plan_layout(blocks, find_blocks(blocks, None))
    slots = [s for b in layout.blocks for s in b.slots]
    assert len(slots) == 2 * len(sizes)
    for s in slots:
        assert s.offset % 256 == 0, f"{s.name} at offset {s.offset}"


def test_checkpoint_saved_with_64_byte_slots_loads_into_256_byte_slots(tmp_path, monkeypatch):
    """Checkpoints hold block weights by name (inline, or beside in safetensors), never a region's bytes, and
    every run creates its own store: one saved before the alignment changed loads as it is."""
    from _param_offload_model import TinyGPT
    from test_param_offload import offload, trainer

    from lightning_nvme.params import layout

    monkeypatch.setattr(layout, "PARAM_SLOT_ALIGN", 64)
    old = trainer(tmp_path / "old", offload(tmp_path / "old", restore_params=False, inline_weights_bytes=0), steps=2)
    old.fit(TinyGPT())
    assert any(s.offset % 256 for b in old.strategy.param_offload.blocks for s in b.slots)  # the old layout
    old.save_checkpoint(tmp_path / "old.ckpt")
    saved = torch.load(tmp_path / "old.ckpt", weights_only=True)["state_dict"]
    monkeypatch.setattr(layout, "PARAM_SLOT_ALIGN", 256)
    model = TinyGPT()
    new = trainer(tmp_path / "new", offload(tmp_path / "new"), steps=2)
    new.fit(model, ckpt_path=str(tmp_path / "old.ckpt"))  # at max_steps already: loads, restores the weights
    assert all(s.offset % 256 == 0 for b in new.strategy.param_offload.blocks for s in b.slots)
    for name, p in model.state_dict().items():
        assert torch.equal(p, saved[name]), name


def test_step_end_does_not_wait_for_the_device(tmp_path, monkeypatch):
    """Issue #33, item 5: the end of a step used to force every pending write-back, synchronizing on each
    device -> host copy (the host waited for the GPU every step). Now it hands over only the copies that have
    completed; the rest are issued later (polled), or when a checkpoint asks (``issue_writes``). The fake
    events complete only when synchronized: no synchronization at the step's end, and the values in the
    store are right once asked for."""
    forward, offload, store = _blocks_on_fake_cuda(tmp_path, monkeypatch, checkpointing=True)
    try:
        x = torch.randn(8, 64, requires_grad=True)
        forward(x).sum().backward()
        for block in offload.blocks:  # an update: every block changed and written back at its release
            offload.residency.acquire(block, "update")
            with torch.no_grad():
                block.slots[0].param.add_(1)
            expected = block.slots[0].param.detach().clone()
            offload.residency.mark_dirty(block)
            offload.residency.release(block, "update")
        ops = _Cuda.made[0].ops
        ops.log.clear()
        offload.finish_step()
        assert [e for e in ops.log if e[0] == "sync"] == []  # the host did not wait for the GPU
        offload.issue_writes()  # what a checkpoint does first
        assert torch.equal(offload.residency.read_values(offload.blocks[-1])[offload.blocks[-1].slots[0].name],
                           expected)
    finally:
        offload.residency.drain()
        store.close()
