"""``state_format="int8"``: blocks of ``BLOCK`` elements aligned to the parameter's element 0, one fp32
absmax each (component ``<key>.absmax``).

Signed keys (first moments): linear, ``q = round(127 * x / absmax)`` (int8). Keys known to be non-negative
(``NONNEGATIVE_KEYS``: second moments, the denominator of Adam's update):
``q = round(255 * (x / absmax) ** (1/4))`` (uint8), a nonlinear code that keeps small values alive down to
~1e-11 of the block's absmax (a linear code would zero everything below 1/510 and blow up
``m / sqrt(v)``), in the spirit of bitsandbytes' dynamic map but encoded with arithmetic instead of a table
search (docs/state_format.md). A block holding a NaN/inf would spread it to all 256 values, so it is
refused (``StateFormatError``) instead. The arithmetic is the numba kernels' (``kernels.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_nvme.constants import INT8_BLOCK as BLOCK
from lightning_nvme.optim.formats.codec import Component, StateFormatError, as_numpy, kernels, on_cpu

SCALE_SUFFIX = ".absmax"
# State keys of torch optimizers that are >= 0 by construction: the unsigned code is used for them.
NONNEGATIVE_KEYS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf", "acc_delta",
                              "max_exp_avg_sqs"})


class Int8:
    name = "int8"
    lossless = False
    align = BLOCK

    def record(self) -> dict[str, Any]:
        return {"block": BLOCK}

    def components(self, key: str) -> tuple[Component, ...]:
        code = torch.uint8 if key in NONNEGATIVE_KEYS else torch.int8
        return (Component(key, code), Component(key + SCALE_SUFFIX, torch.float32, BLOCK))

    def encode(self, key: str, values: torch.Tensor, raws: list[torch.Tensor], where: str) -> None:
        unsigned = key in NONNEGATIVE_KEYS
        codes, scales = raws
        x = on_cpu(values)
        c, s = (codes, scales) if codes.device.type == "cpu" else (torch.empty_like(codes, device="cpu"),
                                                                    torch.empty_like(scales, device="cpu"))
        if kernels().encode_int8(as_numpy(x), as_numpy(c), as_numpy(s), unsigned) >= 0:
            _report(x, f"{key}{where}", 0, unsigned)
        if c is not codes:
            codes.copy_(c)
            scales.copy_(s)

    def decode(self, key: str, raws: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        return _decode(raws[0], raws[1], key in NONNEGATIVE_KEYS, out)


def _decode(codes: torch.Tensor, scales: torch.Tensor, unsigned: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    if codes.device.type != "cpu":
        return _decode(codes.cpu(), scales.cpu(), unsigned).to(codes.device)
    if out is None:
        out = torch.empty(codes.numel(), dtype=torch.float32)
    kernels().decode_int8(as_numpy(codes), as_numpy(scales), as_numpy(out), unsigned)
    return out


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
