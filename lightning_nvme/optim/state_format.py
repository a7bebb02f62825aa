"""How optimizer state is stored on the SSD: ``state_format`` ("exact" | "bf16" | "int8") and
``master_format`` ("fp32" | "bf16_sr").

Why: the offloaded step is bound by the disk, and AdamW with fp32 masters moves 24 bytes per parameter
per step. Storing the per-element floating state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
``sum``...) as bf16 or as blockwise 8-bit codes, and optionally dropping the fp32 master of bf16 params
(stochastic rounding instead), cuts that to 16, ~12 or ~4 bytes. Integer/scalar state (``step``) and
fp32 master weights are never compressed. The update itself always runs in the optimizer's own code,
in fp32, on decoded state.

Codes (single-pass numba kernels in ``codec_kernels``, which define the arithmetic; torchao's and
bitsandbytes' CPU kernels and plain torch ops were measured slower, see docs/state_format.md):

- ``bf16``: round-to-nearest-even cast; NaN/inf stay per element.
- ``int8``: blocks of ``BLOCK`` elements aligned to the parameter's element 0, one fp32 absmax each.
  Signed keys (first moments): linear, ``q = round(127 * x / absmax)`` (int8). Keys known to be
  non-negative (second moments, the denominator of Adam's update): ``q = round(255 * (x / absmax) ** (1/4))``
  (uint8), a nonlinear code that keeps small values alive down to ~1e-11 of the block's absmax (a
  linear code would zero everything below 1/510 and blow up ``m / sqrt(v)``), in the spirit of
  bitsandbytes' dynamic map but encoded with arithmetic instead of a table search (measured 10x faster
  on CPU, docs/state_format.md). A block holding a NaN/inf would spread it to all 256 values, so it is
  refused (``StateFormatError``) instead.
- ``bf16_sr`` masters: no fp32 master is stored; the update runs on ``param.float()`` and is rounded
  back to bf16 stochastically. The noise is a hash of (optimizer step, parameter index, element index):
  deterministic, independent of how the state is cut into chunks or ranks, and reproducible on resume
  (the step count is saved in the checkpoint).

``RoundTripOptimizer`` is the in-memory reference: the same optimizer with the same round trip applied
to its state after every update. An offloaded run with a format is bitwise equal to it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_nvme.constants import MASTER_FORMATS, STATE_FORMATS
from lightning_nvme.optim import codec_kernels as kernels
from lightning_nvme.optim.codec_kernels import BLOCK

SCALE_SUFFIX = ".absmax"
# Entry of a torch-format optimizer state dict (plain checkpoints) recording the format it came from and
# the step count that seeds bf16_sr rounding; torch's own load_state_dict ignores it.
STATE_DICT_KEY = "lightning_nvme_state_format"
MASTER_KEY = "master_param"
HALF_DTYPES = (torch.float16, torch.bfloat16)
# State keys of torch optimizers that are >= 0 by construction: the unsigned code is used for them.
NONNEGATIVE_KEYS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf", "acc_delta",
                              "max_exp_avg_sqs"})
_SR_SEED = 0x5EED_0F_B16


class StateFormatError(ValueError):
    """State that a format cannot store faithfully, or a checkpoint in another format."""


@dataclass(frozen=True)
class Component:
    """One stored tensor of a state key: the values (``per`` = 1) or the per-block scales (``per`` = BLOCK)."""

    name: str
    dtype: torch.dtype
    per: int = 1

    def count(self, numel: int) -> int:
        return -(-numel // self.per)


@dataclass(frozen=True)
class StateFormat:
    """A (state_format, master_format) pair and its codecs."""

    state: str = "exact"
    master: str = "fp32"

    def __post_init__(self) -> None:
        if self.state not in STATE_FORMATS:
            raise StateFormatError(f"invalid state_format={self.state!r}: must be one of {STATE_FORMATS}")
        if self.master not in MASTER_FORMATS:
            raise StateFormatError(f"invalid master_format={self.master!r}: must be one of {MASTER_FORMATS}")

    @property
    def exact(self) -> bool:
        return self.state == "exact" and self.master == "fp32"

    @property
    def align(self) -> int:
        """Element multiple every cut of a parameter into pieces/ranks must fall on (int8 blocks)."""
        return BLOCK if self.state == "int8" else 1

    def to_dict(self) -> dict[str, Any]:
        return {"state_format": self.state, "master_format": self.master,
                **({"block": BLOCK} if self.state == "int8" else {})}

    def describe(self) -> str:
        return f"state_format={self.state!r}, master_format={self.master!r}"

    # ---- layout -------------------------------------------------------------------------------------
    def rounds_master(self, param_dtype: torch.dtype) -> bool:
        """True where a half-precision param keeps no stored fp32 master (``bf16_sr``)."""
        if self.master != "bf16_sr" or param_dtype not in HALF_DTYPES:
            return False
        if param_dtype != torch.bfloat16:
            raise StateFormatError(f"master_format='bf16_sr' rounds updates to bfloat16, but a parameter is "
                                   f"{param_dtype}: use precision='bf16-true' or master_format='fp32'")
        return True

    def compresses(self, key: str, dtype: torch.dtype) -> bool:
        return self.state != "exact" and key != MASTER_KEY and dtype == torch.float32

    def components(self, key: str, dtype: torch.dtype) -> tuple[Component, ...]:
        if not self.compresses(key, dtype):
            return (Component(key, dtype),)
        if self.state == "bf16":
            return (Component(key, torch.bfloat16),)
        code = torch.uint8 if key in NONNEGATIVE_KEYS else torch.int8
        return (Component(key, code), Component(key + SCALE_SUFFIX, torch.float32, BLOCK))

    # ---- element codecs -------------------------------------------------------------------------------
    def encode(self, key: str, values: torch.Tensor, raws: list[torch.Tensor], where: str = "") -> None:
        """Store 1-D ``values`` into ``raws`` (one 1-D tensor per component of ``key``)."""
        if not self.compresses(key, values.dtype):
            if raws[0].data_ptr() != values.data_ptr():
                raws[0].copy_(values)
        elif self.state == "bf16":
            raws[0].copy_(values)
        else:
            _encode_int8(values, raws[0], raws[1], key in NONNEGATIVE_KEYS, f"{key}{where}")

    def decode(self, key: str, dtype: torch.dtype, raws: list[torch.Tensor],
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The 1-D state ``raws`` stand for, as ``dtype``: a view for uncompressed keys, else ``out``
        (1-D, ``dtype``; a reused buffer spares the page faults of a fresh one) or a new tensor."""
        if not self.compresses(key, dtype):
            return raws[0]
        if self.state == "bf16":
            return raws[0].to(dtype) if out is None else out.copy_(raws[0])
        return _decode_int8(raws[0], raws[1], key in NONNEGATIVE_KEYS, out)

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
        if self.rounds_master(dst.dtype):
            stochastic_round_bf16(master, _sr_key(step, index), start, out=dst)
        else:
            dst.copy_(master)


