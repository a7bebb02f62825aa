"""The seed user's next model (#38): a ~13-15 B Llama built straight into the store, full-finetuned, then LoRA on
the same shape with its frozen base read in place from a safetensors checkpoint against the base copied into the
store.

Why no checkpoint for the full finetune: at these formats the store alone takes ~4.03 B/param (bf16 weights 2 +
int8 moments 2 x 1.016), ~53 GB at 13 B; a source checkpoint beside it (2 B/param, 26 GB more) does not fit the
disk this runs on. So the model is created on the meta device and initialized block by block straight into the
store: ``HFCausalLM(config_dir, init_seed=0)`` (transformers' ``_init_weights`` per module, seeded per module:
``lightning_nvme.models.hf.HFInit``; the same values as the same init in memory, bitwise, by test).

Shapes (``--shape``; Llama architecture, 40 heads, vocab 32000, untied head, bf16):

  13b    hidden 5120, 40 layers, intermediate 13824: 13.02 B params (store ~53 GB). The default: it fits the
         ~58 GB of disk this machine lends the run; Llama-2-13B's shape.
  15b    the same with 48 layers: 15.55 B params (store ~63 GB).
  7b     Llama-2-7B's shape (hidden 4096, 32 layers, intermediate 11008, 32 heads): for the LoRA start at 7 B.
  tiny   a tiny Llama of the same architecture (``--smoke``: seconds).

Each measurement runs in a fresh process (``hf_7b.py``'s children; its peak RSS its own): ``empty`` (the imports'
baseline), ``compute`` (one block in memory at the shape, forward + recompute + backward, x layers + ends, and the
update arithmetic in memory), ``full`` (``precision="bf16-true"``, ``NVMeOffloadStrategy(offload_params=True,
state_format="int8", master_format="bf16_sr", overlap="backward", restore_params=False)``, ``AdamW(fused=True)``,
transformers' gradient checkpointing; ``--warmup`` + ``--steps`` steps on one repeated window of the embedded
corpus). Raw ``O_DIRECT`` write and read of the store's disk before and after it; ``io_bound_s`` = bytes read per
step / raw read + bytes written / raw write; ``compute_s`` = the model's compute + the update's (as hf_7b's
``step_vs_bound_with_optimizer``); ``step_vs_bound = step_s / max(io_bound_s, compute_s)``.

Then (unless ``--no-lora``), after the full finetune's store is deleted: the same shape written once as a bf16
sharded safetensors checkpoint in the Hub layout (``_llama_ckpt.write_checkpoint``: one ~2 GB shard in memory at
most), and rank-``--lora-rank`` peft LoRA on it twice: ``frozen_weights="in_place"`` (the base read from the
checkpoint's files) and ``frozen_weights="store"`` (the base copied into the store first), each after the base's pages
are dropped from the page cache (a cold start). ``lora_start_s`` /
``copy_start_s``: from ``trainer.fit()`` to the first step's start; ``lora_store_bytes``: the in-place run's store.

    python benchmarks/hf_15b.py --dir /mnt/nvme/bench                  # 13 B full finetune, then LoRA
    python benchmarks/hf_15b.py --dir /mnt/nvme/bench --no-lora        # the full finetune only
    python benchmarks/hf_15b.py --dir /mnt/nvme/bench --shape 7b --no-full  # the 7 B LoRA start both ways
    python benchmarks/hf_15b.py --smoke --dir /tmp/x                   # tiny Llama, seconds

Free space is checked before each phase against what it needs (the store; the checkpoint + the copied base),
and a shortfall stops the run naming the bytes and the directory. Progress goes to stderr; the last line of
stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_7b  # noqa: E402
from _disk import GiB, MiB, drop_file_cache  # noqa: E402
from _llama_ckpt import INDEX, LLAMA2_7B, TINY, llama_config, tensor_shapes, write_checkpoint  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "13b": {"hidden_size": 5120, "num_hidden_layers": 40, "intermediate_size": 13824, "num_attention_heads": 40,
            "num_key_value_heads": 40, "vocab_size": 32000, "max_position_embeddings": 4096},
    "7b": LLAMA2_7B,
    "tiny": TINY,
}
SHAPES["15b"] = {**SHAPES["13b"], "num_hidden_layers": 48}
CHECKPOINT_BYTES_PER_PARAM = 2  # bf16
BASE_COPY_BYTES_PER_PARAM = 2  # the frozen base in the store (bf16), when it is copied there
SLACK = 1.05  # block alignment, the store's header and regions, the adapters and their state


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _cpu() -> dict[str, Any]:
    """The CPU's model and its bf16 support (what decides the compute: docs/performance.md's 7 B section)."""
    import torch

    flags: set[str] = set()
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}


def need_space(directory: str, nbytes: int, what: str) -> dict[str, float]:
    """Refuse, naming the bytes and the directory, when ``directory``'s disk has less than ``nbytes`` free."""
    free = shutil.disk_usage(directory).free
    if nbytes > free:
        raise SystemExit(f"not enough free disk in {directory}: {what} needs {nbytes} bytes ({nbytes / 1e9:.1f} GB), "
                         f"{free} bytes ({free / 1e9:.1f} GB) are free. Fix: free {(nbytes - free) / 1e9:.1f} GB "
                         "there, point --dir at a larger disk, or run a smaller --shape.")
    _log(f"disk: {what} needs {nbytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free in {directory}")
    return {"needed_GB": round(nbytes / 1e9, 2), "free_GB": round(free / 1e9, 2)}


