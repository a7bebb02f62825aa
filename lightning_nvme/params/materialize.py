"""Building a model too big for memory: parameters created on the meta device, then initialized one
module at a time, each block written to the store as soon as its last module is initialized.

Initialization follows Lightning's convention for meta-device models (``_materialize_meta_tensors``,
as for FSDP/DeepSpeed): module order, ``reset_parameters()`` of each module holding meta tensors.
Meta tensors are swapped in place (``torch.utils.swap_tensors``), so the ``nn.Parameter`` objects stay
the same and tied parameters (GPT-2's wte / lm_head) stay tied; tensors already on a device (buffers a
model computed at construction) are left as they are.

A pretrained model's values come from its checkpoint instead: a LightningModule that defines
``initial_weights()`` returns ``InitialWeights`` (e.g. ``lightning_nvme.models.gpt.PretrainedWeights``, a
safetensors directory read tensor by tensor); every tensor it names is copied from there, one at a time,
so the checkpoint is never loaded whole. Modules it does not cover (adapters added for finetuning) are
initialized by ``reset_parameters()`` as above.

A fresh model whose own init is not ``reset_parameters()`` (Hugging Face models initialize through the model's
``_init_weights``, and their RMSNorms have no ``reset_parameters``) gives an initial-weights object that also
initializes whole modules: ``init_module(module)`` (``ModuleInit``; e.g. ``lightning_nvme.models.hf.HFInit``),
called after the module's tensors are allocated, returning False for a module it does not know (then
``reset_parameters()`` as above).

A source that can also read part of a tensor (``RangedWeights``: ``read_range``) lets a sharded build read only what
each rank keeps: ``nvme_offload_fsdp`` fills each rank's shard of a block from the element ranges it owns
(``params.sharded``), where ``materialize`` would read every tensor whole on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol, cast

import torch
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers
from torch import nn

from lightning_nvme.optim.plan import placeholder


class InitialWeights(Protocol):
    """Where a model's initial values come from, tensor by tensor; names are the model's ``state_dict`` keys."""

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


class ModuleInit(InitialWeights, Protocol):
    """Initial values made in place, one module at a time (a random init seeded per module, so that the values do
    not depend on the order modules are initialized in, nor on whether the model is built on the meta device)."""

    def init_module(self, module: nn.Module) -> bool: ...


class RangedWeights(InitialWeights, Protocol):
    """Initial values that can also be read a flat element range at a time. Why: a sharded build (``nvme_offload_fsdp``)
    keeps 1/N of each block per rank; reading every tensor whole on every rank read N times the model's bytes.

    ``stored_shape(name)``: the tensor's shape as stored (checked against the model's before a range is read);
    ``read_range(name, start, stop)``: elements ``[start, stop)`` of the tensor flattened, 1-D, in the stored dtype
    (converted by the caller, as ``copy_checked`` converts a whole one); ``close()``: the files ``read_range``
    opened are closed (it opens them again if called later)."""

    def stored_shape(self, name: str) -> tuple[int, ...]: ...

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def close(self) -> None: ...


def ranged(source: InitialWeights | None) -> RangedWeights | None:
    """``source`` if it can read element ranges (it has ``read_range``), else ``None``."""
    return cast(RangedWeights, source) if callable(getattr(source, "read_range", None)) else None


def initial_weights(model: nn.Module) -> InitialWeights | None:
    """The model's own source of initial values, if it says it has one (``model.initial_weights()``)."""
    source = getattr(model, "initial_weights", None)
    return source() if callable(source) else None


def check_shape(name: str, stored: Sequence[int], model: Sequence[int]) -> None:
    """Refuse, by name, a stored tensor whose shape is not the model's (a copy would broadcast silently, a range
    would read another layout's elements)."""
    if tuple(stored) != tuple(model):
        raise ValueError(f"{name}: the checkpoint holds shape {tuple(stored)}, the model {tuple(model)} "
                         "(a config.json that does not match its weights)")


def copy_checked(name: str, value: torch.Tensor, into: torch.Tensor) -> None:
    """``into.copy_(value)``, refusing a shape mismatch (``check_shape``)."""
    check_shape(name, value.shape, into.shape)
    with torch.no_grad():
        into.copy_(value)


def copy_range_checked(source: RangedWeights, name: str, shape: Sequence[int], dtype: torch.dtype, start: int,
                       stop: int, into: torch.Tensor) -> None:
    """Elements ``[start, stop)`` of ``name`` (the model's ``shape`` and ``dtype``) from ``source`` into ``into``
    (1-D, ``stop - start`` elements), converted exactly as the whole tensor is on its way into a flat buffer:
    stored dtype -> ``dtype`` by ``copy_`` (``copy_checked`` into the parameter), then -> ``into``'s dtype by
    ``copy_`` (``FlatShards.pack``). ``copy_`` converts element by element, so a range gets the bits its elements
    get in the whole tensor."""
    check_shape(name, source.stored_shape(name), shape)
    value = source.read_range(name, start, stop)
    if value.numel() != stop - start:
        raise ValueError(f"{name}: asked for elements [{start}, {stop}), the source returned {value.numel()}")
    with torch.no_grad():
        if dtype != into.dtype:  # the parameter's dtype first, as the whole path rounds through it
            value = torch.empty(value.shape, dtype=dtype, device=into.device).copy_(value)
        into.copy_(value)


