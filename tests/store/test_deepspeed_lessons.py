"""One test for each failure measured or read in DeepSpeed ZeRO-Infinity's NVMe path."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from models import MLP

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.store import flat_store as flat_store_mod


def _fit(tmp_path, strategy, steps=12, callbacks=()):
    model = MLP()
    trainer = Trainer(default_root_dir=tmp_path, strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, callbacks=list(callbacks))
    trainer.fit(model)
    return model, trainer


def test_one_file_per_rank_not_per_tensor(tmp_path):
    """DeepSpeed writes one swap file per tensor; here many params share one preallocated file."""
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=8 << 10)
    _fit(tmp_path, strategy)
    assert sorted(os.listdir(tmp_path / "store")) == ["store-rank0.bin", "store-rank0.bin.lock", "store-rank0.json"]


def test_no_open_close_per_request(tmp_path, monkeypatch):
    """DeepSpeed opens and closes a file per request; the store keeps one descriptor."""
    from lightning.pytorch.callbacks import Callback

    opened = []
    real_open = os.open

    class CountOpens(Callback):
        def on_train_batch_start(self, *args):
            monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))

        def on_train_batch_end(self, *args):
            monkeypatch.setattr(os, "open", real_open)

    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=8 << 10)
    _fit(tmp_path, strategy, callbacks=[CountOpens()])
    assert [p for p in opened if "store" in str(p)] == []


def test_completion_byte_count_is_checked(tmp_path, monkeypatch):
    """DeepSpeed never checks libaio's completion byte count. A kernel that completes writes short must
    neither corrupt the state (the rest is written) nor, when no progress is made, pass silently."""
    ref, _ = _fit(tmp_path / "ref", "auto")
    real_pwrite = os.pwrite

    def half_pwrite(fd, data, offset):
        mv = memoryview(data)
        n = len(mv)
        half = (n // 2) // 4096 * 4096 if n >= 8192 else n
        return real_pwrite(fd, mv[:half], offset)

    monkeypatch.setattr(flat_store_mod.os, "pwrite", half_pwrite)
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=8 << 10)
    off, _ = _fit(tmp_path / "off", strategy)
    for p, q in zip(ref.parameters(), off.parameters()):
        assert torch.equal(p, q)

    monkeypatch.setattr(flat_store_mod.os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(Exception, match="short write"):
        _fit(tmp_path / "zero", NVMeOffloadStrategy(store_dir=str(tmp_path / "store0"), chunk_bytes=8 << 10))


def test_checkpoint_is_fsynced_before_commit(tmp_path, monkeypatch):
    """DeepSpeed never fsyncs its swap files; a checkpoint here is fdatasynced from the store and every
    file fsynced before the atomic rename."""
    calls = []
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda fd, _real=real, _n=name: calls.append(_n) or _real(fd))
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=8 << 10)
    _, trainer = _fit(tmp_path, strategy)
    calls.clear()
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    assert "fdatasync" in calls  # the store fence
    assert calls.count("fsync") >= 3  # safetensors file, checkpoint.pt, the directory (+ parent)


@pytest.mark.parametrize("prefetch_depth, overlap", [(1, "step"), (2, "step"), (4, "step"), (1, "backward"),
                                                     (3, "backward")])
def test_never_runs_out_of_buffers(tmp_path, prefetch_depth, overlap):
    """DeepSpeed's pipelined swapper asserts 'ran out of swap buffers' at its default buffer count. Here
    the ring is sized from prefetch_depth and many more chunks than buffers cycle through it."""
    from lightning.pytorch.callbacks import Callback

    seen = {}

    class Inspect(Callback):
        def on_train_batch_end(self, trainer, *args):
            off = trainer.strategy.offloaded[0]
            seen.update(chunks=len(off.chunks), ring=off.ring.count)

    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=4 << 10,
                                   prefetch_depth=prefetch_depth, overlap=overlap)
    _fit(tmp_path, strategy, steps=6, callbacks=[Inspect()])
    assert seen["ring"] == prefetch_depth + 2
    assert seen["chunks"] > 4 * seen["ring"]