def full_finetune(args: argparse.Namespace, params: int, out: dict[str, Any], loads: list[float]) -> dict[str, Any]:
    """empty, compute, raw disk, the full finetune from a fresh init in the store, raw disk: its figures."""
    store = int(params * hf_7b.STORE_BYTES_PER_PARAM * SLACK)
    out["disk_full"] = need_space(args.dir, store + args.raw_mib * MiB, "the full finetune's store")
    empty = hf_7b._run_child(args, "empty")["peak_rss_bytes"]
    compute = hf_7b._run_child(args, "compute")
    _log(f"compute: block {compute['block_s']:.2f} s x {compute['layers']} + ends {compute['ends_s']:.2f} s "
         f"= {compute['compute_s']:.1f} s; update in memory {compute['optimizer_s']:.1f} s")
    raws = [hf_7b._raw(args)]
    loads.append(_load())
    full = hf_7b._run_child(args, "full")
    loads.append(_load())
    raws.append(hf_7b._raw(args))
    w = statistics.median(r[0] for r in raws)
    r = statistics.median(r[1] for r in raws)
    io_bound = full["bytes_read_per_step"] / (r * 1e9) + full["bytes_written_per_step"] / (w * 1e9)
    compute_s = compute["compute_s"] + compute["optimizer_s"]
    return {
        "params": full["params"],
        "peak_rss_MiB": round(full["peak_rss_bytes"] / MiB, 1),
        "empty_process_MiB": round(empty / MiB, 1),
        "store_bytes": full["store_bytes"], "store_GiB": round(full["store_bytes"] / GiB, 3),
        "losses": [round(x, 4) for x in full["losses"]],
        "step_s": round(full["step_s"], 6), "steps_s": [round(s, 2) for s in full["steps_s"]],
        "io_bound_s": round(io_bound, 6),
        "compute_s": round(compute_s, 6),  # the model's forward + recompute + backward, and the update
        "compute_model_s": round(compute["compute_s"], 6), "optimizer_s": round(compute["optimizer_s"], 6),
        "step_vs_bound": round(full["step_s"] / max(io_bound, compute_s), 3),
        "bytes_read_per_step": full["bytes_read_per_step"], "bytes_written_per_step": full["bytes_written_per_step"],
        "store_wait_s_per_step": round(full["store_wait_s_per_step"], 2),
        "init_into_store_s": round(full["fit_to_first_step_s"], 1),  # the random init block by block + setup
        "peak_resident_blocks": full["peak_resident_blocks"],
        "raw_write_GBps": [round(x[0], 3) for x in raws], "raw_read_GBps": [round(x[1], 3) for x in raws],
        "compute_block_s": round(compute["block_s"], 3),
        "bf16_input_grad_via_forward_kernel": full["bf16_input_grad_via_forward_kernel"],
    }


