"""ActivationOffloader (no Lightning): exact gradients, what is and is not offloaded, edge cases."""

from __future__ import annotations

import copy
import gc
import traceback

import pytest
import torch
from _activation_offload_model import TinyGPT, held_bytes, pending_io
from torch.utils.checkpoint import checkpoint

from lightning_nvme.activations import ActivationOffloader, ActivationSettings
from lightning_nvme.checks import ConfigError
from lightning_nvme.store import FlatStore

KiB = 1024


@pytest.fixture
def store(tmp_path):
    s = FlatStore(tmp_path, name="activations-test", io_chunk_bytes=64 * KiB, staging_bytes=256 * KiB, io_workers=2)
    yield s
    s.close(delete=True)


def make_offloader(store: FlatStore, *, grow_fraction: float = 0.5, **settings) -> ActivationOffloader:
    settings.setdefault("min_bytes", 4 * KiB)
    settings.setdefault("min_segment_bytes", 256 * KiB)
    return ActivationOffloader(store, ActivationSettings(**settings), grow_fraction=grow_fraction)


def offloaded_step(off: ActivationOffloader, exclude, fn, *, drain_before_backward: bool = True,
                   retain: bool = False) -> torch.Tensor:
    """One forward/backward under the offloader. ``drain_before_backward`` finishes the writes first so
    backward really reads from the disk (otherwise tiny tests would hit the still-held memory)."""
    off.begin(exclude=list(exclude.parameters()) if isinstance(exclude, torch.nn.Module) else [exclude])
    loss = fn()
    if drain_before_backward:
        off.store.fence()
    off.end_forward()
    loss.backward(retain_graph=retain)
    return loss


def hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def batch(seed: int = 0, b: int = 4, t: int = 32, vocab: int = 32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


def assert_same_params_and_grads(m0: torch.nn.Module, m1: torch.nn.Module) -> None:
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters()):
        assert torch.equal(p0, p1), f"parameter {name} differs"
        assert (p0.grad is None) == (p1.grad is None) and (p0.grad is None or torch.equal(p0.grad, p1.grad)), name


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_training_is_bitwise_identical(store, autocast, reentrant):
    torch.manual_seed(0)
    m0 = TinyGPT(layers=4, reentrant=reentrant)
    m1 = copy.deepcopy(m0)
    opt0, opt1 = torch.optim.AdamW(m0.parameters(), lr=1e-2), torch.optim.AdamW(m1.parameters(), lr=1e-2)
    off = make_offloader(store)
    for step in range(3):
        idx, tgt = batch(step)
        for m, opt, offloader in ((m0, opt0, None), (m1, opt1, off)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if offloader is None:
                    m(idx, tgt).backward()
                else:
                    offloaded_step(offloader, m, lambda m=m: m(idx, tgt))
            opt.step()
        off.end_step()
        assert_same_params_and_grads(m0, m1)
        stats = off.last_step_stats
        # 4 block inputs + the head's input left memory; all but the kept last one came back from disk
        assert stats.storages == 5
        assert stats.bytes_written >= 4 * 4 * 32 * 32 * (2 if autocast else 4)
        assert stats.prefetch_hits == 4 and stats.misses == 0 and stats.memory_hits == 1
    assert pending_io(off) == 0 and held_bytes(off) == 0 and not hooks_installed()


def test_activation_area_is_reused_not_grown(store):
    model = TinyGPT(layers=4)
    off = make_offloader(store, min_segment_bytes=64 * KiB, grow_fraction=0.5)
    sizes = []
    for step in range(3):
        offloaded_step(off, model, lambda: model(*batch(step)))
        off.end_step()
        sizes.append((store.size_bytes, len(off.arena.segments)))
    assert sizes[0] == sizes[1] == sizes[2], sizes
    first = off.arena.capacity_bytes
    offloaded_step(off, model, lambda: model(*batch(3, b=8)))  # a bigger step grows the area once
    off.end_step()
    grown = (store.size_bytes, off.arena.capacity_bytes)
    assert grown[1] > first
    for step in range(2):
        offloaded_step(off, model, lambda: model(*batch(step, b=8)))
        off.end_step()
        assert (store.size_bytes, off.arena.capacity_bytes) == grown
    assert all(r.offset % 4096 == 0 and r.capacity % 4096 == 0 for r in off.arena.segments)


def test_parameters_and_their_views_are_never_offloaded(store):
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(128, 64, requires_grad=True)
    (x @ w.t()).sum().backward()
    expected, w.grad = w.grad.clone(), None
    off = make_offloader(store, scope="all", min_bytes=0)
    off.begin(exclude=[w])
    y = (x * 1.0 @ w.t()).sum()  # matmul saves x*1.0 and w.t(), a view sharing w's storage
    off.end_forward()
    y.backward()
    assert off.stats.saved_tensors == 2 and off.stats.storages == 1 and off.stats.offloaded_tensors == 1
    off.end_step()
    assert torch.equal(w.grad, expected)


def test_tiny_tensors_stay_in_memory(store):
    off = make_offloader(store, scope="all", min_bytes=64 * KiB, keep_last=0)
    w = torch.nn.Parameter(torch.randn(8, 8))
    small, big = torch.randn(4, 8), torch.randn(4096, 8)  # 128 B, 128 KiB
    offloaded_step(off, w, lambda: (small * 1.0 @ w).sum() + (big * 1.0 @ w).sum())
    assert off.stats.saved_tensors == 2 and off.stats.storages == 1
    assert off.stats.bytes_written == big.numel() * 4
    off.end_step()


def test_last_k_blocks_stay_in_memory(store):
    model = TinyGPT(layers=6)
    off = make_offloader(store, keep_last=3)
    written_before = store.stats.bytes_written
    off.begin(exclude=list(model.parameters()))
    loss = model(*batch())
    store.fence()
    assert store.stats.bytes_written - written_before == 4 * (4 * 32 * 32 * 4)  # 7 saved inputs - 3 kept
    off.end_forward()
    loss.backward()
    assert off.stats.memory_hits == 3 and off.stats.prefetch_hits == 4 and off.stats.misses == 0
    off.end_step()


def test_storage_saved_twice_is_written_once_and_views_rebuild(store):
    x = torch.randn(256, 48, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(48, 48))

    def fn(x, w):
        qkv = (x * 1.0) @ w  # 256 x 48, one storage
        q, k, v = qkv.chunk(3, dim=-1)  # three non-contiguous views of it
        return (q * k * v.t().t()).sum() + (q.t() @ k).sum()

    x0, w0 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    fn(x0, w0).backward()
    off = make_offloader(store, scope="all", min_bytes=0, keep_last=0)
    written_before = store.stats.bytes_written
    offloaded_step(off, w, lambda: fn(x, w))
    qkv_bytes = 256 * 48 * 4
    # qkv's storage is saved four times (q, k, v, q.t()); it is written once
    assert off.stats.offloaded_tensors > off.stats.storages
    assert off.stats.bytes_written < store.stats.bytes_written - written_before + 1
    assert off.stats.bytes_written == qkv_bytes + 256 * 16 * 4 + 256 * 48 * 4  # qkv, q*k, x*1.0
    off.end_step()
    assert torch.equal(x.grad, x0.grad) and torch.equal(w.grad, w0.grad)


def test_bool_and_int_saved_tensors_round_trip(store):
    class Masked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mask, idx):
            ctx.save_for_backward(mask, idx)
            return x * mask + x[idx].sum()

        @staticmethod
        def backward(ctx, grad):
            mask, idx = ctx.saved_tensors
            extra = torch.zeros_like(grad).index_add_(0, idx, torch.ones_like(idx, dtype=grad.dtype)) * grad.sum()
            return grad * mask + extra, None, None

    x = torch.randn(8192, requires_grad=True)
    mask = torch.rand(8192) > 0.5
    idx = torch.randint(0, 8192, (2048,))
    Masked.apply(x, mask, idx).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    off = make_offloader(store, scope="all", min_bytes=0, keep_last=0)
    offloaded_step(off, x, lambda: Masked.apply(x * 1.0, mask.clone(), idx.clone()).sum())
    assert off.stats.storages == 2 and off.stats.prefetch_hits + off.stats.misses == 2  # mask, idx
    off.end_step()
    assert torch.equal(x.grad, expected)


def test_checkpoint_with_bool_mask_input(store):
    lin = torch.nn.Linear(64, 64)

    def block(x, mask):
        return torch.relu(lin(x)).masked_fill(mask, 0.0)

    x = torch.randn(256, 64)
    mask = torch.rand(256, 64) > 0.5
    checkpoint(block, x * 1.0, mask, use_reentrant=False).sum().backward()
    expected = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    off = make_offloader(store, keep_last=0, min_bytes=0)
    offloaded_step(off, lin, lambda: checkpoint(block, x * 1.0, mask.clone(), use_reentrant=False).sum())
    assert off.stats.storages == 2  # the float input and the bool mask
    off.end_step()
    assert all(torch.equal(p.grad, e) for p, e in zip(lin.parameters(), expected))


def test_unpacked_twice_with_retain_graph(store):
    torch.manual_seed(0)
    m0 = TinyGPT(layers=3)
    m1 = copy.deepcopy(m0)
    idx, tgt = batch()
    loss0 = m0(idx, tgt)
    loss0.backward(retain_graph=True)
    loss0.backward()
    off = make_offloader(store, keep_last=1)
    loss1 = offloaded_step(off, m1, lambda: m1(idx, tgt), retain=True)
    loss1.backward()  # every saved activation is unpacked a second time, from disk
    assert off.stats.misses >= 3
    off.end_step()
    assert_same_params_and_grads(m0, m1)


