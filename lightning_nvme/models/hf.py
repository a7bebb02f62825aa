"""Any Hugging Face causal LM built on the meta device and filled from its safetensors checkpoint, tensor by tensor.

Why: a model bigger than memory cannot go through ``from_pretrained`` (it materializes every weight).
``build_causal_lm`` uses transformers' own construction (``from_config``) on the meta device, so nothing is
allocated; ``HubWeights`` is the initial-weights object (``lightning_nvme.params.materialize``) that reads
each tensor by its checkpoint name when the strategy initializes that module, so with ``offload_params=True``
each block goes to the store as soon as it is filled: at most one block in memory.

What ``from_config`` on meta leaves empty and ``from_pretrained`` would fill: non-persistent buffers (rotary
``inv_freq``, Gemma's ``embed_scale``). They are small and not in the checkpoint, so they are recomputed at
build time on the CPU by the model's own ``_init_weights`` (what ``from_pretrained`` calls for them). Tensors the
architecture keeps in fp32 in a half-precision model (``_keep_in_fp32_modules``) get fp32, as ``from_pretrained``
gives them (``keep_in_fp32``).

For your own LightningModule::

    def configure_model(self):
        self.net = build_causal_lm(path)
    def initial_weights(self):
        return HubWeights(path, prefix="net.").checked(self.net)
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader
from lightning_nvme.models.gpt import safetensors_files
from lightning_nvme.params.materialize import copy_checked

INDEX = "model.safetensors.index.json"  # the Hub layout's names (hub_export writes them)
SINGLE = "model.safetensors"


class HubWeights:
    """A safetensors checkpoint (single file or sharded with an index) read one tensor at a time, under the
    names of the module that asks (``prefix`` + the model's ``state_dict`` names).

    ``checked(model)`` ties it to a model: refuses a tensor missing from the checkpoint, one the model does not
    have, or one of another shape, each by name, and resolves tied parameters stored once (``lm_head.weight``
    of a model with tied embeddings) and checkpoints saved from the base model (keys without ``model.``).

    It also reads element ranges (``RangedWeights``: ``read_range``), so each rank of ``nvme_offload_fsdp`` reads
    only its shard of each block tensor; those reads keep one reader per file open until ``close()``.
    """

    def __init__(self, directory: str | os.PathLike[str], prefix: str = "") -> None:
        self.directory = str(directory)
        self.prefix = prefix
        self._stored: dict[str, tuple[str, tuple[int, ...]]] = {}  # checkpoint key -> (file, shape)
        for file in safetensors_files(self.directory):
            reader = SafetensorsReader(file)
            try:
                for key, (_dtype, shape, _off) in reader.entries.items():
                    self._stored[key] = (file, shape)
            finally:
                reader.close()
        self._where: dict[str, str] = {}  # model name (without prefix) -> checkpoint key
        self._readers: dict[str, SafetensorsReader] = {}  # file -> its reader, opened by ``read_range`` until ``close``

    def checked(self, model: nn.Module) -> HubWeights:
        """Map every ``state_dict`` tensor of ``model`` to its checkpoint key, or raise naming what differs."""
        expected = model.state_dict(keep_vars=True)
        by_id: dict[int, list[str]] = {}  # the names of parameters registered under several (tied) names
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        rename = load_names(model)
        where: dict[str, str] = {}
        extra: list[str] = []
        for key in self._stored:
            name = rename(key)
            if name in expected:
                where.setdefault(name, key)
            else:
                extra.append(key)
        for group in by_id.values():  # a tied parameter stored once (a tied head): every name reads it
            stored = next((where[n] for n in group if n in where), None)
            for n in group:
                if stored is not None:
                    where.setdefault(n, stored)
        missing = [n for n in expected if n not in where]
        ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
        extra = [k for k in extra if not any(p.search(k) for p in ignored)]
        if missing or extra:
            raise ValueError(f"{self.directory}: the checkpoint does not match the model built from its config.json: "
                             f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                             f"not in the model {extra[:8]}{' ...' if len(extra) > 8 else ''}. Point model.path at "
                             "the directory save_pretrained wrote (config.json with its own weights).")
        for name, key in where.items():
            stored_shape = self._stored[key][1]
            if tuple(expected[name].shape) != stored_shape:
                raise ValueError(f"{self.directory}: {key} has shape {stored_shape} in the checkpoint, the model's "
                                 f"{name} {tuple(expected[name].shape)} (a config.json that does not match its weights)")
        self._where = where
        return self

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.startswith(self.prefix) and name[len(self.prefix):] in self._where

    def locate(self, name: str) -> tuple[str, str] | None:
        """Where ``name`` (with ``prefix``) lies: ``(safetensors file, key)``, or ``None`` if not here. Frozen
        parameters are read from there in place during fit (``frozen_weights="in_place"``)."""
        if name not in self:
            return None
        key = self._where[name[len(self.prefix):]]
        return self._stored[key][0], key

    def get(self, name: str) -> torch.Tensor:
        """The stored value of ``name`` (with ``prefix``); only this tensor is read."""
        key = self._where[name[len(self.prefix):]]
        reader = SafetensorsReader(self._stored[key][0])
        try:
            return reader.read(key).view(self._stored[key][1])
        finally:
            reader.close()

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """The shape ``name`` (with ``prefix``) has in the checkpoint."""
        return self._stored[self._where[name[len(self.prefix):]]][1]

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``name`` (with ``prefix``) flattened, in the file's dtype; only those bytes
        are read. Why the reader stays open: a sharded build asks for a few ranges of every tensor, and opening the
        file per range dropped its whole page cache each time (``get``'s ``close``); the pages of each range are
        dropped as it is read instead."""
        key = self._where[name[len(self.prefix):]]
        file = self._stored[key][0]
        reader = self._readers.get(file)
        if reader is None:
            reader = self._readers[file] = SafetensorsReader(file)
        return reader.read(key, start, stop, drop_cache=True)

    def close(self) -> None:
        """The files ``read_range`` opened are closed (opened again by a later ``read_range``)."""
        readers, self._readers = self._readers, {}
        for reader in readers.values():
            reader.close()

    def load_into(self, model: nn.Module) -> None:
        """Copy every tensor into an in-memory ``model`` (checked), one at a time."""
        for name, tensor in model.state_dict(keep_vars=True).items():
            copy_checked(name, self.get(self.prefix + name), tensor)


class HFInit:
    """A fresh random init of a Hugging Face model, made module by module by the model's own ``_init_weights``
    (what ``from_config`` does for the whole model), as the initial-weights object of a model built on the meta
    device (``ModuleInit``: ``init_module`` is called as each module is allocated, so each block goes to the store
    as soon as it is initialized: a model bigger than memory starts from scratch without a checkpoint).

    Why seeded per module: the values must not depend on the order the strategy initializes modules in, nor on
    the meta build at all; each module draws from the global generator reseeded with a hash of ``seed`` and its
    name in the model (``module_seed``), inside ``torch.random.fork_rng`` (the caller's generator is untouched).
    ``apply(model)`` makes the same values in memory (bitwise: ``tests/models/test_hf_init.py``). A parameter
    ``_init_weights`` leaves alone (a custom ``nn.Parameter`` the architecture does not initialize) is refused by
    name instead of training from uninitialized memory. The source holds no tensor by name: a streamed
    evaluation cannot serve blocks from it (it asks for a checkpoint).
    """

    def __init__(self, model: nn.Module, seed: int = 0) -> None:
        self.seed = int(seed)
        self._names = {id(m): name for name, m in model.named_modules()}
        owners = [(n, m) for n, m in model.named_modules() if hasattr(m, "_init_weights")]
        if not owners:
            raise ValueError(f"HFInit: {type(model).__name__} has no _init_weights (not a transformers PreTrainedModel)")
        self._owners = owners

    def __contains__(self, name: object) -> bool:
        return False

    def get(self, name: str) -> torch.Tensor:
        raise KeyError(f"{name}: HFInit makes values in place (init_module), it holds none by name")

    @staticmethod
    def module_seed(seed: int, name: str) -> int:
        """The generator seed of module ``name`` (stable across processes and Python versions)."""
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    def init_module(self, module: nn.Module) -> bool:
        """Initialize ``module``'s own tensors (not its children's) with its owner's ``_init_weights``; False for a
        module not in the model (an adapter added later: its own ``reset_parameters`` applies)."""
        name = self._names.get(id(module))
        if name is None:
            return False
        owner = max((o for o in self._owners if not o[0] or name == o[0] or name.startswith(o[0] + ".")),
                    key=lambda o: len(o[0]))[1]
        own = [(n, t) for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]
        with torch.no_grad():
            for _, t in own:
                if t.is_floating_point():
                    t.fill_(float("nan"))  # what _init_weights does not write stays NaN, and is refused below
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.module_seed(self.seed, name))
                owner._init_weights(module)
        # any NaN left makes the sum NaN (6x faster than isnan().any() on bf16: ~15 s over 13 B parameters)
        left = [n for n, t in own if t.is_floating_point() and bool(torch.isnan(t.sum()))]
        if left:
            raise ValueError(f"{[f'{name}.{n}' for n in left]}: {type(owner).__name__}._init_weights does not initialize "
                             "them; a fresh init of this architecture is not supported. Start from a checkpoint "
                             "(model.path with weights).")
        return True

    def apply(self, model: nn.Module) -> None:
        """The same init in memory: every module holding a parameter not seen before, in module order (a tied
        parameter is initialized once, by its first module, as on the meta device)."""
        seen: set[int] = set()
        for m in model.modules():
            own = [p for p in m._parameters.values() if p is not None]
            if any(id(p) not in seen for p in own):
                if not self.init_module(m):
                    raise ValueError(f"{type(m).__name__}: not a module of the model HFInit was made for")
            seen.update(id(p) for p in own)


