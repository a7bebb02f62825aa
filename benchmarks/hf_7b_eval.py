"""Evaluate and generate with a 7 B Llama-shaped checkpoint bigger than what evaluation may hold, streamed (#35).

The checkpoint (a random-init bf16 Llama-2-7B shape, ``_llama_ckpt.py``; ~13.5 GB, a cache in ``--ckpt-dir``) is
read in place: ``HFCausalLM`` built on the meta device, ``offload_params=True``, each block read from the safetensors
shards for its forward. Measured, each in a fresh process (peak RSS from its start):

* ``validate`` over ``--sequences`` sequences of ``--seq`` tokens with ``eval_window`` = all batches (each block read
  once): scored tokens/s, peak RSS, bytes read; its time against its bound ``max(compute, bytes read / raw read
  bandwidth)``, compute being the blocks' forwards (``LayerMajorWindow.compute_s``) and the raw read bandwidth
  measured in the same run (``_disk.raw_disk``, O_DIRECT on the checkpoint's disk), page cache dropped first;
* greedy generation at batch 1 and 16 (``HFCausalLM.generate``, KV cache in memory, each decoding step reading every
  block once for the batch): tokens/s and time per step against its disk bound (bytes per step / raw read bandwidth).

The last line is one JSON object (``params``, ``peak_rss_MiB``, ``tokens_per_s``, ``eval_vs_bound``,
``generate_tokens_per_s`` per batch size, preconditions and load). ``--smoke``: a tiny Llama of the same architecture.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import MiB, drop_file_cache, peak_rss_mib, raw_disk  # noqa: E402
from _llama_ckpt import LLAMA2_7B, TINY, write_checkpoint  # noqa: E402


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cpu() -> str:
    """The CPU's model name and the bf16 features the eval's GEMMs depend on (AVX512-BF16, AMX): the figures
    are compute-bound on a CPU, so they say which kernels ran."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return " ".join([name] + [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags])


def _cold(ckpt: str) -> None:
    for f in glob.glob(os.path.join(ckpt, "*.safetensors")):
        drop_file_cache(f)


def eval_child(args: argparse.Namespace) -> dict:
    import logging

    import torch
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_nvme import NVMeOffloadStrategy
    from lightning_nvme.models import HFCausalLM

    logging.disable(logging.INFO)
    batches = args.sequences // args.batch
    strategy = NVMeOffloadStrategy(store_dir=os.path.join(args.dir, "store"), offload_params=True,
                                   eval_window=args.window or batches, eval_activation_bytes=8 << 30)
    t = Trainer(default_root_dir=args.dir, strategy=strategy, accelerator="cpu", devices=1, logger=False,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with t.init_module(empty_init=True):
        model = HFCausalLM(args.ckpt, block_size=args.seq)
    vocab = model.vocab_size
    x = torch.randint(0, vocab, (args.sequences, args.seq + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=args.batch)
    _cold(args.ckpt)
    t0 = time.perf_counter()
    metrics = t.validate(model, data, verbose=False)[0]
    seconds = time.perf_counter() - t0
    stats, window = strategy.eval_stats, strategy.last_eval_window
    assert stats is not None and window is not None
    return {"eval_s": seconds, "loss": float(metrics["val/loss"]), "bytes_read": stats.bytes_read,
            "block_reads": stats.reads, "windows": window.windows, "compute_s": window.compute_s,
            "read_wait_s": window.read_wait_s, "peak_rss_MiB": peak_rss_mib(),
            "params": sum(p.numel() for p in model.parameters()),
            "activation_MiB": window.peak_activation_bytes / MiB}


def generate_child(args: argparse.Namespace) -> dict:
    import torch

    from lightning_nvme.models import HFCausalLM

    torch.manual_seed(0)
    out = {}
    for batch in args.gen_batches:
        with torch.device("meta"):
            model = HFCausalLM(args.ckpt, block_size=1, backend="transformers")
        prompts = torch.randint(0, model.vocab_size, (batch, 8), generator=torch.Generator().manual_seed(batch))
        _cold(args.ckpt)
        r = model.generate(prompts, args.gen_tokens, attention_mask=torch.ones_like(prompts), pad_token_id=0,
                           eos_token_id=None)
        out[str(batch)] = {**r.figures(), "peak_rss_MiB": peak_rss_mib()}
    return out


def _child(args: argparse.Namespace, kind: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--ckpt", args.ckpt, "--dir", args.dir,
           "--sequences", str(args.sequences), "--seq", str(args.seq), "--batch", str(args.batch),
           "--window", str(args.window), "--gen-tokens", str(args.gen_tokens),
           "--gen-batches", ",".join(map(str, args.gen_batches))]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise SystemExit(f"child {kind} failed with exit code {res.returncode}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny Llama of the same architecture (seconds)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint cache (default: <dir>/llama-ckpt, removed after)")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--window", type=int, default=0, help="eval_window (0: every batch in one window)")
    p.add_argument("--gen-tokens", type=int, default=4)
    p.add_argument("--gen-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--raw-mib", type=int, default=2048)
    p.add_argument("--child", choices=["eval", "generate"], help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    load_start = os.getloadavg()
    if args.child:
        print(json.dumps(eval_child(args) if args.child == "eval" else generate_child(args)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hf7b-eval-") as scratch:
        args.dir = scratch
        args.ckpt = args.ckpt_dir or os.path.join(scratch, "llama-ckpt")
        built = write_checkpoint(args.ckpt, TINY if args.smoke else LLAMA2_7B, log=_log)
        _, read_gbps = raw_disk(os.path.dirname(os.path.abspath(args.ckpt)), args.raw_mib * MiB)
        _log(f"raw O_DIRECT read {read_gbps:.2f} GB/s")
        ev = _child(args, "eval")
        gen = _child(args, "generate")
    disk_s = ev["bytes_read"] / (read_gbps * 1e9)
    bound = max(ev["compute_s"], disk_s)
    scored = args.sequences * args.seq
    per_step = {b: g["bytes_read"] / max(1, g["block_passes"]) for b, g in gen.items()}
    result = {
        "params": ev["params"], "peak_rss_MiB": round(ev["peak_rss_MiB"], 1), "tokens_per_s": round(scored / ev["eval_s"], 2),
        "eval_s": round(ev["eval_s"], 4), "compute_s": round(ev["compute_s"], 4), "disk_bound_s": round(disk_s, 4),
        "eval_vs_bound": round(ev["eval_s"] / bound, 4), "read_wait_s": round(ev["read_wait_s"], 2),
        "bytes_read": ev["bytes_read"], "block_reads": ev["block_reads"], "windows": ev["windows"],
        "sequences": args.sequences, "seq": args.seq, "batch": args.batch, "loss": ev["loss"],
        "activation_MiB": round(ev["activation_MiB"], 1), "raw_read_GBps": round(read_gbps, 3),
        "generate_tokens_per_s": {b: g["tokens_per_s"] for b, g in gen.items()},
        "generate_bytes_read_per_token": {b: g["bytes_read_per_token"] for b, g in gen.items()},
        "generate_vs_bound": {b: round(g["seconds"] / max(1, g["block_passes"]) / (per_step[b] / (read_gbps * 1e9)), 3)
                              for b, g in gen.items()},
        "generate_peak_rss_MiB": {b: round(g["peak_rss_MiB"], 1) for b, g in gen.items()},
        "checkpoint": {"reused": built.get("reused", False), "bytes": built.get("bytes")},
        "load_avg_start": load_start, "load_avg": os.getloadavg(), "cpus": os.cpu_count(), "cpu": _cpu(), "smoke": args.smoke,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
