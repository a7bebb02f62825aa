"""``master_format``: what the update of a half-precision parameter runs on.

- ``"fp32"``: a stored fp32 master (the default), copied back to the param rounding to nearest.
- ``"bf16_sr"``: no fp32 master is stored; the update runs on ``param.float()`` and is rounded back to
  bf16 stochastically. The noise is a hash of (optimizer step, parameter index, element index):
  deterministic, independent of how the state is cut into chunks or ranks, and reproducible on resume
  (the step count is saved in the checkpoint). The rounding kernel is in ``kernels.py``.
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
    tensor into pieces rounds identically. Into ``out`` (bf16, ``x``'s shape) when given."""
    flat = on_cpu(x)
    direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
    dst = out.view(-1) if out is not None and direct else torch.empty(flat.numel(), dtype=torch.bfloat16)
    kernels().stochastic_round_bf16(as_numpy(flat), as_numpy(dst), key, start)
    if out is None:
        return dst.view(x.shape).to(x.device)
    if not direct:
        out.copy_(dst.view(out.shape))
    return out
