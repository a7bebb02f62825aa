"""Trained weights back in the Hugging Face Hub layout, streamed: ``config.json`` + ``model-0000k-of-0000n.safetensors``
+ ``model.safetensors.index.json`` under transformers' checkpoint names, one block in memory at a time.

Why not ``save_pretrained``: it needs the whole model in memory, which ``offload_params`` avoids. The names,
which tensors are written (a tied head once) and the file layout are what ``save_pretrained`` writes, so
``AutoModelForCausalLM.from_pretrained(dir)`` (vLLM, llama.cpp converters...) reads the result unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_nvme import atomic
from lightning_nvme.checkpoint.safetensors_stream import SafetensorsWriter
from lightning_nvme.checkpoint.weights import BesideWeight
from lightning_nvme.models.hf import INDEX, SINGLE, save_names

ADAPTER_FILE = "adapter_model.safetensors"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
ReadGroup = Callable[[list[BesideWeight]], Mapping[str, torch.Tensor]]  # references of one source -> values by key


def find_hf_model(module: nn.Module) -> tuple[str, Any]:
    """``(prefix, model)`` of the outermost transformers ``PreTrainedModel`` inside ``module`` (e.g. ``("model.",
    hf)`` in an ``HFCausalLM``); raise if there is none."""
    for name, m in module.named_modules():
        if hasattr(m, "config") and hasattr(m, "save_pretrained") and hasattr(m, "_no_split_modules"):
            return (name + "." if name else ""), m
    raise ValueError(f"export layout='hf': {type(module).__name__} holds no transformers model (PreTrainedModel); "
                     "export it with layout='lightning' (one safetensors file in the module's own names)")


def hub_keys(model: nn.Module, names: list[str]) -> dict[str, str]:
    """model ``state_dict`` name -> checkpoint key, for the names ``save_pretrained`` writes: a parameter registered
    under several names (a tied head) only under its first."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    duplicates = {name for name, p in model.named_parameters(remove_duplicate=False) if first[id(p)] != name}
    rename = save_names(model)
    return {name: rename(name) for name in names if name not in duplicates}


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def export_adapters(directory: str, model: Any, state_dict: Mapping[str, Any], read_group: ReadGroup,
                    prefix: str = "") -> list[str]:
    """The LoRA adapters of a ``PeftModel`` alone, in peft's layout (``adapter_config.json`` +
    ``adapter_model.safetensors``, keys as ``get_peft_model_state_dict`` writes them), for
    ``PeftModel.from_pretrained(base, directory)``; the blocks holding them are read one at a time."""
    from lightning_nvme.models.peft_lora import ADAPTER

    ours = {k[len(prefix):]: k for k in state_dict if k.startswith(prefix) and "lora_" in k[len(prefix):]}
    if not ours:
        raise ValueError("export: the peft model holds no LoRA adapter tensors (lora_*)")
    keys = {name: name.replace(f".{ADAPTER}", "") for name in ours}
    os.makedirs(directory, exist_ok=True)
    _write_shard(os.path.join(directory, ADAPTER_FILE), list(ours), keys, ours, state_dict, read_group)
    model.peft_config[ADAPTER].save_pretrained(directory)
    return [ADAPTER_FILE, "adapter_config.json"]


