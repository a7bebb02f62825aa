"""GPU check for NVMeActivationOffload: a few CUDA training steps with and without the callback must
give bitwise-identical parameters (device -> pinned host -> store on a side stream, and back).

Determinism: cuBLAS workspace pinned and SDPA forced to its math kernel, and the baseline is run twice
to show it is deterministic on this machine before the callback run is compared to it. The last line
printed is one JSON object.

    python benchmarks/gpu_check.py [--store-dir DIR] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from activation_offload import GPT, Tokens  # noqa: E402

from lightning_nvme.callbacks import NVMeActivationOffload  # noqa: E402


def train(model: GPT, steps: int, data: Tokens, root: str, callbacks=()) -> GPT:
    trainer = pl.Trainer(max_steps=steps, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                         default_root_dir=root, deterministic=True)
    with sdpa_kernel(SDPBackend.MATH):
        trainer.fit(model, DataLoader(data, batch_size=None))
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store-dir", default=os.environ.get("LIGHTNING_NVME_STORE_DIR"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        sys.exit(1)
    store_dir = args.store_dir or tempfile.mkdtemp(prefix="nvme-gpu-check-")
    torch.manual_seed(0)
    base = GPT(vocab=256, d=args.d_model, heads=4, layers=args.layers, mlp=4)
    data = Tokens(args.steps, args.batch, args.seq, 256)
    t0 = time.perf_counter()
    a = train(copy.deepcopy(base), args.steps, data, store_dir)
    a2 = train(copy.deepcopy(base), args.steps, data, store_dir)
    cb = NVMeActivationOffload(store_dir=store_dir, min_bytes=1 << 16)
    b = train(copy.deepcopy(base), args.steps, data, store_dir, callbacks=[cb])
    pa, pa2, pb = ([p.detach().cpu() for p in m.parameters()] for m in (a, a2, b))
    deterministic = all(torch.equal(x, y) for x, y in zip(pa, pa2))
    equal = all(torch.equal(x, y) for x, y in zip(pa, pb))
    max_diff = max(float((x - y).abs().max()) for x, y in zip(pa, pb))
    stats = cb.total_stats
    result = {"ok": bool(equal and stats.bytes_written > 0 and stats.bytes_read > 0),
              "bitwise_equal": equal, "baseline_deterministic": deterministic, "max_abs_diff": max_diff,
              "bytes_written": stats.bytes_written, "bytes_read": stats.bytes_read,
              "prefetch_hits": stats.prefetch_hits, "misses": stats.misses, "read_wait_s": round(stats.read_wait_s, 4),
              "device": torch.cuda.get_device_name(0), "total_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
