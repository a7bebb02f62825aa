"""Checkpoints of ``offload_params=True`` whose weights stream beside the file (``inline_weights_bytes=0``), what
each loader makes of them, the converter, and ``export_weights`` after fit without restoring the weights.

The bitwise resume in a new process is ``test_param_offload.py::test_checkpoint_holds_true_weights_and_resumes
_in_a_new_process[beside]``."""

from __future__ import annotations

import dataclasses
import os
import shutil
import weakref

import pytest
import torch
from _param_offload_model import TinyGPT
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from test_param_offload import Snapshots, offload, trainer

from lightning_nvme import cli
from lightning_nvme.checkpoint import load_checkpoint, weights
from lightning_nvme.checkpoint.safetensors_stream import file_backing

STEPS = 4


class OneBlockAtATime:
    """Wraps ``ParamOffload.read_block``: asserts each block's values are gone before the next block is read."""

    def __init__(self, params) -> None:
        self.read_block, self.reads, self.live = params.read_block, 0, []
        params.read_block = self

    def __call__(self, block):
        assert all(r() is None for r in self.live), "a previous block's values are still in memory"
        values = self.read_block(block)
        self.live = [weakref.ref(next(iter(values.values())))]
        self.reads += 1
        return values


class WatchSaves(ModelCheckpoint):
    """A ModelCheckpoint whose saves stream one block at a time (checked while fit runs)."""

    def on_train_start(self, trainer, pl_module):
        self.watch = OneBlockAtATime(trainer.strategy.param_offload)
        return super().on_train_start(trainer, pl_module)


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory):
    """Default-strategy Lightning: the weights after STEPS and 2 * STEPS steps, and its checkpoint at STEPS."""
    snaps = Snapshots(steps=(STEPS, 2 * STEPS))
    root = tmp_path_factory.mktemp("ref")
    t = trainer(root, "auto", steps=2 * STEPS, callbacks=[snaps])
    t.fit(TinyGPT())
    t = trainer(root, "auto", steps=STEPS)
    t.fit(TinyGPT())
    t.save_checkpoint(root / "ref.ckpt")
    return {**snaps.taken, "ckpt": str(root / "ref.ckpt")}


def assert_equal_state(got, expected):
    assert got.keys() == expected.keys()
    for name, p in expected.items():
        assert torch.equal(got[name], p), name


