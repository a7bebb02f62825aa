"""I/O, wear and step time of each optimizer state format (AdamW, bf16 params with fp32 masters).

One process holds one model and one offloaded AdamW per format, each on its own store file in the same
directory. Each pair alternates (the disk drifts): the raw O_DIRECT write/read loop of benchmarks/_disk.py,
then ``--steps`` optimizer steps of every format (update alone, gradients fixed, timed through a durable
fence). Figures per format:
  bytes_read_per_param_step / bytes_written_per_param_step   store counters / (params x steps)
  step_offload_s        median seconds per step
  io_bound_s            that step's bytes at the raw loop's speeds (read / raw read + written / raw write)
  step_ratio_vs_exact   median (min, max) of per-pair step_offload_s / exact's
  days_to_tbw           wear at the bytes written per step and --step-s seconds per step (default: the
                        measured step), against --tbw-tb
and the codecs' own throughput on one chunk (encode+decode, GB/s of stored bytes), to compare with
the disk's.

    python benchmarks/state_format_offload.py                       # 25 M params, 3 pairs, ~3 min
    python benchmarks/state_format_offload.py --params-m 150 --pairs 5

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import MiB, gbps, preallocate, raw_read, raw_write  # noqa: E402
from optimizer_offload import add_offload_arguments, build  # noqa: E402

FORMATS = [("exact", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("int8", "bf16_sr")]


def label(state: str, master: str) -> str:
    return state if master == "fp32" else f"{state}+{master}"


def setup(args, state: str, master: str, directory: str):
    import torch

    from lightning_nvme.optim import OffloadedOptimizer
    from lightning_nvme.optim.formats.state_format import StateFormat
    from lightning_nvme.store import FlatStore

    model = build(args.params_m, args.width).bfloat16()
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused or None)
    os.makedirs(directory, exist_ok=True)
    store = FlatStore(directory, io_chunk_bytes=args.io_chunk_mib * MiB, io_workers=args.workers)
    off = OffloadedOptimizer(opt, store, chunk_bytes=args.chunk_mib * MiB, prefetch_depth=args.prefetch,
                             fmt=StateFormat(state, master))
    opt.step()  # creates the state
    store.fence(durable=True)
    return model, opt, store, off


def timed_steps(opt, store, steps: int) -> tuple[float, int, int]:
    before = store.stats
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    store.fence(durable=True)
    seconds = (time.perf_counter() - t0) / steps
    d = store.stats - before
    return seconds, d.bytes_read, d.bytes_written


def codec_throughput(n: int) -> dict:
    """Encode + decode of one chunk's worth of AdamW moments, GB/s of stored bytes (median of 5)."""
    import torch

    from lightning_nvme.optim.formats.masters import stochastic_round_bf16
    from lightning_nvme.optim.formats.state_format import StateFormat

    x = torch.randn(n) * 1e-3
    dec = torch.empty(n)  # decoded into a reused buffer, as the optimizer's decode arena does
    out = {}
    for state in ("bf16", "int8"):
        fmt = StateFormat(state)
        for key in ("exp_avg", "exp_avg_sq"):
            v = x.square() if key == "exp_avg_sq" else x
            comps = fmt.components(key, torch.float32)
            raws = [torch.empty(c.count(n), dtype=c.dtype) for c in comps]
            stored = sum(r.numel() * r.element_size() for r in raws)
            enc, decs = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                fmt.encode(key, v, raws)
                t1 = time.perf_counter()
                fmt.decode(key, torch.float32, raws, dec)
                decs.append(time.perf_counter() - t1)
                enc.append(t1 - t0)
            out[f"{state}_{key}_encode_GBps"] = stored / statistics.median(enc) / 1e9
            out[f"{state}_{key}_decode_GBps"] = stored / statistics.median(decs) / 1e9
    sr = []
    for _ in range(5):
        t0 = time.perf_counter()
        stochastic_round_bf16(x, 12345)
        sr.append(time.perf_counter() - t0)
    out["bf16_sr_round_Melem_per_s"] = n / statistics.median(sr) / 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_offload_arguments(p, 25.0, 1024, "bf16")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True): torch's one-pass CPU kernel, the update's "
                   "CPU time shrinks so that the disk is more likely the bound")
    p.add_argument("--tbw-tb", type=float, default=600.0, help="SSD endurance rating for the wear projection")
    p.add_argument("--step-s", type=float, default=None, help="seconds per training step for the wear projection")
    p.add_argument("--dir", default=None, help="store directory (default: a temp dir beside the checkout)")
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-sf-")
    runs = {label(s, m): setup(args, s, m, os.path.join(tmp.name, label(s, m))) for s, m in FORMATS}
    params = sum(q.numel() for q in runs["exact"][0].parameters())
    rows = []
    for i in range(args.pairs):
        nbytes = max(runs["exact"][3].state_bytes, 256 * MiB)
        raw_path = os.path.join(tmp.name, "raw-baseline.bin")
        preallocate(raw_path, nbytes)
        w, r = gbps(nbytes, raw_write(raw_path, nbytes)), gbps(nbytes, raw_read(raw_path, nbytes))
        os.remove(raw_path)
        row = {"raw_write_GBps": w, "raw_read_GBps": r}
        for name, (_, opt, store, _) in runs.items():
            s, rd, wr = timed_steps(opt, store, args.steps)
            row[name] = {"s": s, "read": rd / args.steps, "written": wr / args.steps,
                         "io_bound_s": rd / args.steps / (r * 1e9) + wr / args.steps / (w * 1e9)}
        rows.append(row)
        print(f"pair {i}: raw w/r {w:.2f}/{r:.2f} GB/s | " + " ".join(
            f"{k} {row[k]['s']:.2f}s ({row[k]['io_bound_s']:.2f}s io)" for k in runs), file=sys.stderr, flush=True)
    med = statistics.median
    result: dict = {"params": params, "pairs": args.pairs, "steps": args.steps, "tbw_tb": args.tbw_tb,
                    "raw_write_GBps": med([r["raw_write_GBps"] for r in rows]),
                    "raw_read_GBps": med([r["raw_read_GBps"] for r in rows]), "formats": {}}
    for name in runs:
        ratios = [r[name]["s"] / r["exact"]["s"] for r in rows]
        step_s = med([r[name]["s"] for r in rows])
        written = med([r[name]["written"] for r in rows])
        per_day = written / (args.step_s or step_s) * 86400
        result["formats"][name] = {
            "bytes_read_per_param_step": med([r[name]["read"] for r in rows]) / params,
            "bytes_written_per_param_step": written / params,
            "bytes_per_param_step": (med([r[name]["read"] for r in rows]) + written) / params,
            "state_bytes_on_disk": runs[name][3].state_bytes,
            "step_offload_s": step_s, "io_bound_s": med([r[name]["io_bound_s"] for r in rows]),
            "step_ratio_vs_exact": med(ratios), "step_ratio_min": min(ratios), "step_ratio_max": max(ratios),
            "byte_ratio_vs_exact": (med([r[name]["read"] for r in rows]) + written) / (
                med([r["exact"]["read"] for r in rows]) + med([r["exact"]["written"] for r in rows])),
            "TB_written_per_day": per_day / 1e12, "days_to_tbw": args.tbw_tb * 1e12 / per_day,
        }
    for _, _, store, off in runs.values():
        off.close()
        store.close(delete=True)
    tmp.cleanup()
    result["codecs"] = codec_throughput(args.chunk_mib * MiB // 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
