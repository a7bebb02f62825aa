"""The one-pass update (``formats/adamw_kernel.py``) in place of the optimizer's own step, where it gives the
same bits: torch's ``AdamW``/``Adam`` with ``fused=True`` on bf16 CPU params, ``state_format="int8"`` and
``master_format="bf16_sr"`` (the 7 B recipe's settings).

Why a gate and a self-check: the chunk updater's contract is that the user's optimizer code is the reference
(``chunk_update``). The kernel re-implements that code for one optimizer, so it runs only where the
optimizer's class, hyperparameters and call are the ones it implements (``plan``), and only after it has
reproduced torch's own ``_fused_adamw_`` bit for bit on random data in this process (``verified``); a torch
build whose compiler shaped the arithmetic differently keeps the generic path. Everything else (a
piece's last partial block, whose elements torch computes in its scalar tail, other optimizers and formats)
runs the optimizer's own step as before.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch
from torch.optim import Optimizer

from lightning_nvme.constants import INT8_BLOCK as BLOCK
from lightning_nvme.optim.formats.codec import StateFormatError, as_numpy
from lightning_nvme.optim.formats.int8 import Int8
from lightning_nvme.optim.formats.masters import StochasticBf16, sr_key
from lightning_nvme.optim.formats.state_format import StateFormat
from lightning_nvme.optim.plan import Piece

log = logging.getLogger(__name__)

KEYS = ("exp_avg", "exp_avg_sq")
_FLAGS_OFF = ("amsgrad", "maximize", "capturable", "differentiable")


@dataclass(frozen=True)
class FusedPlan:
    """What one ``optimizer.step()`` may run through the kernel: the param groups it covers."""

    groups: frozenset[int]

    def covers(self, piece: Piece) -> bool:
        p, g = piece.param, piece.param.grad
        return (piece.group in self.groups and piece.rounds_master and p.device.type == "cpu"
                and p.dtype == torch.bfloat16 and p.is_contiguous() and g is not None
                and g.dtype == torch.bfloat16 and g.is_contiguous() and piece.start % BLOCK == 0
                and tuple(k for k, _ in piece.keys) == KEYS and piece.numel >= BLOCK)


def plan(optimizer: Optimizer, fmt: StateFormat, step_kwargs: dict[str, Any]) -> FusedPlan | None:
    """The groups of this step the kernel computes exactly, or ``None``: not this optimizer, format or call."""
    if (type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam) or step_kwargs
            or not isinstance(fmt.codec, Int8) or not isinstance(fmt.masters, StochasticBf16)
            or getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None):
        return None
    decoupled = type(optimizer) is torch.optim.AdamW
    groups = frozenset(i for i, g in enumerate(optimizer.param_groups) if _group_ok(g, decoupled))
    return FusedPlan(groups) if groups and verified() else None


def _group_ok(group: dict[str, Any], decoupled: bool) -> bool:
    numbers = [group.get("lr"), group.get("eps"), group.get("weight_decay"), *group.get("betas", ())]
    return (group.get("fused") is True and not any(group.get(k) for k in _FLAGS_OFF) and len(numbers) == 5
            and all(type(x) is float or type(x) is int for x in numbers)
            and (decoupled or bool(group.get("decoupled_weight_decay")) or group["weight_decay"] == 0))


def constants(group: dict[str, Any], step: float) -> np.ndarray:
    """The kernel's fp32 constants for a group at (1-based) ``step``, computed in double and rounded once,
    as torch's ``adam_fused_step_impl`` does."""
    lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    w = np.float32(1 - beta1)
    small = abs(w) < np.float32(0.5)
    return np.array([1 - lr * wd, w if small else w - np.float32(1.0), 1.0 if small else 0.0, beta2, 1 - beta2,
                     math.sqrt(1 - beta2 ** step), eps, -(lr / (1 - beta1 ** step))], dtype=np.float32)


