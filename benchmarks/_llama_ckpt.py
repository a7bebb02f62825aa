"""A random-initialized Llama checkpoint in the Hugging Face layout, written shard by shard, for benchmarks.

Why: the seed user's model is a 7 B Llama; measuring it here must not need a download (no network) nor
memory for the whole model (13.5 GB of bf16 on a 24 GiB machine). Names and shapes come from transformers'
own ``LlamaForCausalLM`` built on the meta device (no memory), so the checkpoint is exactly what
``from_pretrained`` expects; each tensor is generated on its own and shards are flushed at ``shard_bytes``.
The directory is a cache: a complete one (``config.json`` equal, index present) is reused as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch

# Llama-2-7B's shape (meta-llama/Llama-2-7b-hf config.json): 6.74 B parameters.
LLAMA2_7B: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008, "num_attention_heads": 32,
    "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
}
# A tiny model of the same architecture: the smoke run (seconds).
TINY: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 4, "vocab_size": 320, "max_position_embeddings": 256,
}
SHARD_BYTES = 2 * 10**9  # transformers' save_pretrained default max_shard_size is 5 GB; smaller: less memory
INDEX = "model.safetensors.index.json"


def llama_config(shape: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of an untied Llama of ``shape`` in bf16 (the 7 B's own defaults for the rest)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
        "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, **shape,
    }


def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every persistent tensor of transformers' model for ``config``, in module order (meta device)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.bfloat16)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def _init(name: str, shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """Llama's init (transformers ``_init_weights``): normal(0, std) matrices, ones for the RMSNorm weights."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator).to(torch.bfloat16)


def _complete(path: str, config: dict[str, Any]) -> bool:
    try:
        with open(os.path.join(path, "config.json")) as f:
            same = json.load(f) == config
        return same and os.path.isfile(os.path.join(path, INDEX))
    except (OSError, ValueError):
        return False


def write_checkpoint(path: str, shape: dict[str, Any], seed: int = 0, shard_bytes: int = SHARD_BYTES,
                     log: Any = None) -> dict[str, Any]:
    """Write (or reuse) a random-init bf16 Llama checkpoint of ``shape`` at ``path``: ``config.json``,
    ``model-0000k-of-0000n.safetensors``, the index. Memory: one shard at most. Returns what it did."""
    from safetensors.torch import save_file

    config = llama_config(shape)
    if _complete(path, config):
        return {"reused": True, "seconds": 0.0, "bytes": _size(path)}
    t0 = time.perf_counter()
    if os.path.exists(path):
        shutil.rmtree(path)  # an incomplete or different one
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    generator = torch.Generator().manual_seed(seed)
    shards: list[list[str]] = [[]]
    weight_map: dict[str, int] = {}
    pending: dict[str, torch.Tensor] = {}
    total = 0

    def flush() -> None:
        save_file(pending, os.path.join(tmp, f"shard-{len(shards) - 1}.safetensors"), metadata={"format": "pt"})
        pending.clear()
        shards.append([])

    for name, tshape in tensor_shapes(config):
        tensor = _init(name, tshape, config["initializer_range"], generator)
        nbytes = tensor.numel() * tensor.element_size()
        if pending and sum(t.numel() * t.element_size() for t in pending.values()) + nbytes > shard_bytes:
            flush()
        pending[name] = tensor
        shards[-1].append(name)
        weight_map[name] = len(shards) - 1
        total += nbytes
        if log is not None:
            log(f"  {name} {tshape}")
    flush()
    shards.pop()
    n = len(shards)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for i, file in enumerate(files):
        os.rename(os.path.join(tmp, f"shard-{i}.safetensors"), os.path.join(tmp, file))
    index = {"metadata": {"total_size": total}, "weight_map": {k: files[v] for k, v in weight_map.items()}}
    with open(os.path.join(tmp, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    os.rename(tmp, path)
    return {"reused": False, "seconds": round(time.perf_counter() - t0, 1), "bytes": _size(path)}


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
