"""Low-rank adapters (LoRA) of the embedded GPT-2 (``models/gpt.py``; Hugging Face models use ``peft_lora``):
``y = x W^T + b + scale * (x A^T) B^T``, only ``A`` and ``B`` train.

Why a subclass of ``nn.Linear``: the frozen ``weight``/``bias`` keep their names, so a pretrained
checkpoint's tensors map onto them unchanged (``PretrainedWeights`` fills them, streamed or in memory),
and with ``offload_params=True`` they sit in the read-only head of their block's store region while the
adapters form its small written-back tail. ``B`` starts at zero: training starts from the base model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # GPT's projections (module names)


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable rank-``rank`` update ``lora_up @ lora_down`` scaled by ``alpha/rank``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None) -> None:
        nn.Module.__init__(self)
        if rank < 1:
            raise ValueError(f"lora_rank must be >= 1, got {rank}")
        self.in_features, self.out_features = base.in_features, base.out_features
        base.requires_grad_(False)
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_down = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype))
        self.lora_up = nn.Parameter(torch.empty(self.out_features, rank, device=device, dtype=dtype))
        self.scale = (alpha if alpha is not None else rank) / rank
        self.reset_adapters()

    @torch.no_grad()
    def reset_adapters(self) -> None:
        """``A`` as nn.Linear's default (kaiming-uniform, a=sqrt(5): U(±1/sqrt(in))), ``B = 0``. Tensor methods,
        not ``nn.init``: Lightning's ``init_module(empty_init=True)`` skips ``nn.init`` calls, and nothing
        else would initialize the adapters."""
        bound = 1 / math.sqrt(self.in_features)
        self.lora_down.uniform_(-bound, bound)
        self.lora_up.zero_()

    def reset_parameters(self) -> None:
        """Meta-device builds call this: the base's init (overwritten where a checkpoint gives the values)
        and the adapters'."""
        super().reset_parameters()
        self.reset_adapters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(x, self.lora_down), self.lora_up)


def add_gpt_lora(model: nn.Module, rank: int, alpha: float | None = None, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Freeze every parameter of ``model`` and replace each ``nn.Linear`` whose name ends with one of
    ``targets`` by a ``LoRALinear`` around it; returns how many were adapted."""
    model.requires_grad_(False)
    chosen = [(name, m) for name, m in model.named_modules()
              if type(m) is nn.Linear and any(name == t or name.endswith("." + t) for t in targets)]
    if not chosen:
        raise ValueError(f"add_gpt_lora: no nn.Linear named like {targets} in {type(model).__name__}")
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, LoRALinear(linear, rank, alpha))
    return len(chosen)
