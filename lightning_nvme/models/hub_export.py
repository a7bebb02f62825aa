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

from lightning_nvme.checkpoint.safetensors_stream import SafetensorsWriter
from lightning_nvme.checkpoint.weights import BesideWeight
from lightning_nvme.fs import atomic
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


def export_merged(directory: str, model: Any, state_dict: Mapping[str, Any], read_group: ReadGroup, prefix: str = "",
                  max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """A ``PeftModel``'s base with its LoRA adapters merged (``W + scaling * B @ A``, as peft's ``merge_and_unload``)
    in the Hub layout; each block's base weights and adapters are read together, one block at a time."""
    from lightning_nvme.models.peft_lora import PEFT_PREFIX, lora_merges, merged_weight

    merges = lora_merges(model, prefix)
    inner = prefix + PEFT_PREFIX
    plain: dict[str, Any] = {}
    for key, value in state_dict.items():
        if not key.startswith(inner) or "lora_" in key:
            continue
        if key in merges and not isinstance(value, BesideWeight):  # a resident weight: merged in memory
            a, b, scaling = merges[key]
            value = merged_weight(value, _value(state_dict[a]), _value(state_dict[b]), scaling)
        plain[prefix + key[len(inner):].replace(".base_layer.", ".")] = value

    def read_merged(refs: list[BesideWeight]) -> dict[str, torch.Tensor]:
        adapters = [state_dict[k] for r in refs if r.key in merges for k in merges[r.key][:2]]
        values = dict(read_group(refs + [a for a in adapters if isinstance(a, BesideWeight)]))
        out = {}
        for r in refs:
            out[r.key] = values[r.key]
            if r.key in merges:
                a, b, scaling = merges[r.key]
                lora = [values[k] if isinstance(state_dict[k], BesideWeight) else state_dict[k] for k in (a, b)]
                out[r.key] = merged_weight(values[r.key], lora[0], lora[1], scaling)
        return out
    return export_hub(directory, model.get_base_model(), plain, read_merged, prefix, max_shard_bytes)


def _value(value: Any) -> torch.Tensor:
    if isinstance(value, BesideWeight):
        raise ValueError(f"{value.key}: an adapter in the store whose base weight is resident; export the adapters "
                         "alone (merge_adapters=False)")
    return value


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


def export_hf(directory: str, module: nn.Module, state_dict: Mapping[str, Any],
              read_block: Callable[[Any], dict[str, torch.Tensor]] | None, max_shard_bytes: int = MAX_SHARD_BYTES,
              merge_adapters: bool = False) -> None:
    """``module``'s Hugging Face model in the Hub layout (``export_hub``), or of a peft model its adapters alone
    (``export_adapters``) or merged into the base (``export_merged``); ``state_dict`` is ``module``'s, its offloaded
    blocks' values read by ``read_block`` (one block at a time; None: everything is in ``state_dict``)."""
    prefix, hf = find_hf_model(module)

    def read_group(refs: list[BesideWeight]) -> dict[str, torch.Tensor]:
        assert read_block is not None, "an offloaded weight without a reader"
        values = read_block(refs[0].source[0])
        return {r.key: values[r.source[1]] for r in refs}
    if is_peft(hf) and merge_adapters:
        export_merged(directory, hf, state_dict, read_group, prefix, max_shard_bytes)
    elif is_peft(hf):
        export_adapters(directory, hf, state_dict, read_group, prefix)
    else:
        export_hub(directory, hf, state_dict, read_group, prefix, max_shard_bytes)


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
                      max_shard_bytes: int = MAX_SHARD_BYTES, merge_adapters: bool = False) -> list[str]:
    """A Lightning checkpoint of an ``HFCausalLM`` (plain, or with weights streamed beside it) to the Hub layout,
    reading one streamed tensor at a time. ``config``: the directory of its ``config.json`` (default: the
    checkpoint's ``hyper_parameters["path"]``, where the model was loaded from). A LoRA model's checkpoint
    (``lora_rank`` > 0): its adapters in peft's layout, or with ``merge_adapters`` merged into the base."""
    from lightning_nvme.checkpoint.load import open_checkpoint
    from lightning_nvme.checkpoint.weights import WeightReaders
    from lightning_nvme.models.hf import build_causal_lm

    checkpoint, _ = open_checkpoint(checkpoint_path)
    config = config or (checkpoint.get("hyper_parameters") or {}).get("path")
    if not config or not os.path.isfile(os.path.join(config, "config.json")):
        raise ValueError(f"{checkpoint_path}: no config.json to export with (the checkpoint's hyper_parameters name "
                         f"path={config!r}); give the model's directory: lightning-nvme export CKPT DIR --config MODEL_DIR")
    model = build_causal_lm(config)  # meta: names, ties and config only
    hp = checkpoint.get("hyper_parameters") or {}
    if hp.get("lora_rank"):
        from lightning_nvme.models.peft_lora import add_peft_lora

        model = add_peft_lora(model, hp["lora_rank"], hp.get("lora_alpha"), hp.get("lora_targets"),
                         hp.get("lora_dropout", 0.0))
    with WeightReaders() as readers:
        def read(refs: list[BesideWeight]) -> dict[str, torch.Tensor]:
            return {r.key: readers.read(r) for r in refs}
        state = checkpoint["state_dict"]
        if is_peft(model):
            if merge_adapters:
                return export_merged(directory, model, state, read, prefix, max_shard_bytes)
            return export_adapters(directory, model, state, read, prefix)
        return export_hub(directory, model, state, read, prefix, max_shard_bytes)
