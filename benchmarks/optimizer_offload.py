"""Optimizer-state offload: step time vs the disk's I/O lower bound, training-step overhead, memory.

One run alternates, pair by pair (the disk drifts up to 3x over minutes):
  raw    O_DIRECT sequential write (timed through fsync) + read of the state's size on the same disk
  inmem  AdamW in memory: optimizer.step alone, then full training steps       (own process: peak RSS)
  step   NVMeOffload overlap="step": optimizer.step alone, then training steps  (own process)
  bwd    NVMeOffload overlap="backward": training steps                         (own process)
and reports medians of the per-pair ratios. The offloaded step is timed through its write-back and
fdatasync (writes are acknowledged before they are durable on this disk).

    python benchmarks/optimizer_offload.py                 # ~150M params, 3 pairs
    python benchmarks/optimizer_offload.py --params-m 300  # a second size: resident memory stays flat

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import MiB, raw_disk, spread  # noqa: E402
from _profile import Counters, python_profile, run_profiled, summarize_pyspy, torch_profile  # noqa: E402

from lightning_nvme.memory import peak_rss_bytes  # noqa: E402


def build(params_m: float, width: int):
    import torch

    depth = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def child(args) -> dict:
    """One configuration in its own process, so its peak RSS is its own."""
    import torch

    from lightning_nvme.optim import OffloadedOptimizer
    from lightning_nvme.store import FlatStore

    torch.manual_seed(0)
    model = build(args.params_m, args.width)
    x = torch.randn(args.tokens, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused or None)
    store = off = None
    if args.child != "inmem":
        from lightning_nvme.memory import release_freed_memory
        from lightning_nvme.settings import OffloadSettings

        release_freed_memory(OffloadSettings().mmap_threshold())  # what NVMeOffloadStrategy does at setup
        store = FlatStore(args.dir, io_chunk_bytes=args.io_chunk_mib * MiB, io_workers=args.workers)
        off = OffloadedOptimizer(opt, store, chunk_bytes=args.chunk_mib * MiB, prefetch_depth=args.prefetch,
                                 overlap="backward" if args.child == "bwd" else "step")
    out: dict = {}

    def closure():
        opt.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        out.setdefault("fwd", []).append(t1 - t0)
        out.setdefault("bwd", []).append(time.perf_counter() - t1)
        return loss

    def sync():
        if store is not None:
            store.fence(durable=True)

    opt.step(closure)  # warm-up: creates the state (and its regions' first write)
    sync()

    def per_step(fn) -> float:
        """Steady state: N steps back to back (writes of step k drain during step k+1), then one
        durable fence, all divided by N."""
        t0 = time.perf_counter()
        for _ in range(args.steps):
            fn()
        sync()
        return (time.perf_counter() - t0) / args.steps

    if args.child != "bwd":
        out["opt_step"] = per_step(lambda: opt.step())  # grads of the last backward; the update alone
    out["fwd"], out["bwd"] = [], []
    counters = Counters(stores=[store] if store is not None else [])
    with counters:
        out["train_step"] = per_step(lambda: opt.step(closure))
    out["counters"] = counters.as_dict(per=args.steps)
    if args.profile:
        def one_step():
            opt.step(closure)
            sync()
        print(f"== {args.child}: cProfile of one training step (own time) ==\n{python_profile(one_step)}\n"
              f"== {args.child}: torch profiler, one training step ==\n{torch_profile(one_step)}", file=sys.stderr)
    out["bwd"] = statistics.median(out["bwd"])
    out["fwd"] = statistics.median(out["fwd"])
    out["state_bytes"] = off.state_bytes if off else sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    out["params"] = sum(p.numel() for p in model.parameters())
    out["rss_MiB"] = peak_rss_bytes() / MiB
    out["resident_buffers_MiB"] = off.ring.total_bytes / MiB if off else 0.0
    if store is not None:
        store.close(delete=True)
    return out


def last_json(stdout: str) -> dict:
    """The child's result: its last line that is a JSON object (py-spy may print after it)."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))


