"""How optimizer state is stored on the SSD: ``StateFormat``, a ``state_format`` (how per-element state is
stored: ``"exact"``, ``"bf16"``, ``"int8"``, or any registered format) with a ``master_format`` (``"fp32"``
or ``"bf16_sr"``). Each format is its own module in ``formats/`` (the codes are defined there); this pairs
them and answers every question the optimizer, plan and checkpoints ask about the stored layout.

Why: the offloaded step is bound by the disk, and AdamW with fp32 masters moves 24 bytes per parameter
per step. Storing the per-element floating state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
``sum``...) as bf16 or as blockwise 8-bit codes, and optionally dropping the fp32 master of bf16 params
(stochastic rounding instead), cuts that to 16, ~12 or ~4 bytes. Integer/scalar state (``step``) and
fp32 master weights are never compressed. The update itself always runs in the optimizer's own code,
in fp32, on decoded state.

``RoundTripOptimizer`` is the in-memory reference: the same optimizer with the same round trip applied
to its state after every update. An offloaded run with a format is bitwise equal to it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_nvme.optim.formats import Component, StateFormatError, master_policy, state_codec
from lightning_nvme.optim.formats.codec import MasterPolicy, StateCodec
from lightning_nvme.optim.formats.masters import HALF_DTYPES
from lightning_nvme.optim.probe import MASTER_KEY  # defined where the probe adds it to the stored keys

# Entry of a torch-format optimizer state dict (plain checkpoints) recording the format it came from and
# the step count that seeds bf16_sr rounding; torch's own load_state_dict ignores it.
STATE_DICT_KEY = "lightning_nvme_state_format"

__all__ = ["EXACT", "HALF_DTYPES", "MASTER_KEY", "STATE_DICT_KEY", "Component", "RoundTripOptimizer",
           "StateFormat", "StateFormatError", "decode_entries"]


@dataclass(frozen=True)
class StateFormat:
    """A (state_format, master_format) pair, each looked up in the registry (``formats/registry.py``)."""

    state: str = "exact"
    master: str = "fp32"

    def __post_init__(self) -> None:
        state_codec(self.state)  # raise StateFormatError for a name no format is registered under
        master_policy(self.master)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any] | None) -> StateFormat:
        """The format a checkpoint recorded (``to_dict``); nothing recorded: the default."""
        saved = saved or {}
        return cls(saved.get("state_format", "exact"), saved.get("master_format", "fp32"))

    @property
    def codec(self) -> StateCodec:
        return state_codec(self.state)

    @property
    def masters(self) -> MasterPolicy:
        return master_policy(self.master)

    @property
    def exact(self) -> bool:
        return self.codec.lossless and self.masters.keeps_masters

    @property
    def align(self) -> int:
        """Element multiple every cut of a parameter into pieces/ranks must fall on (int8 blocks)."""
        return self.codec.align

    def to_dict(self) -> dict[str, Any]:
        return {"state_format": self.state, "master_format": self.master, **self.codec.record()}

    def describe(self) -> str:
        return f"state_format={self.state!r}, master_format={self.master!r}"

    # ---- layout -------------------------------------------------------------------------------------
    def rounds_master(self, param_dtype: torch.dtype) -> bool:
        """True where a half-precision param keeps no stored fp32 master (``bf16_sr``)."""
        return self.masters.rounds(param_dtype)

    def compresses(self, key: str, dtype: torch.dtype) -> bool:
        return not self.codec.lossless and key != MASTER_KEY and dtype == torch.float32

    def components(self, key: str, dtype: torch.dtype) -> tuple[Component, ...]:
        return self.codec.components(key) if self.compresses(key, dtype) else (Component(key, dtype),)

    def elements_per_value(self, entry: str) -> int:
        """Parameter elements one value of the stored entry ``entry`` stands for: 1, or e.g. a block for
        per-block scales (a checkpoint entry ``<key>`` or ``<key><suffix>`` of a compressed key)."""
        for key in (entry.rpartition(".")[0], entry):  # side data of a key first: ``exp_avg.absmax`` is exp_avg's
            for comp in (self.components(key, torch.float32) if key else ()):
                if comp.name == entry:
                    return comp.per
        return 1

    # ---- element codecs -------------------------------------------------------------------------------
    def encode(self, key: str, values: torch.Tensor, raws: list[torch.Tensor], where: str = "") -> None:
        """Store 1-D ``values`` into ``raws`` (one 1-D tensor per component of ``key``)."""
        if not self.compresses(key, values.dtype):
            if raws[0].data_ptr() != values.data_ptr():
                raws[0].copy_(values)
        else:
            self.codec.encode(key, values, raws, where)

    def decode(self, key: str, dtype: torch.dtype, raws: list[torch.Tensor],
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The 1-D state ``raws`` stand for, as ``dtype``: a view for uncompressed keys, else ``out``
        (1-D, ``dtype``; a reused buffer spares the page faults of a fresh one) or a new tensor."""
        if not self.compresses(key, dtype):
            return raws[0]
        return self.codec.decode(key, raws, out)

    def round_trip(self, key: str, values: torch.Tensor, where: str = "") -> torch.Tensor:
        """``decode(encode(values))``: what a run in this format sees of ``values`` at the next step."""
        if not self.compresses(key, values.dtype):
            return values
        flat = values.reshape(-1)
        raws = [torch.empty(c.count(flat.numel()), dtype=c.dtype, device=flat.device)
                for c in self.components(key, values.dtype)]
        self.encode(key, flat, raws, where)
        return self.decode(key, values.dtype, raws).view(values.shape)

    def write_param(self, dst: torch.Tensor, master: torch.Tensor, step: int, index: int, start: int) -> None:
        """Copy an updated fp32 master into its (half-precision) parameter elements ``dst``: round to
        nearest, or stochastically for ``bf16_sr`` (``start``: element offset of ``dst`` in the param)."""
        self.masters.write_param(dst, master, step, index, start)


