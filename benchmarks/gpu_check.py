"""GPU check: one run on a CUDA machine verifies the two accelerator paths bitwise against plain Lightning.

1. ``NVMeActivationOffload``: a few CUDA training steps with and without the callback must give
   bitwise-identical parameters (device -> pinned host -> store on a side stream, and back).
2. ``NVMeOffloadStrategy(offload_params=True, overlap="backward")``: a small GPT trained for a few steps
   with its blocks' parameters in the store (store -> pinned staging -> device on a side stream with
   events) must give bitwise-identical parameters to ``strategy="auto"``. Reports the host <-> device
   speed of the staging copies (bytes over their CUDA-event durations), the store's read/write speed
   (bytes over the summed request times), the step time of both runs (median after the first step) and
   the peak number of blocks on the device.

Determinism: cuBLAS workspace pinned, SDPA forced to its math kernel, ``deterministic=True``, and each
baseline is run twice to show it is deterministic on this machine before the offloaded run is compared to
it. AdamW runs with ``foreach=False`` in both runs of check 2 (the offloaded optimizer steps chunk by chunk;
single-tensor AdamW makes each parameter's update independent of that grouping). The last line printed is
one JSON object; the exit status is 1 unless both checks are bitwise equal (and without a CUDA device).

    python benchmarks/gpu_check.py [--store-dir DIR] [--steps 3] [--param-steps 6]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from activation_offload import GPT, Tokens  # noqa: E402

from lightning_nvme import NVMeOffloadStrategy  # noqa: E402
from lightning_nvme.callbacks import NVMeActivationOffload  # noqa: E402
from lightning_nvme.constants import MiB  # noqa: E402


class AdamGPT(GPT):
    """The activation benchmark's GPT with AdamW: parameter offload needs per-parameter optimizer state."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)