def _conversions(model: nn.Module, loading: bool) -> tuple[list[Any], list[Any]]:
    """transformers' renamings and converters between checkpoint keys and module names for ``model`` (e.g.
    GPT-NeoX's ``embed_out`` is the module's ``lm_head``); reversed for saving."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:  # transformers < 5: checkpoint keys are module names
        return [], []
    mapping = get_model_conversion_mapping(model, add_legacy=loading)  # type: ignore[arg-type]
    if not loading:  # as save_pretrained of a model not loaded by from_pretrained (no prefix changes)
        mapping = [m.reverse_transform() for m in mapping[::-1] if not isinstance(m, PrefixChange)]
    return ([m for m in mapping if isinstance(m, WeightRenaming)], [m for m in mapping if isinstance(m, WeightConverter)])


def load_names(model: nn.Module) -> Callable[[str], str]:
    """checkpoint key -> module name, as ``from_pretrained`` renames; a key that transformers would convert (fuse,
    split or re-lay-out tensors, e.g. MoE experts) is refused by name: it has no one-to-one streamed copy."""
    renamings, converters = _conversions(model, loading=True)
    if not renamings and not converters:
        return lambda key: key
    from transformers.core_model_loading import rename_source_key

    meta = model.state_dict(keep_vars=True)
    base = getattr(model, "base_model_prefix", None)

    def rename(key: str) -> str:
        name, converter = rename_source_key(key, renamings, converters, base, meta)
        if name not in meta and key in meta:
            name, converter = rename_source_key(key, [], [], base, meta)
        if converter is not None:
            raise ValueError(f"checkpoint tensor {key!r}: transformers converts it on load ({converter!r}, a fused or "
                             "re-laid-out tensor), which cannot be streamed one tensor at a time. Use "
                             "strategy.offload_params=false (from_pretrained in memory).")
        return str(name)
    return rename


def save_names(model: nn.Module) -> Callable[[str], str]:
    """module name -> checkpoint key, as ``save_pretrained`` renames (the reverse of ``load_names``)."""
    renamings, converters = _conversions(model, loading=False)
    if not renamings and not converters:
        return lambda name: name
    from transformers.core_model_loading import rename_source_key

    def rename(name: str) -> str:
        key, converter = rename_source_key(name, renamings, converters)
        if converter is not None:
            raise ValueError(f"{name}: transformers converts it on save ({converter!r}); exporting it streamed is not "
                             "supported. Export with layout='lightning' and convert in memory.")
        return str(key)
    return rename


def load_config(path_or_config: Any) -> Any:
    """A ``PretrainedConfig`` from a checkpoint directory (local files only), or the config itself."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(path_or_config, PretrainedConfig):
        return path_or_config
    return AutoConfig.from_pretrained(str(path_or_config), local_files_only=True)