EXACT = StateFormat()


def decode_entries(fmt: StateFormat, entries: dict[str, Any]) -> None:
    """Replace one parameter's stored components (as a streamed checkpoint holds them) by torch-format
    fp32 values, in place (the plain-checkpoint converter dequantizes with this)."""
    side = {c.name for key in entries for c in fmt.components(key, torch.float32)[1:]}
    for key in [k for k in entries if k not in side]:
        value = entries[key]
        if not torch.is_tensor(value) or not fmt.compresses(key, torch.float32) or value.dim() == 0:
            continue
        raws = [value.reshape(-1)] + [entries.pop(c.name) for c in fmt.components(key, torch.float32)[1:]]
        entries[key] = fmt.decode(key, torch.float32, raws).view(value.shape)


# ---- the in-memory reference ---------------------------------------------------------------------------
class RoundTripOptimizer:
    """In-memory reference for a format: ``optimizer`` updates in fp32 (masters of half-precision params
    kept in memory, or for ``bf16_sr`` re-made from the param each step), and after every update its
    per-element state goes through ``decode(encode(.))`` and the params are rounded as the format does.

    ``RoundTripOptimizer(opt, StateFormat("int8"))`` replaces ``opt.step`` on the instance (like the
    offload strategies), so it can be returned from ``configure_optimizers`` with any strategy."""

    def __init__(self, optimizer: Optimizer, fmt: StateFormat) -> None:
        self.optimizer = optimizer
        self.fmt = fmt
        self.steps = 0
        self.masters: dict[int, torch.Tensor] = {}
        self.state: dict[int, dict[str, Any]] = {}
        self._inner_step = type(optimizer).step
        step: Callable[..., Any] = lambda closure=None: self.step(closure)
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        setattr(optimizer, "step", step)  # instance attribute, like the offload strategies

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _target(self, index: int, p: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor the optimizer updates for ``p``, its gradient set."""
        if p.dtype not in HALF_DTYPES:
            return p
        if self.fmt.rounds_master(p.dtype):
            master = p.detach().float()
        else:
            master = self.masters.setdefault(index, p.detach().float())
        master.grad = None if p.grad is None else p.grad.float()
        return master

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        opt = self.optimizer
        opt._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler's step tracking would set
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        targets = [self._target(i, p) for i, p in enumerate(params)]
        saved = [g["params"] for g in opt.param_groups]
        state: defaultdict = defaultdict(dict)
        for t, i in zip(targets, range(len(params))):
            if i in self.state:
                state[t] = self.state[i]
        pos = 0
        try:
            for g in opt.param_groups:
                g["params"] = targets[pos:pos + len(g["params"])]
                pos += len(g["params"])
            opt.state = state
            with torch.no_grad():
                self._inner_step(opt)
        finally:
            for g, ps in zip(opt.param_groups, saved):
                g["params"] = ps
            opt.state = defaultdict(dict)
        with torch.no_grad():
            for i, (p, t) in enumerate(zip(params, targets)):
                if t in state:
                    self.state[i] = {k: (self.fmt.round_trip(k, v, f" of parameter {i}")
                                         if torch.is_tensor(v) and v.shape == t.shape else v)
                                     for k, v in state[t].items()}
                if t is not p and p.grad is not None:
                    self.fmt.write_param(p.detach().view(-1), t.view(-1), self.steps, i, 0)
                    t.grad = None
        self.steps += 1
        return loss
