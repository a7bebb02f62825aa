"""NVMeActivationOffload under a Lightning Trainer: exact training, its own store, cleanup on errors."""

from __future__ import annotations

import copy
import os

import lightning.pytorch as pl
import pytest
import torch
from _activation_offload_model import TinyGPT, held_bytes, pending_io
from torch.utils.data import DataLoader, TensorDataset

from lightning_nvme.callbacks import NVMeActivationOffload

KiB = 1024


class LitGPT(pl.LightningModule):
    def __init__(self, model: TinyGPT, fail_at: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        idx, tgt = batch
        if self.fail_at == "forward" and batch_idx == 1:
            self.model.blocks[1].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
        return self.model(idx, tgt)

    def backward(self, loss, *args, **kwargs):
        if self.fail_at == "backward" and self.global_step == 1:
            loss = FailInBackward.apply(loss)
        loss.backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


def data(n: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (n * 4, 32), generator=g)
    return DataLoader(TensorDataset(idx, torch.roll(idx, -1, dims=1)), batch_size=4)


def fit(module: pl.LightningModule, tmp_path, callbacks=(), precision="32-true", steps=3, **kw) -> pl.Trainer:
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=steps, accelerator="cpu", devices=1,
                         precision=precision, callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(module, data())
    return trainer


def small_callback(**kw) -> NVMeActivationOffload:
    return NVMeActivationOffload(min_bytes=4 * KiB, min_segment_bytes=256 * KiB, io_chunk_bytes=64 * KiB,
                                 staging_bytes=256 * KiB, io_workers=2, **kw)


def hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fit_is_bitwise_identical_with_and_without_callback(tmp_path, precision):
    torch.manual_seed(0)
    base = TinyGPT(layers=3)
    m0, m1 = LitGPT(copy.deepcopy(base)), LitGPT(copy.deepcopy(base))
    fit(m0, tmp_path / "a", precision=precision)
    cb = small_callback(store_dir=str(tmp_path / "store"))
    seen_store = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, *args):
            seen_store.append(cb.nvme_store)

    fit(m1, tmp_path / "b", callbacks=[cb, Spy()], precision=precision)
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters()):
        assert torch.equal(p0, p1), name
    totals = cb.total_stats
    assert totals.storages == 3 * 4 and totals.bytes_read > 0 and totals.misses == 0
    # its own store: activations-rank0.bin in store_dir, exposed during fit, removed at teardown
    assert seen_store[0] is not None and seen_store[0].path == str(tmp_path / "store" / "activations-rank0.bin")
    assert cb.nvme_store is None and not os.path.exists(seen_store[0].path)
    assert not hooks_installed()


def test_store_dir_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_NVME_STORE_DIR", str(tmp_path / "env"))
    paths = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, *args):
            paths.append(cb.nvme_store.path)

    cb = small_callback()
    fit(LitGPT(TinyGPT(layers=2)), tmp_path / "root", callbacks=[cb, Spy()], steps=1)
    monkeypatch.delenv("LIGHTNING_NVME_STORE_DIR")
    cb = small_callback()
    fit(LitGPT(TinyGPT(layers=2)), tmp_path / "root", callbacks=[cb, Spy()], steps=1)
    assert paths == [str(tmp_path / "env" / "activations-rank0.bin"),
                     str(tmp_path / "root" / "nvme_store" / "activations-rank0.bin")]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_exception_in_step_leaves_no_io_buffers_or_hooks(tmp_path, where):
    cb = small_callback(store_dir=str(tmp_path / "store"), keep_last=0)
    offloaders = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, *args):
            offloaders.append(cb.offloader)

    with pytest.raises(RuntimeError, match="boom"):
        fit(LitGPT(TinyGPT(layers=3), fail_at=where), tmp_path, callbacks=[cb, Spy()])
    off = offloaders[-1]
    assert off.phase == "idle" and pending_io(off) == 0 and held_bytes(off) == 0
    assert not hooks_installed()
    assert cb.nvme_store is None and not os.path.exists(tmp_path / "store" / "activations-rank0.bin")
    assert off.store.dispatch.engine.alive_threads == 0  # its own store was closed