class StepTimer(pl.Callback):
    """Wall time of each training step (forward, backward, optimizer step), the device synchronized."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.t0 = 0.0
        self.store_stats: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)

    def on_train_end(self, trainer, pl_module) -> None:
        store = getattr(trainer.strategy, "nvme_store", None)  # still open: teardown closes it after this
        if store is not None:
            store.fence()
            self.store_stats = store.stats

    @property
    def step_s(self) -> float:
        return statistics.median(self.times[1:] or self.times)


def train(model: pl.LightningModule, steps: int, data: Tokens, root: str, callbacks=(), strategy: Any = "auto"):
    trainer = pl.Trainer(max_steps=steps, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                         default_root_dir=root, deterministic=True, strategy=strategy)
    with sdpa_kernel(SDPBackend.MATH):
        trainer.fit(model, DataLoader(data, batch_size=None))
    return model


def compare(reference: pl.LightningModule, again: pl.LightningModule, other: pl.LightningModule) -> dict[str, Any]:
    pa, pa2, pb = ([p.detach().cpu() for p in m.parameters()] for m in (reference, again, other))
    return {"bitwise_equal": all(torch.equal(x, y) for x, y in zip(pa, pb)),
            "baseline_deterministic": all(torch.equal(x, y) for x, y in zip(pa, pa2)),
            "max_abs_diff": max(float((x - y).abs().max()) for x, y in zip(pa, pb))}


def gbps(nbytes: float, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else None


def activation_check(args: argparse.Namespace, store_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    base = GPT(vocab=256, d=args.d_model, heads=4, layers=args.layers, mlp=4)
    data = Tokens(args.steps, args.batch, args.seq, 256)
    t0 = time.perf_counter()
    a = train(copy.deepcopy(base), args.steps, data, store_dir)
    a2 = train(copy.deepcopy(base), args.steps, data, store_dir)
    cb = NVMeActivationOffload(store_dir=store_dir, min_bytes=1 << 16)
    b = train(copy.deepcopy(base), args.steps, data, store_dir, callbacks=[cb])
    stats = cb.total_stats
    result = {**compare(a, a2, b), "bytes_written": stats.bytes_written, "bytes_read": stats.bytes_read,
              "prefetch_hits": stats.prefetch_hits, "misses": stats.misses,
              "read_wait_s": round(stats.read_wait_s, 4), "total_s": round(time.perf_counter() - t0, 1)}
    result["ok"] = bool(result["bitwise_equal"] and stats.bytes_written > 0 and stats.bytes_read > 0)
    return result


def param_offload_check(args: argparse.Namespace, store_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    base = AdamGPT(vocab=256, d=args.param_d_model, heads=8, layers=args.param_layers, mlp=4)
    data = Tokens(args.param_steps, args.param_batch, args.param_seq, 256)
    t0 = time.perf_counter()
    timers = [StepTimer(), StepTimer(), StepTimer()]
    a = train(copy.deepcopy(base), args.param_steps, data, store_dir, [timers[0]])
    a2 = train(copy.deepcopy(base), args.param_steps, data, store_dir, [timers[1]])
    strategy = NVMeOffloadStrategy(store_dir=store_dir, offload_params=True, overlap="backward",
                                   param_prefetch=args.param_prefetch, chunk_bytes=args.chunk_mib * MiB)
    b = train(copy.deepcopy(base), args.param_steps, data, store_dir, [timers[2]], strategy=strategy)
    assert strategy.param_offload is not None
    stats = strategy.param_offload.stats
    staging, store = stats.staging, timers[2].store_stats
    blocks = strategy.param_offload.blocks
    result = {**compare(a, a2, b),
              "params": sum(p.numel() for p in base.parameters()), "blocks": len(blocks),
              "block_MiB": round(max(blk.nbytes for blk in blocks) / MiB, 1),
              "param_prefetch": args.param_prefetch,
              "peak_device_blocks": stats.peak_bound_blocks, "peak_host_blocks": stats.peak_resident_blocks,
              "block_loads": stats.loads, "sync_loads": stats.sync_loads, "writebacks": stats.writebacks,
              "h2d_GBps": gbps(staging.h2d_bytes, staging.h2d_s), "d2h_GBps": gbps(staging.d2h_bytes, staging.d2h_s),
              "h2d_bytes": staging.h2d_bytes, "d2h_bytes": staging.d2h_bytes,
              "pinned_buffers": staging.pinned_buffers, "pageable_buffers": staging.pageable_buffers,
              "store_read_GBps": gbps(store.bytes_read, store.read_seconds),
              "store_write_GBps": gbps(store.bytes_written, store.write_seconds),
              "store_bytes_read": store.bytes_read, "store_bytes_written": store.bytes_written,
              "store_wait_s": round(store.wait_seconds, 3),
              "plain_step_s": round(timers[0].step_s, 4), "offload_step_s": round(timers[2].step_s, 4),
              "total_s": round(time.perf_counter() - t0, 1)}
    result["step_ratio"] = round(result["offload_step_s"] / result["plain_step_s"], 2)
    result["ok"] = bool(result["bitwise_equal"] and staging.h2d_bytes > 0 and staging.d2h_bytes > 0
                        and stats.peak_bound_blocks <= args.param_prefetch + 2)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store-dir", default=os.environ.get("LIGHTNING_NVME_STORE_DIR"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--param-steps", type=int, default=6)
    p.add_argument("--param-layers", type=int, default=8)
    p.add_argument("--param-batch", type=int, default=8)
    p.add_argument("--param-seq", type=int, default=512)
    p.add_argument("--param-d-model", type=int, default=1024)  # 12.6 M parameters (50 MiB) per block
    p.add_argument("--param-prefetch", type=int, default=1)
    p.add_argument("--chunk-mib", type=int, default=32)  # optimizer chunks smaller than a block's state
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        sys.exit(1)
    store_dir = args.store_dir or tempfile.mkdtemp(prefix="nvme-gpu-check-")
    t0 = time.perf_counter()
    checks: dict[str, Any] = {}
    for name, check in (("activation_offload", activation_check), ("param_offload", param_offload_check)):
        try:
            checks[name] = check(args, store_dir)
        except Exception as e:  # noqa: BLE001  (report it in the JSON line, then fail)
            checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result = {"ok": all(c["ok"] for c in checks.values()), **checks,
              "device": torch.cuda.get_device_name(0), "total_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
