"""The numba codec kernels against a numpy statement of the format's arithmetic, and their multi-threaded
split against the single-threaded run (bit for bit)."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
import torch
from fake_cuda import FAKE_DEVICE, fake_device, on_host

from lightning_nvme.optim.formats import kernels as k
from lightning_nvme.optim.formats import masters

F32 = np.float32


def spec_encode(x: np.ndarray, unsigned: bool) -> tuple[np.ndarray, np.ndarray]:
    """The int8 codes as docs/state_format.md states them, in plain numpy fp32 (correctly rounded sqrt)."""
    q = k.UNSIGNED_Q if unsigned else k.SIGNED_Q
    codes = np.empty(x.shape, np.uint8 if unsigned else np.int8)
    scales = np.empty(-(-len(x) // k.BLOCK), F32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for b in range(len(scales)):
            xb = x[b * k.BLOCK:(b + 1) * k.BLOCK]
            absmax = F32(np.abs(xb).max())
            scales[b] = absmax
            if absmax > k.FACTOR_SAFE:
                t = xb * ((F32(1) / absmax) * q)
            elif absmax > 0:
                t = (xb / absmax) * q
            else:
                t = np.zeros_like(xb)
            t = (np.sqrt(np.sqrt(t)) + F32(0.5)) if unsigned else np.rint(t)
            codes[b * k.BLOCK:(b + 1) * k.BLOCK] = t.astype(codes.dtype)
    return codes, scales


def spec_decode(codes: np.ndarray, scales: np.ndarray, unsigned: bool) -> np.ndarray:
    q, inv = (k.UNSIGNED_Q, k.INV_UNSIGNED_Q) if unsigned else (k.SIGNED_Q, k.INV_SIGNED_Q)
    out = codes.astype(F32)
    if unsigned:
        out = (out * out) * (out * out)
    for b, s in enumerate(scales):
        sl = slice(b * k.BLOCK, (b + 1) * k.BLOCK)
        out[sl] = (out[sl] * s) / q if F32(0) < s <= k.FACTOR_SAFE else out[sl] * (s * inv)
    return out


def spec_stochastic_round(x: np.ndarray, key: int, start: int) -> np.ndarray:
    idx = np.arange(start, start + len(x), dtype=np.uint64)
    noise = ((idx * np.uint64(0x9E3779B1) + np.uint64(key)) & np.uint64(0xFFFFFFFF)) >> np.uint64(16)
    bits = ((x.view(np.uint32).astype(np.uint64) + noise) & np.uint64(0xFFFFFFFF)) >> np.uint64(16)
    out = bits.astype(np.uint16).view(np.int16)
    out[np.isnan(x)] = 0x7FC0
    return out


def sample(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-40, 30, n // 97 + 1).repeat(97)[:n]).astype(F32)
    x[::1013] = 0.0
    x[5::2003] = -0.0
    x[:k.BLOCK] = 0.0  # an all-zero block
    x[k.BLOCK:2 * k.BLOCK] = np.float32(1e-44)  # a denormal block
    x[2 * k.BLOCK + 7] = 3e38  # a block with one huge value
    return x


@pytest.mark.parametrize("n", [1, 255, 256, 257, 3 * 256 + 5, 70_001])
@pytest.mark.parametrize("unsigned", [False, True])
def test_int8_kernels_follow_the_spec(n: int, unsigned: bool) -> None:
    x = sample(max(n, 3 * k.BLOCK), n)[:n]
    if unsigned:
        x = np.abs(x)
    codes = np.empty(n, np.uint8 if unsigned else np.int8)
    scales = np.empty(-(-n // k.BLOCK), F32)
    assert k.encode_int8(x, codes, scales, unsigned) == -1
    want_codes, want_scales = spec_encode(x, unsigned)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales.view(np.int32), want_scales.view(np.int32))
    out = np.empty(n, F32)
    k.decode_int8(codes, scales, out, unsigned)
    np.testing.assert_array_equal(out.view(np.int32), spec_decode(codes, scales, unsigned).view(np.int32))


@pytest.mark.parametrize("start", [0, 3, 2 ** 31 - 5, 2 ** 32 + 7])
def test_stochastic_rounding_follows_the_spec(start: int) -> None:
    x = sample(5_000, start % 97)
    x[[10, 20, 30]] = [np.nan, np.inf, -np.inf]
    out = np.empty(len(x), np.int16)
    k.stochastic_round_bf16(x, out, 0xDEADBEEF, start)
    np.testing.assert_array_equal(out, spec_stochastic_round(x, 0xDEADBEEF, start))


@pytest.mark.parametrize("start", [0, 3, 2 ** 31 - 5, 2 ** 32 - 1500, 2 ** 40 + 7])
def test_rounding_on_the_device_is_bitwise_the_kernel(monkeypatch: pytest.MonkeyPatch, start: int) -> None:
    """``masters.round_on_device`` (torch integer ops, run where a parameter lives) against the numba kernel, bit
    for bit: NaN, infinities, zeros, denormals, huge values, element indexes wrapping past 2**32, and slices
    (``DEVICE_SLICE`` made small) that cut the tensor anywhere. Then through ``fake_cuda.FakeDevice``: an fp32
    tensor on a device is rounded there, with no synchronous transfer to the host."""
    monkeypatch.setattr(masters, "DEVICE_SLICE", 1000)
    x = sample(5_000, start % 97)
    x[[10, 20, 30, 40]] = [np.nan, np.inf, -np.inf, -np.nan]
    want = np.empty(len(x), np.int16)
    k.stochastic_round_bf16(x, want, 0xDEADBEEF, start)
    got = masters.round_on_device(torch.from_numpy(x), 0xDEADBEEF, start)
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.view(torch.int16).numpy(), want)
    out = torch.empty(len(x), 2, dtype=torch.bfloat16)[:, 0]  # a strided destination
    masters.round_on_device(torch.from_numpy(x), 0xDEADBEEF, start, out=out)
    np.testing.assert_array_equal(out.contiguous().view(torch.int16).numpy(), want)
    with fake_device() as device:
        on_device = torch.from_numpy(x).to(FAKE_DEVICE)
        dst = torch.empty(len(x), dtype=torch.bfloat16, device=FAKE_DEVICE)
        masters.stochastic_round_bf16(on_device, 0xDEADBEEF, start, out=dst)
        assert dst.device == FAKE_DEVICE and device.syncs == []
    np.testing.assert_array_equal(on_host(dst).view(torch.int16).numpy(), want)


def test_the_threaded_split_is_bitwise_the_single_thread_run(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.get_num_threads() < 2 or numba.get_num_threads() < 2:
        pytest.skip("one thread: nothing to split")
    n = k.PARALLEL_MIN * 2 + 3 * k.BLOCK + 11
    x = sample(n, 1)
    v = np.abs(x)
    results = {}
    for mode in ("split", "serial"):
        if mode == "serial":
            monkeypatch.setattr(k, "PARALLEL_MIN", n + 1)
        assert (k._parts(n) == 1) == (mode == "serial")
        c, u, s1, s2 = np.empty(n, np.int8), np.empty(n, np.uint8), np.empty(n // 256 + 1, F32), np.empty(n // 256 + 1, F32)
        k.encode_int8(x, c, s1, False)
        k.encode_int8(v, u, s2, True)
        d1, d2, sr = np.empty(n, F32), np.empty(n, F32), np.empty(n, np.int16)
        k.decode_int8(c, s1, d1, False)
        k.decode_int8(u, s2, d2, True)
        k.stochastic_round_bf16(x, sr, 12345, 2 ** 31 - 1000)
        results[mode] = [a.view(np.uint8).copy() for a in (c, u, s1, s2, d1, d2, sr)]
    for a, b in zip(results["split"], results["serial"]):
        np.testing.assert_array_equal(a, b)


def test_refusals_are_found_in_any_part_and_off_the_main_thread() -> None:
    n = k.PARALLEL_MIN * 2
    for where in (7, n - 3):
        x = np.ones(n, F32)
        x[where] = np.nan
        assert k.encode_int8(x, np.empty(n, np.int8), np.empty(n // 256, F32), False) == where // k.BLOCK
        x[where] = -1.0
        assert k.encode_int8(x, np.empty(n, np.uint8), np.empty(n // 256, F32), True) == where // k.BLOCK
        x[where] = -0.0  # negative zero is not negative
        assert k.encode_int8(x, np.empty(n, np.uint8), np.empty(n // 256, F32), True) == -1
    seen = []
    thread = threading.Thread(target=lambda: seen.append(k._parts(n)))
    thread.start()
    thread.join()
    assert seen == [1]
