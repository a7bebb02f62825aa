"""CPU throughput of the state-format codecs against the disk, and against the libraries that offer
the same primitives.

For 16 M fp32 elements (64 MiB) on ``--threads`` threads, median of ``--reps`` rounds. Every round times
each codec once, a plain ``clone`` of the same tensor (the memory-bandwidth yardstick) and the raw disk
(``--disk-mib`` written through fdatasync, then read cold, O_DIRECT, on a preallocated file in ``--dir``),
so drift in this machine's load hits them alike. Each codec's throughput is reported in GB/s of the fp32
state it encodes/decodes and of the bytes it sends to/reads from the disk, and as the median per-round
ratio of the latter to the disk's write (encoders) or read (decoders) speed: > 1 means the codec keeps
up with the disk.
  ours     lightning_nvme.optim.formats.state_format: bf16 cast (torch copy), int8 linear (signed) / 4th-root
           (unsigned) codes with one absmax per 256 and hash-noise bf16 stochastic rounding (single-pass
           numba kernels, lightning_nvme/optim/formats/kernels.py); decoders write into a reused buffer
  torchao  torchao.optim.quant_utils (8-bit dynamic-map quantize/dequantize, _fp32_to_bf16_sr), eager
  bnb      bitsandbytes.functional.quantize_blockwise / dequantize_blockwise (CPU backend)
Libraries that are not installed are skipped (``pip install torchao bitsandbytes`` to include them).

    python benchmarks/state_format_codecs.py --elems-m 8 --dir /mnt/nvme

Last line: one JSON object (per codec: Melem/s, GB/s of fp32 and of disk bytes, fraction of clone's
speed, ratio to the disk; the disk's GB/s).
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


# Bytes per element a codec moves to or from the disk (int8: one code byte + one fp32 absmax per 256).
DISK_BYTES = {"bf16": 2.0, "int8": 1 + 4 / 256, "stochastic round": 2.0, "8-bit": 1 + 4 / 256}


def disk_bytes_per_elem(name: str) -> float | None:
    return next((b for k, b in DISK_BYTES.items() if k in name), None)


def cases(n: int) -> dict[str, Callable[[], object]]:
    import torch

    from lightning_nvme.optim.formats.masters import stochastic_round_bf16
    from lightning_nvme.optim.formats.state_format import StateFormat

    x = torch.randn(n) * 1e-3
    v = x.square()
    out: dict[str, Callable[[], object]] = {"clone (yardstick)": x.clone}
    bf16, int8 = StateFormat("bf16"), StateFormat("int8")
    xb = torch.empty(n, dtype=torch.bfloat16)
    out["ours bf16 encode"] = lambda: bf16.encode("exp_avg", x, [xb])
    dec = torch.empty(n)  # decoders write into a reused buffer, as the offloaded optimizer's arena does
    out["ours bf16 decode"] = lambda: bf16.decode("exp_avg", torch.float32, [xb], dec)
    for key, val in (("exp_avg", x), ("exp_avg_sq", v)):
        raws = [torch.empty(c.count(n), dtype=c.dtype) for c in int8.components(key, torch.float32)]
        out[f"ours int8 {key} encode"] = lambda key=key, val=val, raws=raws: int8.encode(key, val, raws)
        out[f"ours int8 {key} decode"] = lambda key=key, raws=raws: int8.decode(key, torch.float32, raws, dec)
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
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--disk-mib", type=int, default=256, help="raw disk bytes per round (0: no disk)")
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: beside the checkout)")
    args = p.parse_args()
    import torch

    from benchmarks._disk import MiB, gbps, preallocate, raw_read, raw_write

    torch.set_num_threads(args.threads)
    n = int(args.elems_m * (1 << 20))
    fns = cases(n)
    times: dict[str, list[float]] = {k: [] for k in fns}
    disk = {"write": [], "read": []}
    nbytes = args.disk_mib * MiB
    path = os.path.join(args.dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        f".codec-disk-{os.getpid()}.bin")
    if nbytes:
        preallocate(path, nbytes)
    for fn in fns.values():
        fn()  # warm-up: compiles (or loads from numba's cache) the kernels and touches the buffers
    try:
        for _ in range(args.reps):
            for name, fn in fns.items():  # every codec once per round, so drift hits them alike
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            if nbytes:
                disk["write"].append(gbps(nbytes, raw_write(path, nbytes)))
                disk["read"].append(gbps(nbytes, raw_read(path, nbytes)))
    finally:
        if nbytes:
            os.remove(path)
    clone = statistics.median(times["clone (yardstick)"])
    result = {}
    for name, ts in times.items():
        t = statistics.median(ts)
        r: dict = {"Melem_per_s": n / t / 1e6, "fp32_GBps": 4 * n / t / 1e9, "vs_clone": clone / t}
        per = disk_bytes_per_elem(name)
        line = f"{name:32s} {n / t / 1e6:8.1f} Melem/s {4 * n / t / 1e9:6.2f} GB/s fp32 {clone / t:5.2f}x clone"
        if per is not None:
            r["disk_GBps"] = per * n / t / 1e9
            line += f" {r['disk_GBps']:6.2f} GB/s disk bytes"
            side = "read" if "decode" in name else "write"
            if disk[side]:
                ratios = [per * n / s / 1e9 / d for s, d in zip(ts, disk[side])]
                r[f"vs_disk_{side}"] = statistics.median(ratios)
                r[f"vs_disk_{side}_min_max"] = [min(ratios), max(ratios)]
                line += f" = {r[f'vs_disk_{side}']:5.2f}x raw {side} ({min(ratios):.2f}-{max(ratios):.2f})"
        result[name] = r
        print(line, file=sys.stderr)
    out = {"elems": n, "threads": args.threads, "reps": args.reps, "load_avg": os.getloadavg()[0], "codecs": result}
    if nbytes:
        out["disk"] = {k: {"median_GBps": statistics.median(v), "min": min(v), "max": max(v)} for k, v in disk.items()}
        print(f"raw disk: write {out['disk']['write']['median_GBps']:.2f} GB/s, read "
              f"{out['disk']['read']['median_GBps']:.2f} GB/s (O_DIRECT, {args.disk_mib} MiB)", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
