"""Single-pass CPU kernels of the compressed state formats (numba): blockwise int8 codes and bf16
stochastic rounding. The formats' shared element maths lives here, once; ``adamw_kernel.py`` is the one-pass
AdamW update only (driven by ``fused_update.py``) and calls these block functions for its codes and rounding.

Why numba: written with torch ops, each codec is 6-10 passes over the state with a fresh temporary per
pass; on 2 cores that ran at 0.1-0.2x the disk's speed (docs/state_format.md), i.e. compressing the state
cost more time than the bytes it saved. Each kernel here reads its input once and writes its output once,
in one thread (``nogil``: the store's I/O threads keep running), compiled once per machine (``cache=True``).

The arithmetic is the formats' definition (``int8.py`` and ``masters.py`` document it) and is plain IEEE fp32 (no
fast-math): the offloaded optimizer and the in-memory reference ``RoundTripOptimizer`` both call these
kernels, so they agree bit for bit. Rounding to the nearest integer uses ``(t + 1.5 * 2**23) - 1.5 * 2**23``
(exact round-half-even for ``|t| < 2**22``; codes are at most 255). Kernels take 1-D contiguous arrays
and return the index of the first block they refuse (non-finite, or negative for the unsigned code),
or -1; the caller turns that into an error message.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import njit, prange

from lightning_nvme.constants import INT8_BLOCK

BLOCK = INT8_BLOCK
F32 = np.float32
SIGNED_Q = F32(127.0)
UNSIGNED_Q = F32(255.0 ** 4)  # 4228250625 rounds to 4228250624 in fp32
INV_SIGNED_Q = F32(1.0 / 127.0)
INV_UNSIGNED_Q = F32(1.0 / 255.0 ** 4)
# Blocks whose absmax is at most this use division (the per-block factor q / absmax would overflow).
FACTOR_SAFE = F32(255.0 ** 4 / float(np.finfo(np.float32).max) * 4)
_ROUND = F32(12582912.0)  # 1.5 * 2**23
_INT_MIN = np.int32(-(1 << 31))
_INF_BITS = np.int32(0x7F800000)
_CANONICAL_NAN_BF16 = np.int16(0x7FC0)
PARALLEL_MIN = 1 << 18  # elements below which a kernel runs in the calling thread only

_jit = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)


@_jit
def _encode_int8(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, unsigned: bool, b0: int, b1: int) -> int:
    """Blocks ``b0:b1`` of ``x`` (fp32) -> ``codes`` (int8 linear, or uint8 4th-root for ``unsigned``) and
    their absmax ``scales``; the last block may be partial. Returns the first refused block, or -1.

    One function with unsigned indices: numba then emits no negative-index wraparound, and the inner
    loops vectorize."""
    xi = x.view(np.int32)
    total = np.uint64(x.shape[0])
    q = UNSIGNED_Q if unsigned else SIGNED_Q
    for b in range(b0, b1):
        base = np.uint64(b) * np.uint64(BLOCK)
        n = min(np.uint64(BLOCK), total - base)
        # Bits of max |x|. For non-negative floats integer order is float order; a negative float's bits
        # are a negative int32 that grows with its magnitude (-0.0 is INT32_MIN). Two max-reductions keep
        # the loop in int32 lanes (numba widens `&`/`|` of int32 to int64: half the lanes, 1.7x slower).
        hi = _INT_MIN
        neg = _INT_MIN
        for i in range(n):
            v = xi[base + np.uint64(i)]
            hi = max(hi, v)
            neg = max(neg, v if v < 0 else _INT_MIN)
        neg_bits = np.int64(neg) - np.int64(_INT_MIN)  # |most negative| (0: none, or only -0.0)
        m = max(np.int64(max(hi, np.int32(0))), neg_bits)
        if m >= _INF_BITS or (unsigned and neg_bits > 0):
            return b
        scales.view(np.int32)[b] = m
        absmax = scales[b]
        if absmax > FACTOR_SAFE:  # one factor per block (branches stay outside the loops: they vectorize)
            f = (F32(1.0) / absmax) * q
            if unsigned:
                for i in range(n):
                    j = base + np.uint64(i)
                    codes[j] = np.uint8(F32(np.sqrt(F32(np.sqrt(x[j] * f)))) + F32(0.5))
            else:
                for i in range(n):
                    j = base + np.uint64(i)
                    codes[j] = np.int8((x[j] * f + _ROUND) - _ROUND)
        elif absmax > 0:  # denormal range: divide first so that nothing overflows
            for i in range(n):
                j = base + np.uint64(i)
                t = (x[j] / absmax) * q
                if unsigned:
                    codes[j] = np.uint8(F32(np.sqrt(F32(np.sqrt(t)))) + F32(0.5))
                else:
                    codes[j] = np.int8((t + _ROUND) - _ROUND)
        else:
            for i in range(n):
                codes[base + np.uint64(i)] = 0
    return -1


@_jit
def _decode_int8(codes: np.ndarray, scales: np.ndarray, out: np.ndarray, unsigned: bool, b0: int, b1: int) -> None:
    """Blocks ``b0:b1``: ``codes`` and ``scales`` -> fp32 ``out``: absmax * q / 127, or absmax * (q / 255) ** 4."""
    total = np.uint64(codes.shape[0])
    q = UNSIGNED_Q if unsigned else SIGNED_Q
    inv_q = INV_UNSIGNED_Q if unsigned else INV_SIGNED_Q
    for b in range(b0, b1):
        base = np.uint64(b) * np.uint64(BLOCK)
        n = min(np.uint64(BLOCK), total - base)
        scale = scales[b]
        mult = scale * inv_q
        if F32(0.0) < scale <= FACTOR_SAFE:  # denormal range: multiply by the scale first, or absmax / q is 0
            for i in range(n):
                j = base + np.uint64(i)
                v = F32(codes[j])
                if unsigned:
                    v = v * v
                    v = v * v
                out[j] = (v * scale) / q
        elif unsigned:
            for i in range(n):
                j = base + np.uint64(i)
                v = F32(codes[j])
                v = v * v
                out[j] = (v * v) * mult
        else:
            for i in range(n):
                j = base + np.uint64(i)
                out[j] = F32(codes[j]) * mult


@_jit
def _stochastic_round_bf16(x: np.ndarray, out: np.ndarray, key: np.uint32, start: np.int64, b0: int, b1: int) -> None:
    """fp32 ``x`` -> bf16 bits ``out`` (int16), rounding away from zero with probability
    (dropped bits) / 2**16. The 16 noise bits of element ``start + i`` are the top half of
    ``(start + i) * 0x9E3779B1 + key`` mod 2**32: a pure function of the element index, so any cut of a
    tensor into pieces rounds identically. A NaN stays a (canonical) NaN."""
    xi = x.view(np.uint32)
    golden = np.uint64(0x9E3779B1)
    low32 = np.uint64(0xFFFFFFFF)
    k = np.uint64(key)
    base = np.uint64(start)
    i0 = np.uint64(b0) * np.uint64(BLOCK)
    for j in range(np.uint64(min(b1 * BLOCK, x.shape[0])) - i0):  # unsigned indices: see _encode_int8
        i = i0 + j  # uint64 arithmetic wraps mod 2**64, so "& low32" is exact mod 2**32
        noise = (((base + i) * golden + k) & low32) >> np.uint64(16)
        r = ((np.uint64(xi[i]) + noise) & low32) >> np.uint64(16)
        out[i] = _CANONICAL_NAN_BF16 if x[i] != x[i] else np.int16(np.int32(r) - (np.int32(r) >> 15 << 16))


# ---- entry points: the blocks split over the cores ---------------------------------------------------------
@njit(nogil=True, cache=True, parallel=True)
def _encode_int8_parts(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, unsigned: bool, parts: int) -> int:
    blocks = (x.shape[0] + BLOCK - 1) // BLOCK
    refused = np.full(parts, -1, np.int64)
    for p in prange(parts):
        refused[p] = _encode_int8(x, codes, scales, unsigned, blocks * p // parts, blocks * (p + 1) // parts)
    for p in range(parts):
        if refused[p] >= 0:
            return refused[p]
    return -1


@njit(nogil=True, cache=True, parallel=True)
def _decode_int8_parts(codes: np.ndarray, scales: np.ndarray, out: np.ndarray, unsigned: bool, parts: int) -> None:
    blocks = (codes.shape[0] + BLOCK - 1) // BLOCK
    for p in prange(parts):
        _decode_int8(codes, scales, out, unsigned, blocks * p // parts, blocks * (p + 1) // parts)


@njit(nogil=True, cache=True, parallel=True)
def _stochastic_round_bf16_parts(x: np.ndarray, out: np.ndarray, key: np.uint32, start: np.int64, parts: int) -> None:
    blocks = (x.shape[0] + BLOCK - 1) // BLOCK
    for p in prange(parts):
        _stochastic_round_bf16(x, out, key, start, blocks * p // parts, blocks * (p + 1) // parts)


def _parts(n: int) -> int:
    """Threads for ``n`` elements: one below ``PARALLEL_MIN`` (starting threads costs more than it
    saves) and off the main thread (numba's default threading layer must not be entered from two
    threads at once), else torch's intra-op thread count."""
    if n < PARALLEL_MIN or threading.current_thread() is not threading.main_thread():
        return 1
    return max(1, min(torch.get_num_threads(), numba.get_num_threads()))


def encode_int8(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, unsigned: bool) -> int:
    """``x`` (fp32) -> ``codes`` and per-block ``scales``; the first refused block, or -1."""
    parts = _parts(x.shape[0])
    if parts == 1:
        return int(_encode_int8(x, codes, scales, unsigned, 0, (x.shape[0] + BLOCK - 1) // BLOCK))
    return int(_encode_int8_parts(x, codes, scales, unsigned, parts))


def decode_int8(codes: np.ndarray, scales: np.ndarray, out: np.ndarray, unsigned: bool) -> None:
    parts = _parts(codes.shape[0])
    if parts == 1:
        _decode_int8(codes, scales, out, unsigned, 0, (codes.shape[0] + BLOCK - 1) // BLOCK)
    else:
        _decode_int8_parts(codes, scales, out, unsigned, parts)


def stochastic_round_bf16(x: np.ndarray, out: np.ndarray, key: int, start: int) -> None:
    parts = _parts(x.shape[0])
    k, s = np.uint32(key), np.int64(start)
    if parts == 1:
        _stochastic_round_bf16(x, out, k, s, 0, (x.shape[0] + BLOCK - 1) // BLOCK)
    else:
        _stochastic_round_bf16_parts(x, out, k, s, parts)
