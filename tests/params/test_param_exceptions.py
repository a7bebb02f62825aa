"""Issue #33, item 8: an exception raised inside a training step with offloaded parameters (in a block's forward,
in its backward, inside an optimizer update) leaves no block held or resident, no host range registered with
CUDA and no device copy alive once Lightning has torn the run down. Checked on CPU through the fake CUDA
(``fake_cuda``: ``CudaTransfer``'s logic, registrations counted, device copies as CPU buffers it can count)."""

from __future__ import annotations

import gc

import pytest
import torch
from _param_offload_model import TinyGPT
from fake_cuda import fake_cuda_transfer
from lightning.pytorch import Callback
from test_param_offload import offload, trainer

from lightning_nvme.optim.chunk_update import ChunkUpdater


class Boom(RuntimeError):
    pass


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Boom("injected in backward")


class Inject(Callback):
    """At the second step: raise where asked, and keep the residency to look at after teardown."""

    def __init__(self, where: str, monkeypatch) -> None:
        self.where, self.monkeypatch, self.residency = where, monkeypatch, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.residency = trainer.strategy.param_offload.residency
        if batch_idx != 1:
            return
        block = pl_module.model.transformer.h[1]
        if self.where == "forward":
            def pre(module, args):  # after the scheduler's pre-hook: the block is held for its forward
                raise Boom("injected in forward")
            block.register_forward_pre_hook(pre)
        elif self.where == "backward":
            block.register_forward_hook(lambda module, args, out: _RaiseInBackward.apply(out))
        else:
            def fail(self, chunk, buf):
                raise Boom("injected in an update")
            self.monkeypatch.setattr(ChunkUpdater, "_run_inner_step", fail)


@pytest.mark.parametrize("where,overlap", [("forward", "backward"), ("backward", "backward"),
                                           ("update", "backward"), ("update", "step")])
def test_exception_in_a_step_leaves_nothing_held(tmp_path, monkeypatch, where, overlap):
    rt, made = fake_cuda_transfer(monkeypatch)
    inject = Inject(where, monkeypatch)
    t = trainer(tmp_path, offload(tmp_path, overlap=overlap), steps=4, callbacks=[inject])
    with pytest.raises(Boom):
        t.fit(TinyGPT(checkpointing=True))
    res = inject.residency
    assert res is not None and len(made) == 1
    gc.collect()
    assert [b.name for b in res.blocks if +res.holders(b)] == []  # no hold left
    assert res.resident_blocks == []  # no block in memory, its pool buffer returned
    assert rt.live == {}  # no host range still registered with CUDA
    for off in t.strategy.offloaded:  # every ring buffer back (a failed update gave its buffer back unwritten)
        assert len(off.ring._free) == off.ring.count
    if (where, overlap) == ("update", "backward"):
        # The update raised inside backward, during the recomputation of a checkpointed block: torch's
        # checkpoint frame still holds the recomputed weight views (a cycle through autograd's C++ nodes that
        # gc cannot collect, as without offload), so that one device copy stays allocated.
        assert made[0].ops.live_device_buffers() <= 1
    else:
        assert made[0].ops.live_device_buffers() == 0  # device memory back: no device copy alive


@pytest.mark.parametrize("offload_params", [True, False])
def test_a_checkpoint_tensor_of_another_shape_is_the_error_a_meta_build_raises(tmp_path, offload_params):
    """A model built on the meta device whose checkpoint holds a tensor of another shape (a config.json that does
    not match its weights): the fit raises the error naming the tensor and both shapes. Before, what the failed
    build left on the meta device failed first in the teardown (``set_data``: "incompatible tensor type"), hiding
    it (``materialize`` now leaves placeholders behind a failure)."""
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_nvme import NVMeOffloadStrategy
    from lightning_nvme.models.hf import HubWeights, build_causal_lm, load_config

    saved = str(tmp_path / "llama")
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=32)).save_pretrained(saved)

    class Narrower(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self._source = HubWeights(saved, prefix="model.").checked(build_causal_lm(saved, dtype=torch.float32))
            config = load_config(saved)
            config.intermediate_size = 48  # the checkpoint's MLP is 64 wide
            self.model = build_causal_lm(config, dtype=torch.float32)

        def initial_weights(self):
            return self._source

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0]).logits.float().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randint(0, 64, (4, 8))), batch_size=2)

    t = Trainer(strategy=NVMeOffloadStrategy(offload_params=offload_params, store_dir=str(tmp_path / "store")),
                max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=str(tmp_path))
    with t.init_module(empty_init=True):
        model = Narrower()
    with pytest.raises(ValueError, match=r"model\.model\.layers\.0\.mlp\.gate_proj\.weight: the checkpoint holds shape "
                                         r"\(64, 32\), the model \(48, 32\)"):
        t.fit(model)
