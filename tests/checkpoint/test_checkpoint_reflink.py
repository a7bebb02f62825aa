"""Reflink checkpoints on a real XFS (``xfs_dir``: a loop-mounted image made with ``mkfs.xfs -m reflink=1``): a save
writes almost nothing, the snapshot keeps the state of the instant it was taken while training rewrites the
store, it opens with every loader and resumes bitwise; where clones are impossible the save streams and says why,
or refuses when ``checkpoint_copy="reflink"`` asks for them."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from models import MLP
from safetensors.torch import load_file
from snapshot_checks import (
    assert_saves_equal_the_instant,
    assert_snapshot_is_the_saved_state,
    assert_tiny_gpt_resumes_bitwise,
)
from test_checkpoint import assert_params_equal, reference, resume_in_new_process, trainer  # noqa: F401

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.callbacks import IOTelemetry
from lightning_nvme.checks import ConfigError
from lightning_nvme.store.layout import align_up


def _write_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def _parts_file(path) -> str:
    """The optimizer state file of the one-file checkpoint ``path`` (its record written out)."""
    from ckpt_helpers import parts_dir

    assert not os.path.exists(str(path) + ".optim")
    return os.path.join(parts_dir(path), "optimizer-0.safetensors")


def test_reflink_save_writes_under_one_percent_of_the_state(xfs_dir, tmp_path):
    model = MLP(hidden=1024)  # 1.1 M params: 8.8 MB of AdamW state
    strategy = NVMeOffloadStrategy(store_dir=str(xfs_dir / "big" / "store"), chunk_bytes=1 << 20)
    t = trainer(tmp_path, strategy, 1, enable_checkpointing=False, limit_train_batches=4)
    t.fit(model)
    state_bytes = sum(off.state_bytes for off in strategy.offloaded)
    written, sizes = {}, {}
    for name, path in (("reflink", xfs_dir / "big" / "a.ckpt"), ("streamed", tmp_path / "b.ckpt")):
        before = _write_bytes()
        t.save_checkpoint(path)
        written[name] = _write_bytes() - before  # everything the save wrote (the state lies inside the one file)
        sizes[name] = align_up(os.path.getsize(path))
        assert strategy.checkpoint_saves[-1].path == name
    record = strategy.checkpoint_saves[-2]
    assert record.bytes_cloned >= state_bytes and record.bytes_written <= 4096
    # the reflink save wrote the file's own bytes (weights, hyperparameters, loops), not its cloned state records
    besides_state = sizes["reflink"] - record.bytes_cloned
    assert written["reflink"] - besides_state <= 0.01 * state_bytes, (written, sizes, state_bytes)
    assert written["streamed"] >= state_bytes, (written, state_bytes)  # the counter sees a real copy's writes
    assert "not on the store's filesystem" in strategy.checkpoint_saves[-1].reason


class _SaveTwice(Callback):
    """At the end of epoch 0: a reflink save on the XFS and a streamed one elsewhere, of the same state."""

    def __init__(self, reflinked: str, streamed: str) -> None:
        self.paths = (reflinked, streamed)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            for path in self.paths:
                trainer.save_checkpoint(path)


@pytest.mark.parametrize("state_format", ["exact", "int8"])
def test_snapshot_keeps_the_saved_state_while_training_rewrites_the_store(xfs_dir, tmp_path, state_format):
    """(``int8``: codes and per-block scales, whose range entries count blocks.)"""
    a, b = str(xfs_dir / f"snap-{state_format}" / "a.ckpt"), str(tmp_path / "b.ckpt")
    strategy = NVMeOffloadStrategy(store_dir=str(xfs_dir / f"snap-{state_format}" / "store"), chunk_bytes=16 << 10,
                                   state_format=state_format)
    telemetry = IOTelemetry(plot=False, summary=False, prog_bar=False)
    t = trainer(tmp_path, strategy, 3, enable_checkpointing=False, callbacks=[_SaveTwice(a, b), telemetry])
    t.fit(MLP())
    assert [r.path for r in strategy.checkpoint_saves] == ["reflink", "streamed"]
    summary = telemetry.summary_dict()  # checkpoint writes count in the wear, next to training's
    assert summary["checkpoint_saves"] == {"reflink": 1, "streamed": 1}
    assert summary["checkpoint_bytes_written"] == sum(r.bytes_written for r in strategy.checkpoint_saves)
    assert summary["bytes_written_per_day"] == pytest.approx(
        (summary["bytes_written"] + summary["checkpoint_bytes_written"]) / summary["train_seconds"] * 86400)
    t.save_checkpoint(str(tmp_path / "final.ckpt"))
    assert_snapshot_is_the_saved_state(a, b, str(tmp_path / "final.ckpt"), tmp_path)
    # every loader opens it: torch.load, load_from_checkpoint, and the safetensors library on the cloned file
    assert torch.load(a, weights_only=True)["global_step"] == torch.load(b, weights_only=True)["global_step"]
    for (name, p), q in zip(MLP.load_from_checkpoint(a).state_dict().items(), MLP.load_from_checkpoint(b).state_dict().values()):
        assert torch.equal(p, q), name
    raw = load_file(_parts_file(a))
    assert any(n.startswith("pad.") for n in raw) and any(n.startswith("state.") for n in raw)


def test_reflink_checkpoint_resumes_bitwise(xfs_dir, tmp_path, reference):  # noqa: F811
    strategy = NVMeOffloadStrategy(store_dir=str(xfs_dir / "resume" / "store"), chunk_bytes=16 << 10)
    t = trainer(tmp_path, strategy, 1, enable_checkpointing=False)
    t.fit(MLP())
    ckpt = xfs_dir / "resume" / "epoch1.ckpt"
    t.save_checkpoint(ckpt)
    assert strategy.checkpoint_saves[-1].path == "reflink"
    store2 = str(xfs_dir / "resume" / "store2")
    params = resume_in_new_process(tmp_path, ckpt, tmp_path / "p.pt",
                                   f"NVMeOffloadStrategy(store_dir={store2!r}, chunk_bytes=16 << 10)")
    assert_params_equal(reference, params)


def test_checkpoint_copy_reflink_refuses_where_clones_are_impossible(xfs_dir, tmp_path):
    strategy = NVMeOffloadStrategy(store_dir=str(xfs_dir / "refuse" / "store"), chunk_bytes=16 << 10,
                                   checkpoint_copy="reflink")
    t = trainer(tmp_path, strategy, 1, enable_checkpointing=False, limit_train_batches=2)
    t.fit(MLP())
    with pytest.raises(ConfigError, match="checkpoint_copy.*not on the store's filesystem"):
        t.save_checkpoint(tmp_path / "elsewhere.ckpt")
    assert not os.path.exists(tmp_path / "elsewhere.ckpt") and not os.path.exists(tmp_path / "elsewhere.ckpt.optim")
    t.save_checkpoint(xfs_dir / "refuse" / "here.ckpt")
    assert strategy.checkpoint_saves[-1].path == "reflink"


def test_checkpoint_copy_streamed_streams_on_xfs(xfs_dir, tmp_path):
    strategy = NVMeOffloadStrategy(store_dir=str(xfs_dir / "streamed" / "store"), chunk_bytes=16 << 10,
                                   checkpoint_copy="streamed")
    t = trainer(tmp_path, strategy, 1, enable_checkpointing=False, limit_train_batches=2)
    t.fit(MLP())
    t.save_checkpoint(xfs_dir / "streamed" / "new" / "s.ckpt")  # into a directory the save creates
    record = strategy.checkpoint_saves[-1]
    assert (record.path, record.reason, record.bytes_cloned) == ("streamed", "checkpoint_copy='streamed'", 0)
    assert not any(n.startswith("pad.") for n in load_file(_parts_file(xfs_dir / "streamed" / "new" / "s.ckpt")))


def test_trainer_without_xfs_takes_the_streamed_path(tmp_path):
    """On the default filesystem (ext4 here: no reflinks) a save streams and says why."""
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=16 << 10)
    t = Trainer(default_root_dir=tmp_path, strategy=strategy, accelerator="cpu", max_epochs=1, limit_train_batches=2,
                logger=False, enable_progress_bar=False, enable_checkpointing=False)
    t.fit(MLP())
    t.save_checkpoint(tmp_path / "c.ckpt")
    record = strategy.checkpoint_saves[-1]
    from lightning_nvme.fs import reflink

    if reflink.probe(str(tmp_path)).supported:
        pytest.skip(f"{tmp_path} supports reflinks: this test needs a filesystem without them")
    assert record.path == "streamed" and "FICLONE" in record.reason


class _SaveAtEpochEnd(Callback):
    def __init__(self, *paths: str) -> None:
        self.paths = paths

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        for path in self.paths:
            trainer.save_checkpoint(path)


def test_offload_params_weights_are_cloned_too_and_resume_bitwise(xfs_dir, tmp_path, tmp_path_factory):
    """``offload_params`` with the weights beside the file: saved mid-fit (blocks may be resident, some changed),
    the weights file is the block regions cloned (changed resident blocks written after them); every loader reads
    the same weights and optimizer state as a streamed save of that instant; a resume is bitwise in-memory
    Lightning's (as ``test_param_offload``'s streamed case)."""
    from _param_offload_model import TinyGPT
    from test_param_offload import offload, resumed_in_memory
    from test_param_offload import reference as param_reference
    from test_param_offload import trainer as param_trainer

    _, snapshots = param_reference(tmp_path_factory)
    a, b = str(xfs_dir / "params" / "a.ckpt"), str(tmp_path / "b.ckpt")
    strategy = offload(xfs_dir / "params", inline_weights_bytes=0)
    t = param_trainer(tmp_path / "run", strategy, steps=-1, max_epochs=1, callbacks=[_SaveAtEpochEnd(a, b)])
    t.fit(TinyGPT())
    assert [r.path for r in strategy.checkpoint_saves] == ["reflink", "streamed"]
    record = strategy.checkpoint_saves[0]
    assert record.bytes_cloned > 0 and "weights.safetensors" in record.files
    assert_saves_equal_the_instant(a, b, snapshots[16], tmp_path)
    assert_tiny_gpt_resumes_bitwise(a, xfs_dir / "params-resume", tmp_path, resumed_in_memory(tmp_path), after_step=16)
