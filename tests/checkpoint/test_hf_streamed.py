"""A local Hugging Face (GPT-2 layout) checkpoint streamed tensor by tensor into the parameter store:
the same values as ``GPT.from_pretrained`` in memory, at most one block materialized while loading,
training from it bitwise equal to the in-memory run, and ``recipe=hf_local strategy.offload_params=true``."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
from _param_offload_model import tokens
from lightning.pytorch import Callback, Trainer
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import lightning_nvme  # noqa: F401  (registers the strategies)
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.models import GPT, GPTConfig, HFCausalLM
from lightning_nvme.params import is_placeholder

STEPS = 5


def _save_sharded(model: GPT, directory) -> None:
    """The Hub's sharded layout: two files + model.safetensors.index.json (what large checkpoints use)."""
    model.save_pretrained(directory)
    state = safetensors.torch.load_file(os.path.join(directory, "model.safetensors"))
    os.remove(os.path.join(directory, "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, os.path.join(directory, file), metadata={"format": "pt"})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)


def _checkpoint(tmp_path_factory, layout: str) -> str:
    d = tmp_path_factory.mktemp(layout)
    torch.manual_seed(11)
    gpt = GPT(GPTConfig(vocab_size=256, n_positions=16, n_embd=32, n_layer=4, n_head=4))
    gpt.save_pretrained(d) if layout == "single" else _save_sharded(gpt, d)
    return str(d)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    return _checkpoint(tmp_path_factory, "single")


def _trainer(root, strategy, callbacks=()):
    return Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=list(callbacks))


def _data():
    return DataLoader(tokens(), batch_size=4, shuffle=False)


class InitialValues(Callback):
    """The model's true weights when training starts (gathered from the store with offload_params)."""

    def on_train_start(self, trainer, pl_module):
        self.values = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_streamed_into_the_store_equals_from_pretrained_and_trains_bitwise(layout, tmp_path_factory, tmp_path,
                                                                           monkeypatch):
    from lightning_nvme.params.residency import BlockResidency

    checkpoint_dir = _checkpoint(tmp_path_factory, layout)
    ref = HFCausalLM(checkpoint_dir, block_size=16, backend="native")
    _trainer(tmp_path / "ref", "auto").fit(ref, _data())

    in_memory_blocks: list[int] = []
    place = BlockResidency.place

    def watch(self, block):
        in_memory_blocks.append(sum(any(not s.param.is_meta and not is_placeholder(s.param) for s in b.slots)
                                    for b in self.blocks))
        place(self, block)

    def whole(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded whole (safetensors.torch.load_file)")

    monkeypatch.setattr(BlockResidency, "place", watch)
    monkeypatch.setattr(safetensors.torch, "load_file", whole)
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=64 << 10, offload_params=True,
                                   overlap="backward")
    start = InitialValues()
    t = _trainer(tmp_path / "off", strategy, [start])
    with t.init_module(empty_init=True):
        model = HFCausalLM(checkpoint_dir, block_size=16, backend="native")
    assert all(p.is_meta for p in model.parameters())
    t.fit(model, _data())

    # Each block went to the store as soon as its tensors were read: never two in memory.
    assert len(in_memory_blocks) == 4 and max(in_memory_blocks) == 1
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    loaded = GPT.from_pretrained(checkpoint_dir).state_dict()
    assert set(start.values) == {"model." + k for k in loaded}
    for name, value in loaded.items():
        assert torch.equal(start.values["model." + name], value), name
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{name} differs after {STEPS} steps"


def test_meta_model_not_fitting_streams_the_checkpoint(checkpoint_dir, tmp_path):
    """validate() of a model built on the meta device with offload_params: each block is read from the
    checkpoint for its forward only and never materialized in the module (it was, whole, before streamed
    evaluation), and the metrics are bitwise those of the model loaded in memory by the default strategy."""
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), offload_params=True)
    t = _trainer(tmp_path / "offload", strategy)
    with t.init_module(empty_init=True):
        model = HFCausalLM(checkpoint_dir, block_size=16, backend="native")
    got = t.validate(model, _data(), verbose=False)
    want = _trainer(tmp_path / "ref", "auto").validate(HFCausalLM(checkpoint_dir, block_size=16, backend="native"),
                                                      _data(), verbose=False)
    assert got == want and got[0], got  # the same logged metrics, and some were logged
    assert any(is_placeholder(p) for p in model.parameters())  # the blocks' values were never in the module


def test_mismatched_checkpoint_is_refused(checkpoint_dir, tmp_path):
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        cfg = json.load(f)
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(checkpoint_dir):
        os.symlink(os.path.join(checkpoint_dir, name), bad / name)
    os.remove(bad / "config.json")
    (bad / "config.json").write_text(json.dumps({**cfg, "n_layer": 5}))
    with pytest.raises(ValueError, match="does not match its config.json"):
        HFCausalLM(str(bad), block_size=16, backend="native")
    (bad / "config.json").write_text(json.dumps({**cfg, "n_embd": 64}))
    with pytest.raises(ValueError, match="shape"):
        HFCausalLM(str(bad), block_size=16, backend="native")


def test_recipe_hf_local_with_offload_params_streams_and_matches(checkpoint_dir, tmp_path):
    """``recipe=hf_local strategy.offload_params=true``: the train command builds the model on the meta device,
    streams the checkpoint into the store, and trains to the same weights as with offload_params=false."""
    from lightning_nvme.launch import compose_config, train

    def run(offload: bool):
        root = tmp_path / str(offload)
        overrides = [f"model.path={checkpoint_dir}", "model.block_size=16", "model.backend=native",
                     f"strategy.offload_params={str(offload).lower()}", "strategy.overlap=backward",
                     f"paths.output_dir={root}/out", f"paths.store_dir={root}/store", "trainer.accelerator=cpu",
                     "data.source=generated", "data.max_bytes=20000", "data.batch_size=2", "data.steps_per_epoch=3",
                     "data.val_batches=1", "trainer.max_steps=3", "++trainer.limit_val_batches=0",
                     "trainer.gradient_clip_val=null",
                     "logger=none", "callbacks=none"]
        return train(compose_config("hf_local", overrides))

    off = run(True)
    assert off.trainer.strategy.param_offload is not None and off.model.initial_weights() is not None
    plain = run(False)
    assert plain.model.initial_weights() is None  # loaded in memory at construction
    for (name, p), q in zip(plain.model.named_parameters(), off.model.parameters()):
        assert torch.equal(p, q), name
