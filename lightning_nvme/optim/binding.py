"""``OptimizerBinding``: what an offloaded optimizer changes on the user's optimizer object, in one place.

Why: the user's optimizer stays the object Lightning, LR schedulers and callbacks hold, so its ``step``,
``state_dict`` and ``load_state_dict`` are replaced on the instance (instance attributes win over the
class's methods for every caller). This class names each replacement and installs them together;
nothing else sets attributes on the user's optimizer.

Torch's step pre/post hooks are fired here too, once per ``optimizer.step()``: the offloaded step runs the
optimizer class's raw step once per chunk (``probe.raw_step``), and torch's own wrapper around it would fire
the global and per-instance hooks (EMA, logging) once per chunk. ``call_with_step_hooks`` fires them exactly as
that wrapper does, around the whole offloaded step; ``hooks_silenced`` keeps them silent inside it (a custom
``step`` may call ``super().step()``, which is wrapped again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any, Protocol

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

BOUND = ("step", "state_dict", "load_state_dict")  # the optimizer methods an offloaded optimizer replaces


class Offloaded(Protocol):
    """What the binding calls: the offloaded optimizer (see ``OffloadedOptimizer``)."""

    optimizer: Optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class OffloadedStep:
    """``optimizer.step`` of an offloaded optimizer: torch's step hooks once, then the offloaded step.

    A class rather than a closure so the optimizer stays picklable; ``_wrapped_by_lr_sched`` tells an LR
    scheduler the step is already tracked (the offloaded step sets ``_opt_called`` itself)."""

    _wrapped_by_lr_sched = True

    def __init__(self, offloaded: Offloaded) -> None:
        self.offloaded = offloaded

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        off = self.offloaded
        return call_with_step_hooks(off.optimizer, lambda _opt, *a, **kw: off.step(*a, **kw),
                                    (off.optimizer, *args), kwargs)


class OptimizerBinding:
    """Replaces ``BOUND`` on ``offloaded.optimizer`` by the offloaded optimizer's own."""

    def __init__(self, offloaded: Offloaded) -> None:
        self.offloaded = offloaded

    def install(self) -> None:
        off, opt = self.offloaded, self.offloaded.optimizer
        methods: dict[str, Callable[..., Any]] = {
            "step": OffloadedStep(off), "state_dict": off.state_dict, "load_state_dict": off.load_state_dict}
        for name in BOUND:
            setattr(opt, name, methods[name])

    @staticmethod
    def mark_called(optimizer: Optimizer) -> None:
        """What an LR scheduler's step-tracking wrapper would set on a wrapped ``step`` call."""
        setattr(optimizer, "_opt_called", True)


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
