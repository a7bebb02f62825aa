"""A fresh random init of a Hugging Face model (``HFCausalLM(init_seed=...)``, ``HFInit``: transformers'
``_init_weights`` seeded per module): built on the meta device and initialized block by block straight into the
parameter store it equals the same init in memory bitwise (Llama: untied head; Qwen2: tied head + attention
biases), and so does 4 steps of AdamW on it against Lightning's default strategy; the init is reproducible by
seed and differs across seeds; a parameter ``_init_weights`` leaves alone is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_nvme  # noqa: F401  (registers the strategies)
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.models import HFCausalLM
from lightning_nvme.models.hf import HFInit, build_causal_lm

transformers = pytest.importorskip("transformers")

VOCAB = 64
CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=2,
                  tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_key_value_heads=2,
                  tie_word_embeddings=True),
}


def config_dir(tmp_path, arch: str) -> str:
    """A directory with ``config.json`` only: a fresh init needs no weights."""
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=64, dtype="float32", **CONFIGS[arch])
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (16, 17), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)


class Values(Callback):
    """The module's values at the start of fit (the store's blocks, gathered by the state-dict hooks)."""

    def on_train_start(self, trainer, pl_module):
        self.start = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def trainer(root, strategy, steps: int) -> Trainer:
    return Trainer(default_root_dir=str(root), strategy=strategy, accelerator="cpu", devices=1, max_steps=steps,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[Values()])


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_init_into_the_store_equals_in_memory(arch, tmp_path):
    path = config_dir(tmp_path, arch)
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    ref = HFCausalLM(path, block_size=16, init_seed=11, optimizer=optimizer)
    plain = trainer(tmp_path / "ref", "auto", 4)
    plain.fit(ref, data())
    ref_values = plain.callbacks[0]

    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=64 << 10, offload_params=True)
    offloaded = trainer(tmp_path / "run", strategy, 4)
    with offloaded.init_module(empty_init=True):
        streamed = HFCausalLM(path, block_size=16, init_seed=11, optimizer=optimizer)
    assert all(p.is_meta for p in streamed.parameters()), "built on the meta device"
    offloaded.fit(streamed, data())
    values = offloaded.callbacks[0]

    assert values.start.keys() == ref_values.start.keys()
    for k, v in ref_values.start.items():
        assert torch.equal(values.start[k], v), k
        if v.dim() == 2:  # a matrix drawn by _init_weights, not left at a constant
            assert v.std() > 0, k
    after = streamed.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(after[k], v), k
    if arch == "qwen2":
        assert streamed.model.lm_head.weight is streamed.model.model.embed_tokens.weight  # still tied


def test_init_reproducible_by_seed(tmp_path):
    path = config_dir(tmp_path, "llama")
    a, b, c = (HFCausalLM(path, block_size=16, init_seed=s).state_dict() for s in (1, 1, 2))
    name = "model.model.layers.1.mlp.up_proj.weight"
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[name], c[name])
    # transformers' Llama init: normal(0, initializer_range) matrices, ones for the RMSNorms
    assert abs(float(a[name].std()) - 0.02) < 0.005
    assert torch.equal(a["model.model.norm.weight"], torch.ones(32))


def test_parameter_left_uninitialized_is_refused(tmp_path):
    model = build_causal_lm(config_dir(tmp_path, "llama"))
    block = model.model.layers[0]
    block.register_parameter("extra", nn.Parameter(torch.empty(3, device="meta")))
    init = HFInit(model, 0)
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra.*_init_weights does not initialize"):
        init.apply(model)