EXACT = StateFormat()


def decode_entries(fmt: StateFormat, entries: dict[str, Any]) -> None:
    """Replace one parameter's stored components (as a streamed checkpoint holds them) by torch-format
    fp32 values, in place (the plain-checkpoint converter dequantizes with this)."""
    for key in [k for k in entries if not k.endswith(SCALE_SUFFIX)]:
        value = entries[key]
        if not torch.is_tensor(value) or not fmt.compresses(key, torch.float32) or value.dim() == 0:
            continue
        raws = [value.reshape(-1)] + ([entries.pop(key + SCALE_SUFFIX)] if fmt.state == "int8" else [])
        entries[key] = fmt.decode(key, torch.float32, raws).view(value.shape)


def _np(t: torch.Tensor):
    """A numpy view of a 1-D contiguous CPU tensor (bf16 as its int16 bits)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).detach().numpy()


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.device.type == "cpu" and t.is_contiguous() else t.detach().reshape(-1).cpu()


def _encode_int8(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, unsigned: bool,
                 what: str) -> None:
    x = _on_cpu(values)
    c, s = (codes, scales) if codes.device.type == "cpu" else (torch.empty_like(codes, device="cpu"),
                                                                torch.empty_like(scales, device="cpu"))
    if kernels.encode_int8(_np(x), _np(c), _np(s), unsigned) >= 0:
        _report(x, what, 0, unsigned)
    if c is not codes:
        codes.copy_(c)
        scales.copy_(s)


def _report(x: torch.Tensor, what: str, offset: int, unsigned: bool) -> None:
    flat = x.reshape(-1)
    nonfinite = (~torch.isfinite(flat)).nonzero()
    if len(nonfinite):
        first = int(nonfinite[0]) + offset
        raise StateFormatError(
            f"optimizer state {what} holds {len(nonfinite)} NaN/inf value(s) (first at element {first}): "
            f"state_format='int8' shares one scale per {BLOCK} elements and would spread them over the block. "
            "Training has diverged (check the learning rate / loss scaling), or store this state with "
            "state_format='bf16' or 'exact', which keep non-finite values per element")
    first = int((flat < 0).nonzero()[0]) + offset
    raise StateFormatError(f"optimizer state {what} is negative at element {first} ({float(flat[first - offset])}), "
                           f"but its key is stored with the unsigned int8 code for non-negative second moments; "
                           "use state_format='bf16' for this optimizer")


def _decode_int8(codes: torch.Tensor, scales: torch.Tensor, unsigned: bool,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    if codes.device.type != "cpu":
        return _decode_int8(codes.cpu(), scales.cpu(), unsigned).to(codes.device)
    if out is None:
        out = torch.empty(codes.numel(), dtype=torch.float32)
    kernels.decode_int8(_np(codes), _np(scales), _np(out), unsigned)
    return out


# ---- stochastic rounding ------------------------------------------------------------------------------
def _sr_key(step: int, index: int) -> int:
    """A well-mixed 32-bit key per (optimizer step, parameter index) (splitmix64 finalizer)."""
    z = (_SR_SEED + step * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def stochastic_round_bf16(x: torch.Tensor, key: int, start: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 -> bf16, rounding away from zero with probability (dropped bits) / 2**16, with noise that
    is a pure function of the element index (``codec_kernels.stochastic_round_bf16``), so any cut of a
    tensor into pieces rounds identically. Into ``out`` (bf16, ``x``'s shape) when given."""
    flat = _on_cpu(x)
    direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
    dst = out.view(-1) if direct else torch.empty(flat.numel(), dtype=torch.bfloat16)  # type: ignore[union-attr]
    kernels.stochastic_round_bf16(_np(flat), _np(dst), key, start)
    if out is None:
        return dst.view(x.shape).to(x.device)
    if not direct:
        out.copy_(dst.view(out.shape))
    return out


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