def add_offload_arguments(p: argparse.ArgumentParser, params_m: float, width: int, dtype: str) -> None:
    """The model size, repetitions and store settings of an offloaded-optimizer benchmark (this one and
    state_format_offload.py)."""
    p.add_argument("--params-m", type=float, default=params_m, help=f"model size in millions of {dtype} params")
    p.add_argument("--width", type=int, default=width)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--chunk-mib", type=int, default=32)
    p.add_argument("--io-chunk-mib", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prefetch", type=int, default=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_offload_arguments(p, 150.0, 2048, "fp32")
    p.add_argument("--tokens", type=int, default=384, help="rows per batch: sets backward time vs I/O")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True) in every configuration")
    p.add_argument("--dir", default=None, help="store directory (default: a temp dir beside the checkout)")
    p.add_argument("--profile", action="store_true",
                   help="also profile each configuration (cProfile + torch profiler of one step, py-spy of the "
                        "child where installed); summaries go to stderr and to --profile-dir")
    p.add_argument("--profile-dir", default=os.path.join(ROOT, ".bench-profile"))
    p.add_argument("--child", choices=["inmem", "step", "bwd"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    tmp = tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-opt-")
    args.dir = tmp.name

    flags = ("fused", "profile")
    if args.profile:
        os.makedirs(args.profile_dir, exist_ok=True)

    def run_child(kind: str, pair: int) -> dict:
        cmd = [sys.executable, __file__, "--child", kind] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("child", "pairs", *flags)] + [
            f"--{k}" for k in flags if getattr(args, k)]
        if not args.profile:
            res = subprocess.run(cmd, check=True, capture_output=True, text=True)
            return last_json(res.stdout)
        base = os.path.join(args.profile_dir, f"optimizer-{kind}-pair{pair}")
        res = run_profiled(cmd, base + ".pyspy.txt", check=True, capture_output=True, text=True)
        with open(base + ".txt", "w") as f:
            f.write(res.stderr + "\n== py-spy: top leaf frames per thread ==\n" + summarize_pyspy(base + ".pyspy.txt"))
        print(f"profile of {kind} (pair {pair}): {base}.txt", file=sys.stderr, flush=True)
        return last_json(res.stdout)

    rows = []
    for i in range(args.pairs):
        inmem = run_child("inmem", i)
        state = inmem["state_bytes"]
        w, r = raw_disk(args.dir, max(state, 256 * MiB))
        step = run_child("step", i)
        bwd = run_child("bwd", i)
        io_bound = state / (r * 1e9) + state / (w * 1e9)
        rows.append(dict(raw_write_GBps=w, raw_read_GBps=r, io_bound_s=io_bound, inmem=inmem, step=step, bwd=bwd))
        print(f"pair {i}: raw w/r {w:.2f}/{r:.2f} GB/s io_bound {io_bound:.2f}s | opt.step inmem "
              f"{inmem['opt_step']:.2f}s offload {step['opt_step']:.2f}s | train inmem {inmem['train_step']:.2f}s "
              f"step-mode {step['train_step']:.2f}s bwd-mode {bwd['train_step']:.2f}s (backward {inmem['bwd']:.2f}s)",
              file=sys.stderr, flush=True)

    med = lambda xs: statistics.median(xs)  # noqa: E731
    state = rows[0]["inmem"]["state_bytes"]
    rss_in = med([r["inmem"]["rss_MiB"] for r in rows])
    rss_off = med([r["step"]["rss_MiB"] for r in rows])
    result = {
        "params": rows[0]["inmem"]["params"],
        "state_bytes": state,
        "raw_write_GBps": med([r["raw_write_GBps"] for r in rows]),
        "raw_read_GBps": med([r["raw_read_GBps"] for r in rows]),
        "step_inmem_s": med([r["inmem"]["opt_step"] for r in rows]),
        "step_offload_s": med([r["step"]["opt_step"] for r in rows]),
        "io_bound_s": med([r["io_bound_s"] for r in rows]),
        "step_vs_io_bound": med([r["step"]["opt_step"] / r["io_bound_s"] for r in rows]),
        "backward_s": med([r["inmem"]["bwd"] for r in rows]),
        "io_bound_vs_backward": med([r["io_bound_s"] / r["inmem"]["bwd"] for r in rows]),
        "train_step_inmem_s": med([r["inmem"]["train_step"] for r in rows]),
        "train_step_offload_bwd_s": med([r["bwd"]["train_step"] for r in rows]),
        "train_step_offload_step_s": med([r["step"]["train_step"] for r in rows]),
        "train_step_ratio": med([r["bwd"]["train_step"] / r["inmem"]["train_step"] for r in rows]),
        "train_step_ratio_spread": spread([r["bwd"]["train_step"] / r["inmem"]["train_step"] for r in rows]),
        "train_step_ratio_step_mode": med([r["step"]["train_step"] / r["inmem"]["train_step"] for r in rows]),
        "train_step_ratio_step_mode_spread": spread([r["step"]["train_step"] / r["inmem"]["train_step"] for r in rows]),
        "io_bound_vs_backward_spread": spread([r["io_bound_s"] / r["inmem"]["bwd"] for r in rows]),
        "rss_inmem_MiB": rss_in,
        "rss_offload_MiB": rss_off,
        "rss_offload_bwd_MiB": med([r["bwd"]["rss_MiB"] for r in rows]),
        "rss_saved_fraction": (rss_in - rss_off) * MiB / state,
        "resident_buffers_MiB": rows[0]["step"]["resident_buffers_MiB"],
        "pairs": args.pairs,
        "tokens": args.tokens,
        "chunk_MiB": args.chunk_mib,
        "fused": args.fused,
        "step_vs_max_io_compute": med([r["step"]["opt_step"] / max(r["io_bound_s"], r["inmem"]["opt_step"]) for r in rows]),
        # per training step, median over pairs: CPU seconds by thread group, page faults, store waits
        "counters": {kind: {k: med([r[kind]["counters"][k] for r in rows]) for k in rows[0][kind]["counters"]}
                     for kind in ("inmem", "step", "bwd")},
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    tmp.cleanup()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