def export_hub(directory: str, model: Any, state_dict: Mapping[str, Any], read_group: ReadGroup, prefix: str = "",
               max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write ``state_dict`` (``prefix`` + ``model``'s names; tensors or ``BesideWeight`` references) to ``directory``
    in the Hub layout; references of one source (a store block) are read together by ``read_group``. Returns the
    files written."""
    ours = {k[len(prefix):]: k for k in state_dict if k.startswith(prefix)}
    keys = hub_keys(model, list(ours))
    groups: dict[Any, list[str]] = {}  # one source's names together: each block read once
    for name in keys:
        value = state_dict[ours[name]]
        source = value.source[0] if isinstance(value, BesideWeight) and value.source is not None else None
        groups.setdefault(id(source) if source is not None else name, []).append(name)
    shards: list[list[str]] = [[]]
    size = 0
    for names in groups.values():
        nbytes = sum(_nbytes(state_dict[ours[n]]) for n in names)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(names)
        size += nbytes
    os.makedirs(directory, exist_ok=True)
    files = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    for file, names in zip(files, shards):
        _write_shard(os.path.join(directory, file), names, keys, ours, state_dict, read_group)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(state_dict[ours[n]]) for n in keys)},
                 "weight_map": {keys[n]: file for file, names in zip(files, shards) for n in names}}
        atomic.write_json(os.path.join(directory, INDEX), index, indent=2)
    stale = os.path.join(directory, INDEX if len(files) == 1 else SINGLE)
    if os.path.exists(stale):  # from an earlier export of another shard count: from_pretrained would prefer it
        os.remove(stale)
    model.config.save_pretrained(directory)
    return files + ([INDEX] if len(files) > 1 else []) + ["config.json"]


def _nbytes(value: Any) -> int:
    if isinstance(value, BesideWeight):
        n = 1
        for s in value.shape:
            n *= s
        return n * torch.empty((), dtype=value.torch_dtype).element_size()
    return int(value.numel() * value.element_size())


def _write_shard(path: str, names: list[str], keys: dict[str, str], ours: dict[str, str],
                 state_dict: Mapping[str, Any], read_group: ReadGroup) -> None:
    entries = []
    for n in names:
        v = state_dict[ours[n]]
        entries.append((keys[n], v.torch_dtype, tuple(v.shape)) if isinstance(v, BesideWeight)
                       else (keys[n], v.dtype, tuple(v.shape)))
    tmp = atomic.temp_name(path)
    writer = SafetensorsWriter(tmp, entries, {"format": "pt"})
    try:
        pending: dict[Any, list[str]] = {}
        for n in names:
            v = state_dict[ours[n]]
            if isinstance(v, BesideWeight):
                pending.setdefault(id(v.source[0]) if v.source is not None else n, []).append(n)
            else:
                writer.write(keys[n], 0, v.detach().reshape(-1).cpu())
        for group in pending.values():
            refs = [state_dict[ours[n]] for n in group]
            values = read_group(refs)
            for n, ref in zip(group, refs):
                writer.write(keys[n], 0, values[ref.key].reshape(-1))
            del values
        writer.close()
        atomic.commit(tmp, path)
    except BaseException:
        atomic.delete(tmp)
        raise


def export_checkpoint(checkpoint_path: str, directory: str, config: str | None = None, prefix: str = "model.",
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """A Lightning checkpoint of an ``HFCausalLM`` (plain, or with weights streamed beside it) to the Hub layout,
    reading one streamed tensor at a time. ``config``: the directory of its ``config.json`` (default: the
    checkpoint's ``hyper_parameters["path"]``, where the model was loaded from)."""
    from lightning_nvme.checkpoint.load import open_checkpoint
    from lightning_nvme.checkpoint.weights import WeightReaders
    from lightning_nvme.models.hf import build_causal_lm

    checkpoint, _ = open_checkpoint(checkpoint_path)
    config = config or (checkpoint.get("hyper_parameters") or {}).get("path")
    if not config or not os.path.isfile(os.path.join(config, "config.json")):
        raise ValueError(f"{checkpoint_path}: no config.json to export with (the checkpoint's hyper_parameters name "
                         f"path={config!r}); give the model's directory: lightning-nvme export CKPT DIR --config MODEL_DIR")
    model = build_causal_lm(config)  # meta: names, ties and config only
    with WeightReaders() as readers:
        return export_hub(directory, model, checkpoint["state_dict"],
                          lambda refs: {r.key: readers.read(r) for r in refs}, prefix, max_shard_bytes)