def test_disabled_callback_does_nothing(tmp_path):
    cb = small_callback(store_dir=str(tmp_path / "store"), enabled=False)
    fit(LitGPT(TinyGPT(layers=2)), tmp_path, callbacks=[cb], steps=1)
    assert cb.offloader is None and not os.path.exists(tmp_path / "store")


def test_enabled_switch_can_be_flipped_between_steps(tmp_path):
    """``enabled`` starts as the argument and may be flipped between steps (benchmarks alternate A/B steps)."""
    cb = small_callback(store_dir=str(tmp_path / "store"))
    offloaded = []

    class Toggle(pl.Callback):  # listed before cb: runs first at batch start
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            cb.enabled = batch_idx % 2 == 1

    class Record(pl.Callback):  # listed after cb: the step's stats are final
        def on_train_batch_end(self, trainer, *args):
            offloaded.append(cb.last_step_stats.storages if cb.enabled else None)

    fit(LitGPT(TinyGPT(layers=2)), tmp_path, callbacks=[Toggle(), cb, Record()], steps=4)
    assert offloaded[0::2] == [None, None] and all(n and n > 0 for n in offloaded[1::2]), offloaded
    assert cb.total_stats.storages == sum(offloaded[1::2])


def test_shares_the_nvme_offload_strategy_store(tmp_path):
    strategies = pytest.importorskip("lightning_nvme.strategies", reason="the nvme_offload strategy is not merged yet")
    torch.manual_seed(0)
    base = TinyGPT(layers=3)
    m0, m1 = LitGPT(copy.deepcopy(base)), LitGPT(copy.deepcopy(base))
    fit(m0, tmp_path / "a", strategy=strategies.NVMeOffloadStrategy(store_dir=str(tmp_path / "s0")))
    cb = small_callback()
    stores = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            stores.append((cb.nvme_store, trainer.strategy.nvme_store))

    fit(m1, tmp_path / "b", callbacks=[cb, Spy()],
        strategy=strategies.NVMeOffloadStrategy(store_dir=str(tmp_path / "s1")))
    assert all(mine is theirs for mine, theirs in stores)
    assert "activations.0" in stores[0][1].layout
    for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters()):
        assert torch.equal(p0, p1), name


@pytest.mark.parametrize("fail", [False, True])
def test_pinned_host_cache_released_at_the_end_of_fit(tmp_path, monkeypatch, fail):
    """Issue #33, item 11: the activations' pinned buffers come from torch's caching host allocator, which keeps
    them pinned for the life of the process; once fit ends (or fails) the cache is handed back. No CUDA here: a
    pinned buffer handed out is simulated (``torch.empty(pin_memory=True)`` needs a device), the release recorded."""
    from lightning_nvme.activations import device

    released = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: released.append(True))

    class HandsOutPinned(pl.Callback):
        def on_train_batch_end(self, *args):
            monkeypatch.setattr(device, "_pinned_used", True)  # what host_buffer(pinned=True) records

    cb = small_callback(store_dir=str(tmp_path / "store"))
    module = LitGPT(TinyGPT(layers=2), fail_at="backward" if fail else None)
    if fail:
        monkeypatch.setattr(device, "_pinned_used", True)
        with pytest.raises(RuntimeError, match="boom"):
            fit(module, tmp_path, callbacks=[cb], steps=3)
    else:
        fit(module, tmp_path, callbacks=[cb, HandsOutPinned()], steps=1)
    assert released and device._pinned_used is False


@pytest.mark.parametrize("api", ["torch.accelerator", "torch._C", None])
def test_pinned_host_cache_released_through_the_api_this_torch_has(monkeypatch, api):
    """torch 2.5-2.11 lack ``torch.accelerator.empty_host_cache`` (the first GPU run, torch 2.11: the end of fit
    raised AttributeError) and have the private ``torch._C._host_emptyCache``; older torch has neither."""
    from lightning_nvme.activations import device

    released = []
    monkeypatch.delattr(torch.accelerator, "empty_host_cache", raising=False)
    monkeypatch.delattr(torch._C, "_host_emptyCache", raising=False)
    if api == "torch.accelerator":
        monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: released.append(api), raising=False)
    elif api == "torch._C":
        monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: released.append(api), raising=False)
    monkeypatch.setattr(device, "_pinned_used", True)
    assert device.release_pinned_cache() is True
    assert released == ([api] if api else []) and device._pinned_used is False
