"""A bf16 ``F.linear`` whose input gradient uses torch's fast bf16 CPU kernel, for CPUs without AVX512-BF16.

Why: on such a CPU (this VM: AVX2 only, ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False) torch
2.13's bf16 GEMM falls back to ATen's own kernels, and the one the linear backward uses for the input
gradient (``grad @ weight``, both row-major) is ~50x slower than the forward's (``x @ weight.T``): one
4096x11008 projection's input gradient at 16 tokens took 28 s against 0.6 s for its forward (2026-12-02,
load ~15), which would make a 7 B step take hours of compute that has nothing to do with offloading.
Computing it as ``F.linear(grad, weight.t().contiguous())`` gives the same product through the forward's
kernel (bf16 operands, fp32 accumulation, bf16 result: same arithmetic, other summation order) after a
transposed copy of the weight. The weight gradient (an outer product over the few tokens) is computed on
fp32 copies and rounded to bf16 once, as the bf16 kernel accumulates in fp32: 0.6 s instead of 1.7 s for that
projection at 8 tokens, equal bits in the check that was run. The forward is torch's own. Used by the training
runs and the in-memory compute reference of ``hf_7b.py`` alike, and only where the CPU lacks bf16 GEMM.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_original_linear = F.linear


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _original_linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        gx = _original_linear(grad, weight.t().contiguous()) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:  # fp32 operands, one rounding to bf16 at the end: what the bf16 kernel computes
            gw = (grad.reshape(-1, grad.shape[-1]).t().float() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and torch.is_grad_enabled():
        return _Linear.apply(x, weight, bias)
    return _original_linear(x, weight, bias)


def needed() -> bool:
    """True on a CPU whose bf16 GEMM is ATen's fallback (no oneDNN bf16 support)."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def install() -> bool:
    """Route ``torch.nn.functional.linear`` (what ``nn.Linear`` calls) through ``_linear`` where ``needed()``."""
    if needed():
        F.linear = _linear  # type: ignore[assignment]
        return True
    return False
