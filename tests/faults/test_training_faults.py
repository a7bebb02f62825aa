"""Faults seen from a Trainer: a background write error stops fit within one step with the path in the
message (lock released, no I/O threads left), and a truncated checkpoint is refused clearly."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from models import MLP

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.store import FlatStore, StoreError
from lightning_nvme.store import flat_store as flat_store_mod

from .conftest import io_threads


def _trainer(tmp_path, strategy, steps, callbacks=()):
    return Trainer(default_root_dir=tmp_path, strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, callbacks=list(callbacks))


def test_background_write_error_stops_training_within_one_step(tmp_path, monkeypatch):
    steps_done = []

    class BreakDisk(Callback):
        def on_train_batch_end(self, trainer, *args):
            steps_done.append(trainer.global_step)
            if trainer.global_step == 3:
                def eio(*a, **k):
                    raise OSError(errno.EIO, "Input/output error")
                monkeypatch.setattr(flat_store_mod.os, "pwrite", eio)

    before = set(io_threads())
    store_dir = tmp_path / "store"
    strategy = NVMeOffloadStrategy(store_dir=str(store_dir), chunk_bytes=8 << 10)
    with pytest.raises(StoreError) as info:
        _trainer(tmp_path, strategy, 50, [BreakDisk()]).fit(MLP())
    assert str(store_dir) in str(info.value)
    assert max(steps_done) <= 4  # the write of step 4 failed; step 5 never finished
    monkeypatch.undo()
    assert set(io_threads()) <= before  # the strategy's store stopped its workers (others' are not ours)
    FlatStore(store_dir).close(delete=True)  # the lock was released


def test_truncated_checkpoint_is_refused(tmp_path):
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=8 << 10)
    trainer = _trainer(tmp_path, strategy, 4)
    trainer.fit(MLP())
    ckpt = tmp_path / "c.ckpt"
    trainer.save_checkpoint(ckpt)
    from ckpt_helpers import parts_dir, write_beside

    # a version-2 checkpoint (state beside the file) whose state file was cut: refused by the state reader
    v2 = tmp_path / "v2.ckpt"
    write_beside(ckpt, v2)
    shard = os.path.join(parts_dir(v2), "optimizer-0.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    resumed = _trainer(tmp_path, NVMeOffloadStrategy(store_dir=str(tmp_path / "store2"), chunk_bytes=8 << 10), 8)
    with pytest.raises(ValueError, match="truncated"):
        resumed.fit(MLP(), ckpt_path=str(v2))
    assert torch.load(v2)["global_step"] == 4  # left as it was

    # the one file cut inside its state record: torch's zip reader refuses it (no central directory)
    cut = tmp_path / "cut.ckpt"
    data = ckpt.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    resumed = _trainer(tmp_path, NVMeOffloadStrategy(store_dir=str(tmp_path / "store3"), chunk_bytes=8 << 10), 8)
    with pytest.raises(RuntimeError, match="central directory"):
        resumed.fit(MLP(), ckpt_path=str(cut))
