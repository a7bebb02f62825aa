"""Torch's optimizer step pre/post hooks, fired once per ``optimizer.step()`` of an offloaded optimizer.

Why: the offloaded step runs the optimizer class's raw step once per chunk (``probe.raw_step``); torch's
own wrapper around it would fire the global and per-instance hooks (EMA, logging) once per chunk. This
fires them exactly as that wrapper does, around the whole offloaded step, and keeps them silent inside
it (a custom ``step`` may call ``super().step()``, which is wrapped again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks


def call_with_step_hooks(optimizer: Optimizer, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``step(*args, **kwargs)`` with the hooks around it; ``args[0]`` is the optimizer, as in torch."""
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        for pre_hook in chain(_global_optimizer_pre_hooks.values(), optimizer._optimizer_step_pre_hooks.values()):
            result = pre_hook(optimizer, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{pre_hook} must return None or a tuple of (new_args, new_kwargs), "
                                       f"but got {result}.")
                args, kwargs = result
        out = step(*args, **kwargs)
        optimizer._optimizer_step_code()
        for post_hook in chain(optimizer._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
            post_hook(optimizer, args, kwargs)
        return out


@contextmanager
def hooks_silenced(optimizer: Optimizer) -> Iterator[None]:
    """No step hook (global or of ``optimizer``) fires inside: the per-chunk and probe steps."""
    saved_pre, saved_post = OrderedDict(_global_optimizer_pre_hooks), OrderedDict(_global_optimizer_post_hooks)
    saved_own = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    try:
        _global_optimizer_pre_hooks.clear()
        _global_optimizer_post_hooks.clear()
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = saved_own
        _global_optimizer_pre_hooks.clear()
        _global_optimizer_pre_hooks.update(saved_pre)
        _global_optimizer_post_hooks.clear()
        _global_optimizer_post_hooks.update(saved_post)
