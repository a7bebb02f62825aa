"""Building a model too big for memory: parameters created on the meta device, then initialized one
module at a time, each block written to the store as soon as its last module is initialized.

Initialization follows Lightning's convention for meta-device models (``_materialize_meta_tensors``,
as for FSDP/DeepSpeed): module order, ``reset_parameters()`` of each module holding meta tensors.
Conversion swaps tensors in place (``swap_module_params_on_conversion``), so the ``nn.Parameter``
objects stay the same and tied parameters (GPT-2's wte / lm_head) stay tied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from lightning.fabric.utilities.init import _has_meta_device_parameters_or_buffers, _materialize
from torch import nn


def has_meta_tensors(model: nn.Module) -> bool:
    return _has_meta_device_parameters_or_buffers(model)


@contextmanager
def _swap_on_conversion() -> Iterator[None]:
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def materialize(model: nn.Module, device: torch.device, after_module: Callable[[], None] | None = None) -> None:
    """Initialize every meta tensor of ``model`` on ``device``; ``after_module`` runs after each module
    (a parameter offload places the blocks that are now complete)."""
    with _swap_on_conversion():
        for module in model.modules():
            if _has_meta_device_parameters_or_buffers(module, recurse=False):
                _materialize(module, device)
            if after_module is not None:
                after_module()
