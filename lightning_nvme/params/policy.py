"""Which modules are the *blocks* whose parameters leave memory between uses.

Why blocks: a parameter is loaded for the forward of the module that uses it, and a transformer's
layer is the natural unit: big enough that one read per use is efficient, small enough that a few
resident at once cost little. Like FSDP's auto-wrap policy, the user may name the module classes;
by default each child of the largest ``nn.ModuleList``/``nn.Sequential`` is a block (a GPT's layer list).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from torch import nn

BlockClasses = Iterable[type[nn.Module] | str] | None


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def resolve_classes(classes: BlockClasses) -> tuple[type[nn.Module], ...] | None:
    """Classes, or dotted import paths of classes (what a Hydra config can hold)."""
    if classes is None:
        return None
    out = []
    for c in classes:
        if isinstance(c, str):
            module_name, _, attr = c.rpartition(".")
            try:
                c = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError, ValueError) as e:
                raise ValueError(f"param_block_classes: cannot import {c!r} ({e}); give a dotted path such as "
                                 "'lightning_nvme.models.gpt.Block'") from e
        if not (isinstance(c, type) and issubclass(c, nn.Module)):
            raise ValueError(f"param_block_classes: {c!r} is not an nn.Module subclass")
        out.append(c)
    return tuple(out)


def model_block_classes(model: nn.Module) -> BlockClasses:
    """The block classes a model names for itself (``model.param_block_classes()``, e.g. a Hugging Face model's
    decoder layers), if it does."""
    own = getattr(model, "param_block_classes", None)
    return own() if callable(own) else None


def find_blocks(model: nn.Module, classes: BlockClasses = None) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of each block, in registration order (the forward order of a layer
    list). With ``classes``: every outermost module of one of those classes. Without: the children of
    the ``ModuleList``/``Sequential`` holding the most parameters. Modules without parameters are skipped."""
    wanted = resolve_classes(classes)
    if wanted is not None:
        found: list[tuple[str, nn.Module]] = []
        inside: list[str] = []
        for name, m in model.named_modules():
            if isinstance(m, wanted) and not any(name.startswith(p + ".") for p in inside) and m is not model:
                found.append((name, m))
                inside.append(name)
        return [(n, m) for n, m in found if _param_count(m)]
    containers = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    if not containers:
        return []
    name, best = max(containers, key=lambda nm: _param_count(nm[1]))
    prefix = f"{name}." if name else ""
    return [(prefix + child_name, child) for child_name, child in best.named_children() if _param_count(child)]
