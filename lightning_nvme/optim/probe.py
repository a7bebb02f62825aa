"""What the plan must know about a user's optimizer, learned by running its own update code on dummies.

Why probe: the strategy wraps *any* optimizer whose state is per-parameter. Instead of a table of known
optimizers, it runs the optimizer's own step on throwaway parameters (with the real group's
hyperparameters and fresh state) and reads back which state keys it creates and their dtypes.

Why per shape class: state can depend on the parameter's rank (``torch.optim.Adafactor`` keeps a
per-element ``variance`` for 1-D parameters but factored row/column state for 2-D and larger ones),
so each group is probed once per class (1-D, 2-D, 3-D and more).

Why a split test: the strategy cuts a large parameter into element ranges and updates each range on
its own. That gives the same numbers only if the update is element-wise. A norm-based update
(Adafactor's relative step size, LAMB's trust ratio) is not, whatever its state looks like, so the
probe updates a dummy whole and as two halves of very different norms and compares.

Why the raw step: torch wraps every optimizer class's ``step`` so that the step pre/post hooks fire.
The strategy runs the class's step once per chunk (and here on dummies), so it calls the unwrapped
function and fires the hooks itself, once per ``optimizer.step()`` (see ``binding``).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_nvme.optim.binding import hooks_silenced

MASTER_KEY = "master_param"  # the stored fp32 master weights of a half-precision parameter: one definition
# Class attribute a custom optimizer sets to say "my step only updates each parameter from its own
# gradient and state", so running it chunk by chunk is exact.
ELEMENTWISE_OPT_IN = "nvme_offload_elementwise_step"
_PROBE_SHAPES = {1: (2,), 2: (2, 3), 3: (2, 2, 3)}
_SPLIT_SHAPES = {1: (8,), 2: (4, 6), 3: (2, 4, 6)}
_SPLIT_STEPS = 3


class UnsupportedOptimizerError(ValueError):
    """The optimizer's update cannot be run chunk by chunk on offloaded state; the message says what to change."""


@dataclass(frozen=True)
class StateSpec:
    """What one param group's optimizer keeps for parameters of one shape class."""

    tensor_keys: tuple[tuple[str, torch.dtype], ...]  # per-element state (stored), incl. MASTER_KEY if kept
    scalar_keys: tuple[str, ...]  # everything else (kept in memory: ``step``, factored row/col state)
    splittable: bool  # the update is element-wise: element ranges may be updated separately


def shape_class(p: torch.Tensor) -> int:
    """1 for scalars and vectors, 2 for matrices, 3 for anything larger."""
    return min(max(p.dim(), 1), 3)


def raw_step(optimizer: Optimizer) -> Callable[..., Any]:
    """The optimizer class's ``step`` without torch's hook-firing wrapper."""
    step: Any = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def check_supported(optimizer: Optimizer, strategy_name: str = "nvme_offload") -> None:
    """Refuse optimizers whose step cannot be run per chunk, naming the optimizer and what to change."""
    name = type(optimizer).__name__
    step = raw_step(optimizer)
    closure = inspect.signature(step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise UnsupportedOptimizerError(
            f"{strategy_name}: {name} needs a closure in every step (it re-evaluates the loss, e.g. LBFGS's line "
            f"search over all parameters), so its update cannot be run chunk by chunk on offloaded state. Use "
            f"strategy='auto' for {name}, or an optimizer with per-parameter state (AdamW, SGD, ...).")
    module = getattr(step, "__module__", "") or ""
    if not module.startswith("torch.optim") and not getattr(type(optimizer), ELEMENTWISE_OPT_IN, False):
        raise UnsupportedOptimizerError(
            f"{strategy_name}: {name}.step is custom code ({module}.{getattr(step, '__qualname__', 'step')}); the "
            f"strategy would run it once per chunk of parameters, which changes any step that does more than "
            f"update each parameter from its own gradient and state. If that is all {name}.step does, declare it "
            f"with the class attribute `{name}.{ELEMENTWISE_OPT_IN} = True`; otherwise use strategy='auto'.")


def _run(optimizer: Optimizer, group: dict, params: list[torch.Tensor], steps: int = 1) -> dict:
    """Run the optimizer's raw step ``steps`` times on ``params`` with ``group``'s hyperparameters and fresh
    state, no step hook firing; return the state it created. The real groups and state are restored."""
    saved_groups, saved_state = optimizer.param_groups, optimizer.state
    try:
        optimizer.param_groups = [dict(group, params=params)]
        optimizer.state = defaultdict(dict)
        try:
            with hooks_silenced(optimizer):
                for _ in range(steps):
                    raw_step(optimizer)(optimizer)
            return optimizer.state
        except KeyError:
            # Optimizers that create their state in __init__ (Adagrad) fail a step on a fresh param:
            # build a throwaway instance with this group's hyperparameters instead.
            accepted = inspect.signature(type(optimizer).__init__).parameters
            fresh = type(optimizer)(params, **{k: v for k, v in group.items() if k in accepted and k != "params"})
            with hooks_silenced(fresh):
                for _ in range(steps):
                    raw_step(fresh)(fresh)
            return fresh.state
    finally:
        optimizer.param_groups, optimizer.state = saved_groups, saved_state


def _splittable(optimizer: Optimizer, group: dict, cls: int) -> bool:
    """Whether updating two halves of a parameter separately gives the whole parameter's update."""
    gen = torch.Generator().manual_seed(0)
    shape = _SPLIT_SHAPES[cls]
    n = torch.Size(shape).numel()
    scale = torch.ones(n)
    scale[n // 2:] = 100.0  # halves of very different norms: norm-based updates differ visibly
    value = torch.randn(n, generator=gen) * scale
    grad = torch.randn(n, generator=gen) * scale
    whole = value.clone().view(shape)
    whole.grad = grad.clone().view(shape)
    halves = [value[:n // 2].clone(), value[n // 2:].clone()]
    for h, g in zip(halves, (grad[:n // 2], grad[n // 2:])):
        h.grad = g.clone()
    probe_group = dict(group, lr=1e-2) if isinstance(group.get("lr"), float) else group
    with torch.no_grad():
        _run(optimizer, probe_group, [whole], _SPLIT_STEPS)
        _run(optimizer, probe_group, halves, _SPLIT_STEPS)
    moved_whole = whole.reshape(-1) - value
    moved_split = torch.cat(halves) - value
    return bool(torch.allclose(moved_whole, moved_split, rtol=1e-3, atol=1e-3 * float(moved_whole.abs().max())))


def probe_state_spec(optimizer: Optimizer, group: dict, master: bool, cls: int = 1) -> StateSpec:
    """The state the optimizer creates for a parameter of shape class ``cls`` in ``group``."""
    dtype = torch.float32 if master else next((p.dtype for p in group["params"]), torch.float32)
    dummy = torch.zeros(_PROBE_SHAPES[cls], dtype=dtype)
    dummy.grad = torch.zeros_like(dummy)
    with torch.no_grad():
        created = _run(optimizer, group, [dummy]).get(dummy, {})
    tensor_keys, scalar_keys = [], []
    for key, value in created.items():
        if torch.is_tensor(value) and value.shape == dummy.shape:
            tensor_keys.append((key, value.dtype))
        else:
            scalar_keys.append(key)
    if master:
        tensor_keys.append((MASTER_KEY, torch.float32))
    return StateSpec(tuple(tensor_keys), tuple(scalar_keys), _splittable(optimizer, group, cls))
