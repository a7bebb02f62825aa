"""The models of ``hf_7b.py``: the full finetune is ``HFCausalLM(path, backend="transformers")`` as a user
writes it; LoRA wraps the same streamed base with peft in a LightningModule of its own, through the public
way for one's own module (``build_causal_lm`` + ``HubWeights``, ``lightning_nvme.models.hf``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_nvme.models.hf import HubWeights, block_classes, build_causal_lm
from lightning_nvme.models.lightning_modules import CausalLMModule, HFCausalLM

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
Optimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class _LoraWeights:
    """The base's values from the checkpoint (peft's ``base_model.model.`` and ``.base_layer`` taken out of
    the names), adapters at peft's init (A: kaiming-uniform, B: zeros, so training starts from the base)."""

    def __init__(self, base: HubWeights, model: nn.Module, prefix: str) -> None:
        self.base, self.adapters = base, {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            if ".lora_A." in name:
                self.adapters[prefix + name] = lambda s=tuple(tensor.shape): nn.init.kaiming_uniform_(
                    torch.empty(s), a=math.sqrt(5))
            elif ".lora_B." in name:
                self.adapters[prefix + name] = lambda s=tuple(tensor.shape): torch.zeros(s)

    @staticmethod
    def _base_name(name: str) -> str:
        return name.replace("base_model.model.", "", 1).replace(".base_layer.", ".")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.adapters or self._base_name(name) in self.base)

    def get(self, name: str) -> torch.Tensor:
        return self.adapters[name]() if name in self.adapters else self.base.get(self._base_name(name))


class PeftLoraLM(CausalLMModule):
    """A transformers causal LM from ``path`` with rank-``rank`` peft LoRA on its projections (base frozen),
    built on the meta device under ``trainer.init_module(empty_init=True)``, gradient checkpointing on."""

    init_empty = True

    def __init__(self, path: str, rank: int, optimizer: Optimizer | None = None) -> None:
        super().__init__(optimizer)
        from peft import LoraConfig, get_peft_model

        base = build_causal_lm(path, gradient_checkpointing=True)
        weights = HubWeights(path, prefix="model.").checked(base)  # every base tensor, by name, before wrapping
        self._vocab = int(base.config.vocab_size)
        self.model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                     target_modules=LORA_TARGETS))
        self._weights = _LoraWeights(weights, self.model, "model.")

    def initial_weights(self) -> _LoraWeights:
        return self._weights

    def param_block_classes(self) -> tuple[type[nn.Module], ...] | None:
        return block_classes(self.model)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: Any = self.model(input_ids=input_ids, use_cache=False)
        return out.logits


def build_module(path: str, block_size: int, lora_rank: int, optimizer: Optimizer) -> CausalLMModule:
    if lora_rank:
        return PeftLoraLM(path, lora_rank, optimizer)
    return HFCausalLM(path, block_size=block_size, backend="transformers", activation_checkpointing=True,
                      optimizer=optimizer)
