"""The model of ``hf_7b.py``: a transformers causal LM built on the meta device, its weights streamed from
a sharded safetensors directory tensor by tensor (``initial_weights``), optionally wrapped with peft LoRA.

Interim: until ``HFCausalLM(backend="transformers")`` streams any architecture into the store (#21 item 1,
branch ``hf``), this is the smallest module that does it for the benchmark's Llama through the package's
public seam (``initial_weights()``, docs/params.md).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_nvme.models.lightning_modules import CausalLMModule

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class CheckpointWeights:
    """Initial values by the module's ``state_dict`` names: checkpoint tensors (read one at a time from the
    safetensors files), non-persistent buffers recomputed (rotary ``inv_freq``), peft adapters at peft's
    init (A: kaiming-uniform, B: zeros, so training starts from the base)."""

    def __init__(self, path: str, module: nn.Module, prefix: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        else:
            from safetensors import safe_open

            with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
                files = {k: "model.safetensors" for k in f.keys()}
        self.path, self.files = path, files
        self.computed: dict[str, Callable[[], torch.Tensor]] = {}
        self.names: dict[str, str] = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            key = prefix + name
            ckpt = name.replace("base_model.model.", "", 1).replace(".base_layer.", ".")
            if ckpt in files:
                self.names[key] = ckpt
            elif ".lora_A." in name:
                shape = tuple(tensor.shape)
                self.computed[key] = lambda s=shape: nn.init.kaiming_uniform_(torch.empty(s), a=math.sqrt(5))
            elif ".lora_B." in name:
                self.computed[key] = lambda s=tuple(tensor.shape): torch.zeros(s)
        for mname, sub in module.named_modules():
            for bname in sub._buffers:
                if bname in sub._non_persistent_buffers_set and hasattr(sub, "config"):  # rotary embeddings
                    key = f"{prefix}{mname}.{bname}"
                    self.computed[key] = lambda m=sub, b=bname: getattr(_on_cpu(m), b)
        covered = set(self.names) | set(self.computed)
        missing = sorted(prefix + n for n in module.state_dict(keep_vars=True) if prefix + n not in covered)
        extra = sorted(set(files) - set(self.names.values()))
        if missing or extra:
            raise ValueError(f"{path}: tensors missing from the checkpoint {missing[:5]}, extra in it {extra[:5]}")

    def __contains__(self, name: object) -> bool:
        return name in self.names or name in self.computed

    def get(self, name: str) -> torch.Tensor:
        if name in self.computed:
            return self.computed[name]()
        from safetensors import safe_open

        with safe_open(os.path.join(self.path, self.files[self.names[name]]), "pt") as f:
            return f.get_tensor(self.names[name])


def _on_cpu(module: nn.Module) -> nn.Module:
    """A fresh CPU copy of a rotary embedding module (its buffers computed in ``__init__``)."""
    with torch.device("cpu"):
        return type(module)(config=module.config)  # type: ignore[call-arg]


class StreamedCausalLM(CausalLMModule):
    """A transformers causal LM from ``path`` (``config.json`` + safetensors), gradient checkpointing on,
    rank-``lora_rank`` peft LoRA when > 0 (the base frozen)."""

    init_empty = True

    def __init__(self, path: str, block_size: int = 128, lora_rank: int = 0,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None) -> None:
        super().__init__(optimizer)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.get_default_dtype())
        model.activation_checkpointing_enable({"use_reentrant": False})
        if lora_rank:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                                     target_modules=LORA_TARGETS))
        self.model = model
        self._vocab = int(config.vocab_size)
        self._weights = CheckpointWeights(path, self.model, "model.")

    def initial_weights(self) -> CheckpointWeights:
        return self._weights

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def build_module(path: str, block_size: int, lora_rank: int, optimizer: Any) -> CausalLMModule:
    return StreamedCausalLM(path, block_size=block_size, lora_rank=lora_rank, optimizer=optimizer)
