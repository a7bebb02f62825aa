"""The model of ``hf_7b.py``, as a user writes it: ``HFCausalLM(path, backend="transformers")`` built under
``trainer.init_module(empty_init=True)`` (streamed into the store, or initialized there from scratch with
``init_seed``), with peft LoRA when ``lora_rank > 0``."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from lightning_nvme.models.lightning_modules import HFCausalLM

# Every projection of a Llama block (attention and MLP), the usual choice for LoRA finetunes; peft's default
# for Llama is q_proj and v_proj only.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_module(path: str, block_size: int, lora_rank: int,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 init_seed: int | None = None) -> HFCausalLM:
    """``init_seed``: a fresh random init (``path`` holds ``config.json`` only; ``hf_15b.py``), else the checkpoint's
    weights."""
    lora = {"lora_rank": lora_rank, "lora_alpha": 2.0 * lora_rank, "lora_targets": LORA_TARGETS} if lora_rank else {}
    return HFCausalLM(path, block_size=block_size, backend="transformers", activation_checkpointing=True,
                      optimizer=optimizer, init_seed=init_seed, **lora)