def lora_both_ways(args: argparse.Namespace, params: int, out: dict[str, Any], loads: list[float],
                   full_written: int | None) -> dict[str, Any]:
    """The checkpoint written once, then LoRA with the base read in place and with it copied into the store."""
    cached = args.ckpt_dir is not None and os.path.isfile(os.path.join(args.ckpt_dir, INDEX))
    ckpt = 0 if cached else int(params * CHECKPOINT_BYTES_PER_PARAM * SLACK)
    out["disk_lora"] = need_space(args.dir, ckpt + int(params * BASE_COPY_BYTES_PER_PARAM * SLACK),
                                  "the bf16 checkpoint and LoRA's store with the base copied into it")
    path = args.ckpt_dir or os.path.join(args.dir, "llama-ckpt")
    written = write_checkpoint(path, SHAPES[args.shape], log=None)
    _log(f"checkpoint {path}: {written}")
    config_dir, args.ckpt = args.ckpt, path
    init_seed, args.init_seed = args.init_seed, None
    runs = {}
    try:
        for mode in ("in_place", "store"):
            args.frozen_weights = mode
            for f in os.listdir(path):  # a cold start for both (as lora_start.py): the base's pages out of the cache
                if f.endswith(".safetensors"):
                    drop_file_cache(os.path.join(path, f))
            loads.append(_load())
            runs[mode] = hf_7b._run_child(args, "lora")
    finally:
        args.ckpt, args.init_seed, args.frozen_weights = config_dir, init_seed, None
        if args.ckpt_dir is None:
            shutil.rmtree(path)
    inplace, copied = runs["in_place"], runs["store"]
    res = {
        "checkpoint": written,
        "lora_rank": args.lora_rank, "lora_trainable": inplace["trainable"],
        "lora_store_bytes": inplace["store_bytes"], "copy_store_bytes": copied["store_bytes"],
        "lora_start_s": round(inplace["fit_to_first_step_s"], 6), "copy_start_s": round(copied["fit_to_first_step_s"], 6),
        "lora_start_vs_copy": round(inplace["fit_to_first_step_s"] / copied["fit_to_first_step_s"], 6),
        "lora_bytes_written_per_step": inplace["bytes_written_per_step"],
        "lora_bytes_read_per_step": inplace["bytes_read_per_step"],
        "copy_bytes_written_per_step": copied["bytes_written_per_step"],
        "lora_step_s": round(inplace["step_s"], 2), "copy_step_s": round(copied["step_s"], 2),
        "lora_peak_rss_MiB": round(inplace["peak_rss_bytes"] / MiB, 1),
        "copy_peak_rss_MiB": round(copied["peak_rss_bytes"] / MiB, 1),
        "lora_losses": [round(x, 4) for x in inplace["losses"]], "copy_losses": [round(x, 4) for x in copied["losses"]],
    }
    if full_written:
        res["lora_written_vs_full"] = round(inplace["bytes_written_per_step"] / full_written, 5)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="13b")
    p.add_argument("--smoke", action="store_true", help="--shape tiny, small raw-disk measurements (seconds)")
    p.add_argument("--dir", default=None, help="where the stores (and the LoRA checkpoint) go")
    p.add_argument("--ckpt-dir", default=None, help="the LoRA checkpoint (reused if complete; default: under --dir, "
                   "removed afterwards)")
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps of the full finetune")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (the optimizer state is created)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--init-seed", type=int, default=0, help="the fresh init's seed (HFInit)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-steps", type=int, default=1, help="timed steps of each LoRA run")
    p.add_argument("--compute-reps", type=int, default=3)
    p.add_argument("--raw-mib", type=int, default=2048)
    p.add_argument("--no-lora", action="store_true", help="the full finetune only")
    p.add_argument("--no-full", action="store_true", help="the LoRA start both ways only")
    args = p.parse_args()
    if args.smoke:
        args.shape = "tiny"
        args.raw_mib = min(args.raw_mib, 64)
    args.data = "fixed"
    args.frozen_weights = None
    t_start = time.perf_counter()
    loads = [_load()]
    tmp = tempfile.TemporaryDirectory(dir=args.dir or hf_7b.ROOT, prefix=".bench-hf15b-")
    args.dir = tmp.name
    config = llama_config(SHAPES[args.shape])
    args.ckpt = os.path.join(tmp.name, "config")  # config.json only: the full finetune reads no weights
    os.makedirs(args.ckpt)
    with open(os.path.join(args.ckpt, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    params = sum(hf_7b._numel(s) for _, s in tensor_shapes(config))  # meta device: no memory
    out: dict[str, Any] = {"shape": args.shape, **{k: config[k] for k in SHAPES["13b"]}, "params_planned": params}
    _log(f"{args.shape}: {params / 1e9:.2f} B params")
    try:
        full = None if args.no_full else full_finetune(args, params, out, loads)
        if full is not None:
            out.update(full)
        if not args.no_lora:
            out.update(lora_both_ways(args, params, out, loads, full and full["bytes_written_per_step"]))
    finally:
        tmp.cleanup()
    loads.append(_load())
    out.update({"seq": args.seq, "batch": args.batch, "lr": args.lr, "steps": args.steps, "warmup": args.warmup,
                **_cpu(), "load_avg_1min": {"min": min(loads), "max": max(loads), "samples": loads},
                "wall_s": round(time.perf_counter() - t_start, 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
