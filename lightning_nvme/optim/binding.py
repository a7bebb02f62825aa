"""``OptimizerBinding``: what an offloaded optimizer changes on the user's optimizer object, in one place.

Why: the user's optimizer stays the object Lightning, LR schedulers and callbacks hold, so its ``step``,
``state_dict`` and ``load_state_dict`` are replaced on the instance (instance attributes win over the
class's methods for every caller). This class names each replacement and installs them together;
nothing else sets attributes on the user's optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch.optim import Optimizer

from lightning_nvme.optim.step_hooks import call_with_step_hooks

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
