"""``master_format``: what the update of a half-precision parameter runs on.

- ``"fp32"``: a stored fp32 master (the default), copied back to the param rounding to nearest.
- ``"bf16_sr"``: no fp32 master is stored; the update runs on ``param.float()`` and is rounded back to
  bf16 stochastically. The noise is a hash of (optimizer step, parameter index, element index):
  deterministic, independent of how the state is cut into chunks or ranks, and reproducible on resume
  (the step count is saved in the checkpoint). The rounding kernel is in ``kernels.py`` (numba, CPU); a parameter
  on an accelerator is rounded where it lives by ``_round_in_place`` (the same integer arithmetic in torch ops,
  bitwise equal, ``tests/optim/test_codec_kernels.py``), so its update never goes through the host.
"""

from __future__ import annotations

import torch

from lightning_nvme.optim.formats.codec import StateFormatError, as_numpy, kernels, on_cpu

HALF_DTYPES = (torch.float16, torch.bfloat16)
_SR_SEED = 0x5EED_0F_B16


class Fp32Masters:
    name = "fp32"
    keeps_masters = True

    def rounds(self, param_dtype: torch.dtype) -> bool:
        return False

    def write_param(self, dst: torch.Tensor, master: torch.Tensor, step: int, index: int, start: int) -> None:
        dst.copy_(master)


class StochasticBf16:
    name = "bf16_sr"
    keeps_masters = False

    def rounds(self, param_dtype: torch.dtype) -> bool:
        if param_dtype not in HALF_DTYPES:
            return False
        if param_dtype != torch.bfloat16:
            raise StateFormatError(f"master_format='bf16_sr' rounds updates to bfloat16, but a parameter is "
                                   f"{param_dtype}: use precision='bf16-true' or master_format='fp32'")
        return True

    def write_param(self, dst: torch.Tensor, master: torch.Tensor, step: int, index: int, start: int) -> None:
        if self.rounds(dst.dtype):
            stochastic_round_bf16(master, sr_key(step, index), start, out=dst)
        else:
            dst.copy_(master)


def sr_key(step: int, index: int) -> int:
    """A well-mixed 32-bit key per (optimizer step, parameter index) (splitmix64 finalizer)."""
    z = (_SR_SEED + step * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def stochastic_round_bf16(x: torch.Tensor, key: int, start: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 -> bf16, rounding away from zero with probability (dropped bits) / 2**16, with noise that
    is a pure function of the element index (``kernels.stochastic_round_bf16``), so any cut of a
    tensor into pieces rounds identically. Into ``out`` (bf16, ``x``'s shape) when given.

    ``x`` on an accelerator (and ``out``, if given, on the same one) is rounded there (``round_on_device``):
    copying it to the host for the numba kernel would stop the host until the device has run everything
    queued, inside the update (with ``overlap="backward"``, inside backward's hooks)."""
    if x.device.type != "cpu" and (out is None or out.device == x.device):
        return round_on_device(x, key, start, out)
    flat = on_cpu(x)
    direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
    dst = out.view(-1) if out is not None and direct else torch.empty(flat.numel(), dtype=torch.bfloat16)
    kernels().stochastic_round_bf16(as_numpy(flat), as_numpy(dst), key, start)
    if out is None:
        return dst.view(x.shape).to(x.device)
    if not direct:
        out.copy_(dst.view(out.shape))
    return out


_GOLDEN = 0x9E3779B1
_LOW32 = 0xFFFFFFFF
_LOW16 = 0xFFFF
_CANONICAL_NAN_BF16 = 0x7FC0
DEVICE_SLICE = 1 << 22  # elements rounded at once on a device: bounds its int64 temporaries (4 x 32 MiB)


def round_on_device(x: torch.Tensor, key: int, start: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels._stochastic_round_bf16``'s arithmetic in torch integer ops, run where ``x`` lives (any device;
    bitwise equal to the kernel, asserted on CPU), ``DEVICE_SLICE`` elements at a time. Into ``out`` when given."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic rounding to bf16 takes fp32, got {x.dtype}")
    src = x.detach().reshape(-1)
    direct = out is not None and out.is_contiguous()
    dst = out.view(-1) if out is not None and direct else torch.empty(src.numel(), dtype=torch.bfloat16, device=x.device)
    bits16 = dst.view(torch.int16)
    for lo in range(0, src.numel(), DEVICE_SLICE):
        part = src[lo:lo + DEVICE_SLICE]
        _round_slice(part, bits16[lo:lo + part.numel()], key, start + lo)
    if out is None:
        return dst.view(x.shape)
    if not direct:
        out.copy_(dst.view(out.shape))
    return out


def _round_slice(x: torch.Tensor, out16: torch.Tensor, key: int, start: int) -> None:
    """One slice: noise of element ``start + i`` = top 16 bits of ``((start + i) * 0x9E3779B1 + key) mod 2**32``,
    added to ``x``'s bits, the top 16 bits kept. The product mod 2**32 is formed from 16-bit halves of the index
    so that no int64 product overflows (``idx * golden`` would past 2**32 elements)."""
    idx = torch.arange(start, start + x.numel(), dtype=torch.int64, device=x.device)
    hi = ((idx >> 16) & _LOW16).mul_(_GOLDEN).bitwise_and_(_LOW16).bitwise_left_shift_(16)
    noise = idx.bitwise_and_(_LOW16).mul_(_GOLDEN).add_(hi).add_(key).bitwise_and_(_LOW32).bitwise_right_shift_(16)
    del hi
    r = x.view(torch.int32).to(torch.int64).bitwise_and_(_LOW32).add_(noise).bitwise_and_(_LOW32)
    r = r.bitwise_right_shift_(16)
    r = r.sub_(r.bitwise_right_shift(15).bitwise_left_shift_(16))  # the top half as a signed int16
    out16.copy_(torch.where(x != x, torch.full_like(r, _CANONICAL_NAN_BF16), r))