def update_blocks(piece: Piece, group: dict[str, Any], step: torch.Tensor, raws: dict[str, list[torch.Tensor]],
                  initialized: bool, steps_done: int, parts: int) -> int:
    """Update the piece's full blocks in place (param bf16 bits, int8 codes and scales of both moments);
    ``step``: the piece's step count after this update. Returns the elements done (the full blocks)."""
    from lightning_nvme.optim.formats import adamw_kernel

    blocks = piece.numel // BLOCK
    p = piece.param.detach().view(-1)[piece.start:piece.start + blocks * BLOCK]
    g = piece.param.grad.view(-1)[piece.start:piece.start + blocks * BLOCK]  # type: ignore[union-attr]
    (mc, ms), (vc, vs) = raws["exp_avg"], raws["exp_avg_sq"]
    refused = adamw_kernel.update_blocks(as_numpy(p), as_numpy(g), as_numpy(mc), as_numpy(ms), as_numpy(vc),
                                         as_numpy(vs), initialized, constants(group, float(step.item())),
                                         sr_key(steps_done, piece.index), piece.start, blocks, parts)
    if refused >= 0:
        lo = piece.start + refused // 2 * BLOCK
        raise StateFormatError(
            f"optimizer state {KEYS[refused % 2]} of parameter {piece.index} became NaN/inf in elements "
            f"[{lo}, {lo + BLOCK}) at this update: state_format='int8' shares one scale per {BLOCK} elements and "
            "would spread it over the block. Training has diverged (check the learning rate / loss scaling and the "
            "gradients), or store this state with state_format='bf16' or 'exact', which keep non-finite values "
            "per element")
    return blocks * BLOCK


def threads(numel: int) -> int:
    """Threads for a piece's kernel call: the format kernels' rule (``kernels._parts``)."""
    from lightning_nvme.optim.formats import kernels

    return kernels._parts(numel)


@cache
def verified() -> bool:
    """Whether the kernel reproduces this torch build's fused AdamW (with the int8 round trip and bf16_sr
    rounding) bit for bit on random data: a few hyperparameter sets, first and later steps."""
    from lightning_nvme.optim.formats import kernels
    from lightning_nvme.optim.formats.adamw_kernel import update_blocks as kernel

    rng = np.random.default_rng(0)
    n = 64 * BLOCK
    ok = True
    for lr, betas, eps, wd, step in ((1e-3, (0.9, 0.999), 1e-8, 0.01, 1.0), (1e-5, (0.9, 0.95), 1e-6, 0.1, 7.0),
                                     (3e-4, (0.3, 0.99), 1e-8, 0.0, 3.0)):
        scale = np.float32(10.0) ** rng.uniform(-6, 1, n).astype(np.float32)
        p = torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * scale).bfloat16()
        g = torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * scale * np.float32(1e-2)).bfloat16()
        codes = [torch.from_numpy(rng.integers(-127, 128, n).astype(np.int8)),
                 torch.from_numpy(rng.integers(0, 256, n).astype(np.uint8))]
        scales = [torch.from_numpy(np.float32(10.0) ** rng.uniform(-6, -2, n // BLOCK).astype(np.float32))
                  for _ in range(2)]
        # torch: decode, its own fused AdamW in fp32, encode, round
        master = p.float()
        master.grad = g.float()
        state = {"step": torch.tensor(step - 1), **{k: Int8().decode(k, [c, s], None) for k, c, s in zip(KEYS, codes, scales)}}
        opt = torch.optim.AdamW([master], lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True)
        opt.state[master] = state
        opt.step()
        want = []
        for k in KEYS:
            c, s = torch.empty_like(codes[KEYS.index(k)]), torch.empty(n // BLOCK)
            Int8().encode(k, opt.state[master][k], [c, s], "")
            want += [c, s]
        want_p = torch.empty_like(p)
        kernels.stochastic_round_bf16(as_numpy(master.detach()), as_numpy(want_p), sr_key(5, 2), 4 * BLOCK)
        # the kernel
        got = [codes[0].clone(), scales[0].clone(), codes[1].clone(), scales[1].clone()]
        got_p = p.clone()
        consts = constants(opt.param_groups[0], step)
        mc, ms, vc, vs = (as_numpy(t) for t in got)
        kernel(as_numpy(got_p), as_numpy(g), mc, ms, vc, vs, True, consts, sr_key(5, 2), 4 * BLOCK, n // BLOCK, 1)
        ok = ok and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got + [got_p], want + [want_p]))
    if not ok:
        log.info("lightning_nvme: this torch build's fused AdamW differs from the one-pass update kernel; "
                 "updates run the optimizer's own step (exact, slower)")
    return ok