def checkpoint_dtype(config: Any) -> torch.dtype:
    """The dtype ``from_pretrained`` (``dtype="auto"``) gives the model: the config's, else fp32."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def build_causal_lm(path_or_config: Any, dtype: torch.dtype | None = None,
                    gradient_checkpointing: bool = False) -> Any:
    """``AutoModelForCausalLM.from_config`` on the meta device (no memory for weights) in the checkpoint's dtype,
    training mode, with its non-persistent buffers recomputed on the CPU; fill it with ``HubWeights``."""
    from transformers import AutoModelForCausalLM

    config = load_config(path_or_config)
    dtype = dtype or checkpoint_dtype(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    keep_in_fp32(model, dtype)
    recompute_buffers(model)
    model.train()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def keep_in_fp32(model: Any, dtype: torch.dtype) -> None:
    """The dtypes ``from_pretrained(dtype=dtype)`` gives: the tensors the architecture keeps in fp32 when loaded in
    half precision (``_keep_in_fp32_modules`` for fp16, ``_keep_in_fp32_modules_strict`` for fp16 and bf16, e.g.
    GPT-OSS's norms, MoE routers), which ``from_config`` builds in ``dtype``. On the meta device: no memory.
    Refused by name where this transformers cannot say which tensors those are."""
    plan_of = getattr(model, "_get_dtype_plan", None)
    if plan_of is None:  # transformers < 5
        keep = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
                *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
        if keep and dtype in (torch.float16, torch.bfloat16):
            raise ValueError(f"{type(model).__name__} keeps {sorted(keep)} in fp32 when loaded in {dtype}; this "
                             "transformers version has no dtype plan to build it the same way on the meta device. "
                             "Upgrade transformers (>= 5) or use strategy.offload_params=false.")
        return
    plan = plan_of(dtype)
    if not plan:
        return
    from transformers.core_model_loading import build_glob_alternation

    pattern, group_key, _ = build_glob_alternation(list(plan))
    for name, tensor in model.state_dict(keep_vars=True).items():  # what from_pretrained loads, by module name
        match = pattern.search(name)
        if match is None or match.lastgroup is None:
            continue
        target = plan[group_key[match.lastgroup]]
        if tensor.dtype != target and tensor.is_floating_point():
            tensor.data = tensor.data.to(target)  # the same object: ties and module references hold


def recompute_buffers(model: Any) -> None:
    """Give every non-persistent meta buffer its value, on the CPU, from the owning model's ``_init_weights``;
    refuse (by name) one it does not initialize, rather than train with an uninitialized tensor."""
    persistent = set(model.state_dict(keep_vars=True).keys())
    owners: list[tuple[str, Any]] = [(n, m) for n, m in model.named_modules() if hasattr(m, "_init_weights")]
    for name, module in model.named_modules():
        prefix = name + "." if name else ""
        meta = [b for b, t in module._buffers.items() if t is not None and t.is_meta and prefix + b not in persistent]
        if not meta:
            continue
        owner = max((o for o in owners if not o[0] or name.startswith(o[0] + ".")), key=lambda o: len(o[0]))[1]
        marks = {}
        for b in meta:
            old = module._buffers[b]
            assert old is not None
            module._buffers[b] = (torch.full_like(old, float("nan"), device="cpu") if old.is_floating_point()
                                  else torch.zeros_like(old, device="cpu"))
            marks[b] = module._buffers[b]
        # Outside every torch-function mode: new tensors on the CPU (not meta), nn.init not skipped by
        # Lightning's empty-init mode; meta parameters of the same module stay meta (init on meta is free).
        with torch._C.DisableTorchFunction(), torch.no_grad():
            owner._init_weights(module)
        for b, value in marks.items():
            if value.is_floating_point() and torch.isnan(module._buffers[b]).any():
                raise ValueError(f"{prefix}{b}: a non-persistent buffer that {type(owner).__name__}._init_weights does "
                                 "not compute; this architecture cannot be built on the meta device here. Use "
                                 "strategy.offload_params=false (from_pretrained in memory).")


def block_classes(model: nn.Module) -> tuple[type[nn.Module], ...] | None:
    """The decoder-layer classes transformers names in ``_no_split_modules`` (what FSDP auto-wrap uses) that occur
    in ``model``; ``None`` if it names none (the largest ``ModuleList`` is then the block list)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    return tuple(sorted(found, key=lambda c: c.__name__)) or None
