"""A GPT-2-style decoder in plain PyTorch, with Hugging Face GPT-2 parameter names.

Why our own: the embedded recipe must run on a fresh machine without ``transformers``, and the
local-checkpoint recipe must still load a GPT-2 ``config.json`` + ``model.safetensors`` without it.
Using GPT-2's names (``transformer.h.0.attn.c_attn`` ...) lets one module serve both; the only
difference from the Hub layout is that GPT-2 stores its ``Conv1D`` weights transposed.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_nvme.params.materialize import copy_checked

# Hub GPT-2 keeps these as Conv1D (weight shape [in, out]); nn.Linear wants [out, in].
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in older checkpoints


@dataclass
class GPTConfig:
    """The subset of GPT-2's ``config.json`` this implementation needs (same key names)."""

    vocab_size: int = 256
    n_positions: int = 256
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5
    dropout: float = 0.0

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> GPTConfig:
        with open(path) as f:
            raw = json.load(f)
        model_type = raw.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"{path}: model_type={model_type!r}; the built-in loader reads GPT-2 checkpoints only. "
                             f"Install the 'hf' extra (pip install 'lightning-nvme[hf]') to load other architectures.")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known}, dropout=float(raw.get("resid_pdrop", 0.0)))

    def to_hf_json(self) -> dict:
        d = asdict(self)
        p = d.pop("dropout")
        return {**d, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_ctx": self.n_positions,
                "resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": p, "activation_function": "gelu_new",
                "tie_word_embeddings": True}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's "gelu_new"


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _gpt2_reset(module: nn.Linear | nn.Embedding, std: float) -> None:
    nn.init.normal_(module.weight, std=std)
    bias = getattr(module, "bias", None)
    if bias is not None:
        nn.init.zeros_(bias)


class GPT(nn.Module):
    """GPT-2 decoder; ``activation_checkpointing`` recomputes each block in backward instead of keeping
    its activations (only the block inputs stay alive — the tensors an activation-offload callback moves)."""

    def __init__(self, cfg: GPTConfig, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.activation_checkpointing = activation_checkpointing
        wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.transformer = nn.ModuleDict(dict(
            wte=wte,
            wpe=nn.Embedding(cfg.n_positions, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if self.lm_head.weight.is_meta:
            self._gpt2_resets()

    def _gpt2_resets(self) -> None:
        """Built on the meta device: initialization happens later, module by module, through each module's
        ``reset_parameters()`` (Lightning's convention for meta-device models). Make that GPT-2's init too
        (normal(0.02), zero biases, scaled residual projections) instead of torch's kaiming/normal(1)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith("c_proj") else 0.02
                m.reset_parameters = functools.partial(_gpt2_reset, m, std)  # type: ignore[method-assign]

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.n_positions:
            raise ValueError(f"sequence length {t} exceeds the model's n_positions={self.config.n_positions}")
        pos = torch.arange(t, device=idx.device)
        tr = self.transformer
        x = tr["drop"](tr["wte"](idx) + tr["wpe"](pos))
        for block in cast(nn.ModuleList, tr["h"]):
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(tr["ln_f"](x))

    # ---- Hugging Face GPT-2 layout: config.json + model.safetensors ------------------------------------
    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the Hub GPT-2 layout (transformers can load it)."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(self.config.to_hf_json(), f, indent=2)
        state = {k: (v.t() if k.endswith(_CONV1D_SUFFIXES) else v).contiguous()
                 for k, v in self.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, activation_checkpointing: bool = False) -> GPT:
        """Load a GPT-2 checkpoint directory (single or sharded safetensors) without ``transformers``, one
        tensor at a time (``PretrainedWeights``): the file is never loaded whole."""
        weights = PretrainedWeights(directory)
        model = cls(weights.config, activation_checkpointing)
        weights.check(model)
        weights.load_into(model)
        return model


class PretrainedWeights:
    """A GPT-2 checkpoint directory read tensor by tensor (``safetensors.safe_open``), under ``GPT``'s names.

    Why its own object: a model too big for memory is built on the meta device and its blocks are
    initialized straight into the parameter store from here (``lightning_nvme.params.materialize``), while
    an in-memory model is filled from the same mapping (``GPT.from_pretrained``). The Hub layout differs
    from ``GPT``'s in three ways: keys may lack the ``transformer.`` prefix, ``Conv1D`` weights are stored
    transposed, and the tied ``lm_head.weight`` is stored once (as ``wte.weight``).
    """

    def __init__(self, directory: str | os.PathLike, prefix: str = "") -> None:
        self.directory = str(directory)
        self.prefix = prefix  # where the GPT sits in the module that asks (e.g. "model." in a LightningModule)
        self.config = GPTConfig.from_json(os.path.join(directory, "config.json"))
        self._where: dict[str, tuple[str, str]] = {}  # GPT name -> (file, key in that file)
        for file in safetensors_files(directory):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if not key.endswith(_IGNORED_SUFFIXES):
                        ours = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
                        self._where[ours] = (file, key)
        if "lm_head.weight" not in self._where and "transformer.wte.weight" in self._where:
            self._where["lm_head.weight"] = self._where["transformer.wte.weight"]  # tied, stored once

    def names(self) -> set[str]:
        """Every tensor name it provides, with ``prefix``."""
        return {self.prefix + name for name in self._where}

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.startswith(self.prefix) and name[len(self.prefix):] in self._where

    def get(self, name: str) -> torch.Tensor:
        """The value of ``name`` (with ``prefix``), in ``GPT``'s layout; only this tensor is read."""
        file, key = self._where[name[len(self.prefix):]]
        with safe_open(file, framework="pt") as f:
            value = f.get_tensor(key)
        return value.t() if name.endswith(_CONV1D_SUFFIXES) else value

    def check(self, model: GPT) -> None:
        """Raise if the checkpoint's tensors are not exactly ``model``'s (a config.json that does not match)."""
        expected = set(model.state_dict().keys())
        missing, unexpected = expected - set(self._where), set(self._where) - expected
        if missing or unexpected:
            raise ValueError(f"{self.directory}: checkpoint does not match its config.json "
                             f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")

    def load_into(self, model: GPT) -> None:
        """Copy every tensor into an in-memory ``model``, one at a time."""
        for name, tensor in model.state_dict(keep_vars=True).items():
            copy_checked(self.prefix + name, self.get(self.prefix + name), tensor)


def safetensors_files(directory: str | os.PathLike) -> list[str]:
    """A checkpoint directory's safetensors files: the shards its index names, else ``model.safetensors``."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return [os.path.join(directory, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{directory}: no model.safetensors (or model.safetensors.index.json) found. "
                            f"Save the model with save_pretrained(..., safe_serialization=True).")
