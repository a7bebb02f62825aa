"""A small GPT LightningModule for the parameter-offload tests: tied embeddings (GPT-2's wte/lm_head),
a layer list of blocks, optional activation checkpointing, optional frozen base + LoRA adapters."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nvme.models.gpt import GPT, GPTConfig
from lightning_nvme.models.gpt_lora import add_gpt_lora

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "sgd_plain": (torch.optim.SGD, {"lr": 0.05}),  # no per-parameter state
    # Hugging Face's habit: weight decay on matrices only, biases and norms in a second group (each group then
    # lists every block's parameters of its kind: their optimizer state is interleaved across blocks)
    "adamw_groups": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


def tokens(n: int = 64, t: int = 16, vocab: int = 64, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, t + 1), generator=g)
    return TensorDataset(x[:, :-1], x[:, 1:])


class TinyGPT(LightningModule):
    def __init__(self, optimizer: str = "adamw", checkpointing: bool = False, lora: bool = False,
                 n_layer: int = 4, batch_size: int = 4, in_configure_model: bool = False,
                 init_seed: int | None = None, ref_format: tuple[str, str] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.optimizer_name = optimizer
        self.ref_format = ref_format  # (state_format, master_format): wrap in the in-memory RoundTripOptimizer
        self.batch_size = batch_size
        self.init_seed = init_seed  # seed the RNG in setup(): a meta-device model is initialized right after
        self.build = lambda: self._build(checkpointing, lora, n_layer)
        if not in_configure_model:
            self.build()

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.build()

    def setup(self, stage: str) -> None:
        if self.init_seed is not None:
            torch.manual_seed(self.init_seed)

    def _build(self, checkpointing: bool, lora: bool, n_layer: int) -> None:
        self.model = GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=n_layer, n_head=4),
                         activation_checkpointing=checkpointing)
        if lora:  # the package's adapters (lightning_nvme.models.gpt_lora), on two projections per block
            add_gpt_lora(self.model, rank=4, targets=("attn.c_attn", "mlp.c_fc"))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())

    def configure_optimizers(self):
        cls, kwargs = OPTIMIZERS[self.optimizer_name]
        params: list = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw_groups":
            params = [{"params": [p for p in params if p.ndim >= 2]},
                      {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        opt = cls(params, **kwargs)
        if self.ref_format:
            from lightning_nvme.optim.formats.state_format import RoundTripOptimizer, StateFormat

            RoundTripOptimizer(opt, StateFormat(*self.ref_format))
        return opt

    def train_dataloader(self):
        return DataLoader(tokens(), batch_size=self.batch_size, shuffle=False)
