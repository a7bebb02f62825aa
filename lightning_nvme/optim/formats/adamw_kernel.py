"""One pass over a chunk's AdamW update for ``state_format="int8"`` with ``master_format="bf16_sr"``:
decode the moments, run AdamW's arithmetic, encode the moments, round the param back to bf16, block by block.

Why: run as torch ops plus the format's kernels, one update is eight passes over the piece (decode two
moments, widen param and gradient to fp32, AdamW, encode two moments, round) with fp32 temporaries; at 7 B on
two cores that was 52 s per step, longer than the step's I/O (docs/performance.md). Here each block of
``BLOCK`` elements is read once, updated in registers and L1, and written once.

Exactness: the arithmetic is, op for op, torch's fused CPU AdamW (``_fused_adamw_``,
``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``, fp32 lanes): ``p *= 1 - lr*wd``; ``m = fma(w, g - m, m)``
(its ``lerp`` with weight ``w = 1 - beta1 < 0.5``; else ``fma(w - 1, g - m, g)``);
``v = fma(c2*g, g, v*beta2)`` (the contraction torch's build makes of ``v*beta2 + c2*g*g``);
``p += (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)``, with the constants rounded from double as there.
That is what torch computes in its vector lanes; its last ``numel % 16`` elements of a tensor go through
code its compiler shaped differently, so the caller leaves a piece's last partial block to torch itself.
Whether this build of torch computes the same is checked once per process on random data before the
kernel is used (``optim/fused_update.py``); the codes and the rounding are ``kernels.py``'s own functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic

from lightning_nvme.optim.formats.kernels import BLOCK, _decode_int8, _encode_int8, _stochastic_round_bf16

F32 = np.float32


@intrinsic
def _fma_intrinsic(typingctx, a, b, c):
    """``a * b + c`` with one rounding (LLVM's ``llvm.fma.f32``): torch's ``vec::fmadd``."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


_fma = cast(Callable[[Any, Any, Any], Any], _fma_intrinsic)  # the same object, typed for mypy


@njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)
def _blocks(p16: np.ndarray, g16: np.ndarray, m_codes: np.ndarray, m_scales: np.ndarray, v_codes: np.ndarray,
            v_scales: np.ndarray, initialized: bool, consts: np.ndarray, key: np.uint32, start: np.int64,
            b0: int, b1: int) -> int:
    """Blocks ``b0:b1`` (all full) of one piece, in place. ``p16``/``g16``: bf16 bits (int16). ``consts``:
    fp32 [wd factor, lerp weight, lerp-weight-is-small (1/0), beta2, 1 - beta2, sqrt(bc2), eps, -step_size].
    Returns ``2 * block + key`` (key 0: ``exp_avg``, 1: ``exp_avg_sq``) for the first block whose new moment
    the int8 code refuses (non-finite: the block's old state is left as it was), or -1."""
    wdf, coeff, small, beta2, c2, bc2s, eps, nss = (consts[0], consts[1], consts[2], consts[3], consts[4],
                                                     consts[5], consts[6], consts[7])
    p_bits = np.empty(BLOCK, np.int32)
    g_bits = np.empty(BLOCK, np.int32)
    m = np.zeros(BLOCK, F32)
    v = np.zeros(BLOCK, F32)
    p = p_bits.view(F32)
    g = g_bits.view(F32)
    n = np.uint64(BLOCK)
    for b in range(b0, b1):
        lo = np.uint64(b) * n  # unsigned indices throughout (kernels._encode_int8 says why)
        hi = lo + n
        if initialized:
            _decode_int8(m_codes[lo:hi], m_scales[b:b + 1], m, False, 0, 1)
            _decode_int8(v_codes[lo:hi], v_scales[b:b + 1], v, True, 0, 1)
        else:  # torch's first step: zero moments
            m[:] = F32(0.0)
            v[:] = F32(0.0)
        for i in range(n):
            p_bits[i] = np.int32(p16[lo + i]) << 16
            g_bits[i] = np.int32(g16[lo + i]) << 16
        if small != F32(0.0):
            for i in range(n):
                m[i] = _fma(coeff, g[i] - m[i], m[i])
        else:
            for i in range(n):
                m[i] = _fma(coeff, g[i] - m[i], g[i])
        for i in range(n):
            gi = g[i]
            vi = _fma(c2 * gi, gi, v[i] * beta2)
            v[i] = vi
            p[i] = p[i] * wdf + (nss * m[i]) / (F32(np.sqrt(vi)) / bc2s + eps)
        if _encode_int8(m, m_codes[lo:hi], m_scales[b:b + 1], False, 0, 1) >= 0:
            return 2 * b
        if _encode_int8(v, v_codes[lo:hi], v_scales[b:b + 1], True, 0, 1) >= 0:
            return 2 * b + 1
        _stochastic_round_bf16(p, p16[lo:hi], key, start + lo, 0, 1)
    return -1


@njit(nogil=True, cache=True, parallel=True)
def _blocks_parts(p16: np.ndarray, g16: np.ndarray, m_codes: np.ndarray, m_scales: np.ndarray,
                  v_codes: np.ndarray, v_scales: np.ndarray, initialized: bool, consts: np.ndarray,
                  key: np.uint32, start: np.int64, blocks: int, parts: int) -> int:
    refused = np.full(parts, -1, np.int64)
    for q in prange(parts):
        refused[q] = _blocks(p16, g16, m_codes, m_scales, v_codes, v_scales, initialized, consts, key, start,
                             blocks * q // parts, blocks * (q + 1) // parts)
    for q in range(parts):
        if refused[q] >= 0:
            return refused[q]
    return -1


def update_blocks(p16: np.ndarray, g16: np.ndarray, m_codes: np.ndarray, m_scales: np.ndarray,
                  v_codes: np.ndarray, v_scales: np.ndarray, initialized: bool, consts: np.ndarray, key: int,
                  start: int, blocks: int, parts: int) -> int:
    """The first ``blocks`` full blocks of a piece, split over ``parts`` threads; a refused block (see ``_blocks``) or -1."""
    k, s = np.uint32(key), np.int64(start)
    if parts == 1:
        return int(_blocks(p16, g16, m_codes, m_scales, v_codes, v_scales, initialized, consts, k, s, 0, blocks))
    return int(_blocks_parts(p16, g16, m_codes, m_scales, v_codes, v_scales, initialized, consts, k, s,
                             blocks, parts))