def test_unpack_after_step_end_raises(store):
    model = TinyGPT(layers=2)
    off = make_offloader(store)
    off.begin(exclude=list(model.parameters()))
    loss = model(*batch())
    off.end_forward()
    off.end_step()
    with pytest.raises(RuntimeError, match="after that step ended"):
        loss.backward()


def test_address_reuse_does_not_alias_records(store):
    """Saved storages die and their addresses are reused by new tensors within the same step: records
    are keyed by object, not address, so each save gets its own bytes."""
    reused = False
    for _attempt in range(5):  # whether malloc hands a freed address out again depends on the heap's state
        w = torch.nn.Parameter(torch.ones(16384))
        ptrs: list[int] = []

        def fn():
            total = torch.zeros(())
            for i in range(8):
                t = torch.full((16384,), float(i + 1))
                ptrs.append(t.data_ptr())
                total = total + (t * w).sum()  # mul saves t
                del t
            return total

        off = make_offloader(store, scope="all", min_bytes=0, keep_last=0, write_inflight_bytes=1)
        offloaded_step(off, w, fn)
        off.end_step()
        assert torch.equal(w.grad, torch.full((16384,), float(sum(range(1, 9)))))
        reused = len(set(ptrs)) < len(ptrs)
        if reused:
            break
    assert reused, "the allocator never reused an address in 5 attempts; the test proves nothing"


def test_innermost_hooks_win_and_recomputation_is_not_offloaded(store):
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(512, 64)
    seen = []
    off = make_offloader(store, scope="all", min_bytes=0)
    off.begin(exclude=list(lin.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t.detach(), lambda t: t):
        inner = torch.relu(lin(x * 1.0))  # saved through the user's hooks only
    assert seen and off.stats.saved_tensors == 0
    # a reentrant checkpoint recomputes inside backward; leave our hooks on to prove they refuse it
    out = checkpoint(lambda a: torch.tanh(lin(a)), inner * 1.0, use_reentrant=True).sum()
    saved_in_forward = off.stats.storages
    out.backward()
    assert off.stats.storages == saved_in_forward  # nothing recorded during backward
    off.end_forward()
    off.end_step()
    assert not hooks_installed()


def test_foreign_hooks_left_open_are_reported(store):
    off = make_offloader(store)
    off.begin()
    foreign = torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)
    foreign.__enter__()
    try:
        with pytest.raises(RuntimeError, match="innermost saved_tensors_hooks are not ours"):
            off.end_forward()
    finally:
        foreign.__exit__(None, None, None)
    off.abort()
    assert not hooks_installed()


class Boom(RuntimeError):
    pass


def _assert_clean(off: ActivationOffloader) -> None:
    gc.collect()
    assert off.phase == "idle" and not hooks_installed()
    assert pending_io(off) == 0 and held_bytes(off) == 0
    assert off.store.dispatch.engine.pending() == []
    assert off.meter.current_bytes == 0, "saved activation memory leaked"


def test_exception_in_forward_leaves_nothing_behind(store):
    model = TinyGPT(layers=4)

    def fail_in_third_block(module, args):
        raise Boom("forward failed")

    model.blocks[2].register_forward_pre_hook(fail_in_third_block)
    off = make_offloader(store, keep_last=0)
    off.begin(exclude=list(model.parameters()))
    with pytest.raises(Boom) as failure:
        model(*batch())
    assert off.stats.storages >= 2  # writes were in flight when it failed
    off.abort(failure.value)
    traceback.clear_frames(failure.tb)  # the failed forward's own locals are not the offloader's to free
    del failure
    _assert_clean(off)


def test_exception_in_backward_leaves_nothing_behind(store):
    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise Boom("backward failed")

    model = TinyGPT(layers=4)
    off = make_offloader(store, keep_last=0, prefetch_depth=3)
    idx, tgt = batch()

    def fn():
        x = model.emb(idx)
        x = FailingBackward.apply(x)
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return checkpoint(model._loss, x, tgt, use_reentrant=False)

    with pytest.raises(Boom) as failure:
        offloaded_step(off, model, fn)
    assert off.stats.prefetch_hits >= 1
    off.abort(failure.value)
    traceback.clear_frames(failure.tb)
    del failure, fn, idx, tgt  # the test's own inputs are saved (not offloaded) tensors too
    _assert_clean(off)


def test_bad_settings_name_the_argument(store):
    with pytest.raises(ValueError, match="scope") as ei:
        make_offloader(store, scope="everything")
    assert isinstance(ei.value, ConfigError) and ei.value.key == "scope"
    with pytest.raises(ValueError, match="prefetch_bytes") as ei:
        make_offloader(store, prefetch_bytes=0)
    assert isinstance(ei.value, ConfigError) and ei.value.key == "prefetch_bytes"