def test_weights_beside_the_file_load_everywhere_and_convert(tmp_path, in_memory):
    ckpts = WatchSaves(dirpath=tmp_path / "ckpt", filename="step{step}", every_n_train_steps=STEPS)
    strategy = offload(tmp_path, inline_weights_bytes=0)
    Trainer(default_root_dir=tmp_path, strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpts]).fit(TinyGPT())
    path = ckpts.best_model_path
    blocks = strategy.param_offload.blocks
    assert ckpts.watch.reads == len(blocks)  # each block streamed once, one at a time, during fit

    # the file holds references, its weights.safetensors record the block weights (a plain safetensors file inside)
    from ckpt_helpers import parts_dir

    with weights.deferred():
        refs = weights.refs(torch.load(path, weights_only=False)["state_dict"])
    assert set(refs) == {s.name for b in blocks for s in b.slots}
    assert not os.path.exists(path + ".optim")
    beside = load_file(os.path.join(parts_dir(path), weights.WEIGHTS_FILE))
    assert beside.keys() == refs.keys()

    # Lightning's loaders materialize them from the beside file: the complete trained model
    assert_equal_state(torch.load(path, weights_only=True)["state_dict"], in_memory[STEPS])
    loaded = TinyGPT.load_from_checkpoint(path)
    assert_equal_state(loaded.state_dict(), in_memory[STEPS])

    # the converter: one plain file that plain Lightning resumes from, to the in-memory run's weights
    plain = str(tmp_path / "plain.ckpt")
    assert cli.main(["convert", "to-lightning", path, plain]) == 0
    assert not os.path.exists(plain + ".optim")
    converted, lightnings = torch.load(plain, weights_only=True), torch.load(in_memory["ckpt"], weights_only=True)
    assert_equal_state(converted["state_dict"], in_memory[STEPS])
    for ours, theirs in zip(converted["optimizer_states"], lightnings["optimizer_states"], strict=True):
        for index, state in theirs["state"].items():
            assert_equal_state(ours["state"][index], state)
    resumed, reference = TinyGPT(), TinyGPT()  # plain Lightning resumes from it as from its own checkpoint
    trainer(tmp_path / "plain", "auto", steps=2 * STEPS).fit(resumed, ckpt_path=plain)
    trainer(tmp_path / "ref", "auto", steps=2 * STEPS).fit(reference, ckpt_path=in_memory["ckpt"])
    assert_equal_state(resumed.state_dict(), reference.state_dict())

    # the strategy resumes by streaming the beside weights block by block into the store, never materializing
    def never(*args, **kwargs):
        raise AssertionError("the strategy's resume materialized the beside weights")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights.BesideWeight, "read", never)
        mp.setattr(weights.WeightReaders, "read_state_dict", never)
        again = TinyGPT()
        trainer(tmp_path / "again", offload(tmp_path / "again"), steps=2 * STEPS).fit(again, ckpt_path=path)
    assert_equal_state(again.state_dict(), reference.state_dict())

    # the file moved alone holds everything: load_checkpoint and torch.load (weights_only, mmap) give the weights
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(path, moved)
    moved_path = str(moved / os.path.basename(path))
    assert_equal_state(load_checkpoint(moved_path)["state_dict"], in_memory[STEPS])
    mapped = torch.load(moved_path, weights_only=True, mmap=True)
    assert_equal_state(mapped["state_dict"], in_memory[STEPS])
    for key in refs:  # mapped from the file, not read into memory: opening the file reads no weight
        backing = file_backing(mapped["state_dict"][key])
        assert backing is not None, key
        os.close(backing[0])
    torch.save(mapped, tmp_path / "again.ckpt")  # and each its own storage: the loaded checkpoint saves again
    assert_equal_state(torch.load(tmp_path / "again.ckpt", weights_only=True)["state_dict"], in_memory[STEPS])

    # format version 2 (the weights beside the file): moved with its .optim directory it loads; without, torch.load
    # names the missing directory and the fixes instead of handing back a model without weights
    from ckpt_helpers import write_beside

    v2 = str(moved / "v2.ckpt")
    write_beside(moved_path, v2)
    with weights.deferred():  # the references of a version-2 file carry no record
        for ref in weights.refs(torch.load(v2, weights_only=False)["state_dict"]).values():
            assert ref.record is None
    assert_equal_state(load_checkpoint(v2)["state_dict"], in_memory[STEPS])
    shutil.rmtree(v2 + ".optim")
    with pytest.raises(RuntimeError, match="neither the weights nor the optimizer state"):
        load_checkpoint(v2)


def test_export_weights_after_fit_keeps_memory_bounded(tmp_path, in_memory):
    """restore_params=False: the weights stay in the store after fit; export_weights streams the whole model
    into one safetensors file, a block at a time; state_dict() still refuses, naming both ways out."""
    strategy = offload(tmp_path, restore_params=False)
    model = TinyGPT()
    t = trainer(tmp_path, strategy, steps=2 * STEPS)
    t.fit(model)
    watch = OneBlockAtATime(strategy.param_offload)
    strategy.export_weights(str(tmp_path / "model.safetensors"))
    assert watch.reads == len(strategy.param_offload.blocks)
    assert_equal_state(load_file(tmp_path / "model.safetensors"), in_memory[2 * STEPS])
    with pytest.raises(RuntimeError) as e:
        model.state_dict()
    assert "restore_params" in str(e.value) and "export_weights" in str(e.value)

    # a weights-only checkpoint after fit reopens the store: inline (gathered) through the user's CheckpointIO ...
    strategy.checkpoint_io = UserIO()
    t.save_checkpoint(tmp_path / "inline.ckpt", weights_only=True)
    assert_equal_state(torch.load(tmp_path / "inline.ckpt", weights_only=True)["state_dict"], in_memory[2 * STEPS])
    # ... and weights streamed beside the dict go through it too: the one file built locally, handed to the plugin
    # with the weights' record a file-mapped storage
    strategy.config = dataclasses.replace(strategy.config, inline_weights_bytes=0)
    t.save_checkpoint(tmp_path / "beside.ckpt", weights_only=True)
    assert "handed to UserIO" in strategy.checkpoint_saves[-1].reason
    assert_equal_state(torch.load(tmp_path / "beside.ckpt", weights_only=True)["state_dict"], in_memory[2 * STEPS])


class UserIO(TorchCheckpointIO):
    """A user's CheckpointIO (it takes the whole checkpoint dict in memory)."""
