"""CPU throughput of the state-format codecs against the libraries that offer the same primitives.

For 16 M fp32 elements (64 MiB) on ``--threads`` threads, median of ``--reps`` (a plain ``clone`` of
the same tensor is timed in every round as the memory-bandwidth yardstick, since this machine's speed
drifts with its load):
  ours     lightning_nvme.optim.state_format: bf16 cast, int8 linear (signed) / 4th-root (unsigned)
           codes with one absmax per 256, hash-noise bf16 stochastic rounding
  torchao  torchao.optim.quant_utils (8-bit dynamic-map quantize/dequantize, _fp32_to_bf16_sr), eager
  bnb      bitsandbytes.functional.quantize_blockwise / dequantize_blockwise (CPU backend)
Libraries that are not installed are skipped (``pip install torchao bitsandbytes`` to include them).

    python benchmarks/state_format_codecs.py

Last line: one JSON object (Melem/s per codec, and each as a fraction of clone's speed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cases(n: int) -> dict[str, Callable[[], object]]:
    import torch

    from lightning_nvme.optim.state_format import StateFormat, stochastic_round_bf16

    x = torch.randn(n) * 1e-3
    v = x.square()
    out: dict[str, Callable[[], object]] = {"clone (yardstick)": x.clone}
    bf16, int8 = StateFormat("bf16"), StateFormat("int8")
    xb = torch.empty(n, dtype=torch.bfloat16)
    out["ours bf16 encode"] = lambda: bf16.encode("exp_avg", x, [xb])
    out["ours bf16 decode"] = lambda: bf16.decode("exp_avg", torch.float32, [xb])
    for key, val in (("exp_avg", x), ("exp_avg_sq", v)):
        raws = [torch.empty(c.count(n), dtype=c.dtype) for c in int8.components(key, torch.float32)]
        out[f"ours int8 {key} encode"] = lambda key=key, val=val, raws=raws: int8.encode(key, val, raws)
        out[f"ours int8 {key} decode"] = lambda key=key, raws=raws: int8.decode(key, torch.float32, raws)
    out["ours bf16 stochastic round"] = lambda: stochastic_round_bf16(x, 12345)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.optim.quant_utils import (
                _fp32_to_bf16_sr,
                create_dynamic_map,
                dequant_with_qmap,
                quantize_8bit_with_qmap,
                scale_tensor,
            )
        qmap = torch.tensor(create_dynamic_map(True))

        def ao_encode():
            scaled, scale = scale_tensor(x, 256)
            return quantize_8bit_with_qmap(scaled, qmap), scale

        codes, scale = ao_encode()
        out["torchao 8-bit encode"] = ao_encode
        out["torchao 8-bit decode"] = lambda: dequant_with_qmap(codes, qmap, scale)
        out["torchao bf16 stochastic round"] = lambda: _fp32_to_bf16_sr(x)
    except ImportError:
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes.functional as bnbf
        code = bnbf.create_dynamic_map(signed=True)
        q, state = bnbf.quantize_blockwise(x, code=code, blocksize=256)
        out["bnb 8-bit encode"] = lambda: bnbf.quantize_blockwise(x, code=code, blocksize=256)
        out["bnb 8-bit decode"] = lambda: bnbf.dequantize_blockwise(q, state)
    except Exception:  # noqa: BLE001  (not installed, or no CPU backend)
        pass
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elems-m", type=float, default=16.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    n = int(args.elems_m * (1 << 20))
    fns = cases(n)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.reps):
        for name, fn in fns.items():  # every codec once per round, so drift hits them alike
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    clone = statistics.median(times["clone (yardstick)"])
    result = {}
    for name, ts in times.items():
        t = statistics.median(ts)
        result[name] = {"Melem_per_s": n / t / 1e6, "vs_clone": clone / t}
        print(f"{name:32s} {n / t / 1e6:9.1f} Melem/s  {clone / t:6.2f}x clone's speed", file=sys.stderr)
    print(json.dumps({"elems": n, "threads": args.threads, "codecs": result}))


if __name__ == "__main__":
    main()