def has_meta_tensors(model: nn.Module) -> bool:
    return _has_meta_device_parameters_or_buffers(model)


def materialize(model: nn.Module, device: torch.device, after_module: Callable[[], None] | None = None,
                skip: Collection[int] = (), source: InitialWeights | None = None) -> None:
    """Initialize every meta tensor of ``model`` on ``device`` (from ``source``, by default
    ``initial_weights(model)``, where it has them; a resumed checkpoint's weights are such a source);
    ``after_module`` runs after each module (a parameter offload places the blocks that are
    now complete). Parameters whose ``id`` is in ``skip`` get placeholders instead, never a value (streamed
    evaluation reads them per forward: ``lightning_nvme.params.stream``). If it fails (a checkpoint tensor of
    another shape), what is still on the meta device gets placeholders (``abandon_meta``) before the error goes on,
    so the error the user sees is this one, not the teardown's on meta tensors."""
    source = source if source is not None else initial_weights(model)
    try:
        for prefix, module in model.named_modules():
            if _has_meta_device_parameters_or_buffers(module, recurse=False):
                _initialize(module, prefix + "." if prefix else "", device, source, skip)
            if after_module is not None:
                after_module()
    except BaseException:
        abandon_meta(model, device)
        raise


def empty_meta(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(recurse=False)`` for its meta tensors only: a buffer already computed (a rotary
    ``inv_freq`` a model built on the CPU at construction) keeps its value. Parameters are swapped in place
    (the same ``nn.Parameter`` objects: ties survive), as ``to_empty`` does under ``_swap_on_conversion``."""
    for p in module._parameters.values():
        if p is not None and p.is_meta:
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad))
    for name, b in module._buffers.items():
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty_like(b, device=device)


def abandon_meta(model: nn.Module, device: torch.device) -> None:
    """Every tensor of ``model`` still on the meta device swapped for a placeholder (parameters in place, the same
    objects). Why: after a build failed half way (a tensor of another shape), what runs next (a strategy's teardown
    sets placeholders, Lightning moves the module to the CPU) failed on the meta tensors and hid the build's error."""
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and p.is_meta:
                _to_placeholder(p, device)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = placeholder(b.shape, b.dtype, device)


def _to_placeholder(p: nn.Parameter, device: torch.device) -> None:
    torch.utils.swap_tensors(p, nn.Parameter(placeholder(p.shape, p.dtype, device), requires_grad=p.requires_grad))


def _skip(module: nn.Module, prefix: str, device: torch.device, skip: Collection[int],
          source: InitialWeights | None) -> None:
    """The meta parameters of ``module`` in ``skip`` swapped for placeholders (the same objects); refused by name
    where its other meta tensors would need its ``reset_parameters()``, which would write into the placeholders."""
    skipped = [n for n, p in module._parameters.items() if p is not None and p.is_meta and id(p) in skip]
    for n in skipped:
        p = module._parameters[n]
        assert p is not None
        _to_placeholder(p, device)
    left = [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None and t.is_meta]
    uncovered = [n for n in left if source is None or prefix + n not in source]
    if skipped and uncovered:
        raise ValueError(f"{prefix.rstrip('.')}: {[prefix + n for n in skipped]} are read per block from their file "
                         "(streamed evaluation, or frozen_weights='in_place' in fit), but "
                         f"{[prefix + n for n in uncovered]} of the same module would need its reset_parameters(), "
                         "which also writes the streamed ones. Give the model initial weights covering them "
                         "(initial_weights()), or use offload_params=False (evaluation) / frozen_weights='store' (fit).")


def _initialize(module: nn.Module, prefix: str, device: torch.device, source: InitialWeights | None,
                skip: Collection[int] = ()) -> None:
    if skip:
        _skip(module, prefix, device, skip, source)
        if not _has_meta_device_parameters_or_buffers(module, recurse=False):
            return
    own = [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None and t.is_meta]
    given = [n for n in own if source is not None and prefix + n in source]
    empty_meta(module, device)
    init_module = getattr(source, "init_module", None)
    if len(given) < len(own) and not (callable(init_module) and init_module(module)):
        # reset_parameters() for what the source does not cover (Lightning's _materialize)
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise TypeError(f"Materialization requires that the `{type(module).__name__}.reset_parameters` method is "
                            f"implemented: {prefix}{[n for n in own if n not in given]} are not in the checkpoint and "
                            "nothing else initializes them.")
        reset()
    for n in given:
        assert source is not None
        tensor: torch.Tensor | None = module._parameters.get(n)
        if tensor is None:
            tensor = module._buffers[n]
        assert tensor is not None  # listed above as a meta tensor
        copy_checked(prefix + n, source.get(prefix + n), tensor)
