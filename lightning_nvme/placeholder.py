"""What a module holds for a parameter whose values live only in the store.

Why this shape: the ``nn.Parameter`` object must stay the same (the optimizer, autograd's saved
tensors and the user's references all hold it), so only its ``.data`` is swapped. The placeholder
keeps shape, dtype and device (model summaries, optimizer planning and shape checks still work) but
owns one element: a NaN for floating dtypes, so code that reads an offloaded parameter without the
strategy loading it produces NaNs instead of plausible numbers. ``stride 0`` marks it.

A leaf module (torch only): parameter offload (``params``) makes placeholders, and the optimizer's plan
(``optim``, a lower layer) recognises them.
"""

from __future__ import annotations

import torch


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((1,), fill, dtype=dtype, device=device).expand(shape)


def is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and all(s == 0 for s in t.stride())
