"""LoRA's start with the frozen base read in place vs copied into the store (``frozen_weights``, #38).

For a Hub-layout base directory (``--base``: config.json + safetensors, e.g. the 7 B or 15 B checkpoint the big runs
write; or ``--shape tiny|small``: a random Llama written into ``--dir`` by ``_llama_ckpt``), rank-``--lora-rank``
peft LoRA (q/k/v/o and MLP projections) is fitted for ``--steps`` steps in a fresh process per run, alternating
``frozen_weights="in_place"`` and ``"store"`` (A B B A ..., ``--pairs`` pairs), each with its own store, deleted
after. The settings are the 7 B's (``precision="bf16-true"``, ``offload_params``, int8 moments + ``bf16_sr``,
``overlap="backward"``, fused AdamW, ``restore_params=False``). The base files' pages are dropped from the page
cache before each run (a cold start, as after a reboot or another job).

Per run: ``start_s``, the time from ``trainer.fit()`` to the first step's start (setup: the store allocated and,
with ``"store"``, the base copied into it); ``store_bytes`` (allocated bytes of the store's files); the store's bytes
written per step (median over the steps after the first). The last line of stdout is one JSON object:
``lora_start_s`` / ``copy_start_s`` (medians), ``lora_start_vs_copy`` (median of per-pair ratios),
``lora_store_bytes`` / ``copy_store_bytes``, ``bytes_written_per_step`` (in place), the load and the CPU.

    python benchmarks/lora_start.py --shape small --dir /work/scratch/x          # ~1.3 GB base, minutes
    python benchmarks/lora_start.py --base /mnt/nvme/llama-7b-shape --dir /mnt/nvme/bench --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import GiB, MiB, drop_file_cache, spread  # noqa: E402
from _llama_ckpt import TINY, write_checkpoint  # noqa: E402
from frozen_read import cpu_name  # noqa: E402

# ~0.6 B parameters, ~1.2 GB of bf16: the largest shape this benchmark writes itself (the big runs pass --base)
SMALL: dict[str, Any] = {
    "hidden_size": 2048, "num_hidden_layers": 8, "intermediate_size": 5504, "num_attention_heads": 16,
    "num_key_value_heads": 16, "vocab_size": 32000, "max_position_embeddings": 1024,
}
SHAPES = {"tiny": TINY, "small": SMALL}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _disk_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _base_files(base: str) -> list[str]:
    return [os.path.join(base, f) for f in sorted(os.listdir(base)) if f.endswith(".safetensors")]


def child(args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from _hf_model import build_module
    from torch.utils.data import DataLoader

    from lightning_nvme.strategies import NVMeOffloadStrategy

    torch.manual_seed(0)
    strategy = NVMeOffloadStrategy(args.store, offload_params=True, state_format="int8", master_format="bf16_sr",
                                   overlap="backward", restore_params=False, frozen_weights=args.child)
    starts: list[float] = []
    written: list[int] = []
    losses: list[float] = []
    info: dict[str, Any] = {}

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
            store = trainer.strategy.nvme_store  # type: ignore[attr-defined]
            starts.append(time.perf_counter())
            written.append(store.stats.bytes_written)
            if len(starts) == 1:
                frozen = trainer.strategy.param_offload.frozen  # type: ignore[attr-defined]
                info["in_place_blocks"] = len(frozen.heads) if frozen is not None else 0
                info["in_place_bytes"] = frozen.head_bytes if frozen is not None else 0
                info["o_direct"] = frozen is not None and all(f.direct_fd >= 0 for f in frozen.files.values())
                info["store_bytes"] = _disk_bytes(args.store)

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *_: object) -> None:
            losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer: pl.Trainer, *_: object) -> None:
            store = trainer.strategy.nvme_store  # type: ignore[attr-defined]
            store.fence(durable=True)
            written.append(store.stats.bytes_written)

    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-true", strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Clock()], num_sanity_val_steps=0, limit_val_batches=0)
    with trainer.init_module(empty_init=True):
        model = build_module(args.base, block_size=args.seq, lora_rank=args.lora_rank,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (args.steps, args.batch, args.seq + 1), generator=g)  # byte tokens
    batches = [(b[:, :-1], b[:, 1:]) for b in x]
    t0 = time.perf_counter()
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None))
    per_step = [b - a for a, b in zip(written[1:], written[2:])]  # after the first step (its state is created)
    return {**info, "start_s": starts[0] - t0, "losses": losses,
            "steps_s": [b - a for a, b in zip(starts, starts[1:])],
            "bytes_written_per_step": statistics.median(per_step) if per_step else None,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _run(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    for f in _base_files(args.base):
        drop_file_cache(f)  # cold: the base's pages are not in the page cache
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=f"store-{mode}-") as store:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, f"--store={store}", f"--base={args.base}",
               f"--steps={args.steps}", f"--seq={args.seq}", f"--batch={args.batch}", f"--lora-rank={args.lora_rank}"]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    if res.returncode != 0:
        raise SystemExit(f"child {mode} failed with exit code {res.returncode}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    _log(f"{mode}: start {out['start_s']:.2f} s, store {out['store_bytes'] / MiB:.1f} MiB, written/step "
         f"{out['bytes_written_per_step']}, in place {out['in_place_bytes'] / MiB:.1f} MiB")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="a Hub-layout base directory (config.json + safetensors)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="write a random Llama base of this shape")
    p.add_argument("--dir", default=None, help="where the stores (and a written base) go")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps per run (bytes written per step: after the first)")
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--child", choices=["in_place", "store"], help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if (args.base is None) == (args.shape is None):
        raise SystemExit("give --base DIR (a Hub-layout checkpoint) or --shape tiny|small")
    tmp = tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-lora-start-")
    args.dir = tmp.name
    load = [os.getloadavg()[0]]
    written = None
    if args.shape is not None:
        args.base = os.path.join(tmp.name, f"llama-{args.shape}")
        written = write_checkpoint(args.base, SHAPES[args.shape])
        _log(f"base {args.base}: {written}")
    base_bytes = sum(os.path.getsize(f) for f in _base_files(args.base))
    free = shutil.disk_usage(args.dir).free
    if base_bytes * 1.1 + 256 * MiB > free:  # the copy ("store") needs about the base again
        raise SystemExit(f"not enough free disk in {args.dir}: the store copy needs ~{base_bytes / 1e9:.1f} GB, "
                         f"{free / 1e9:.1f} GB free")
    runs: dict[str, list[dict[str, Any]]] = {"in_place": [], "store": []}
    for i in range(args.pairs):
        for mode in ("in_place", "store") if i % 2 == 0 else ("store", "in_place"):  # A B B A: no order advantage
            runs[mode].append(_run(args, mode))
            load.append(os.getloadavg()[0])
    tmp.cleanup()
    lora, copy = runs["in_place"], runs["store"]
    out: dict[str, Any] = {
        "base": args.base if args.shape is None else f"random llama ({args.shape})", "base_bytes": base_bytes,
        "lora_rank": args.lora_rank, "trainable": lora[0]["trainable"],
        "lora_store_bytes": max(r["store_bytes"] for r in lora), "copy_store_bytes": max(r["store_bytes"] for r in copy),
        "lora_start_s": round(statistics.median(r["start_s"] for r in lora), 3),
        "copy_start_s": round(statistics.median(r["start_s"] for r in copy), 3),
        "lora_start_vs_copy": spread([a["start_s"] / b["start_s"] for a, b in zip(lora, copy)]),
        "bytes_written_per_step": statistics.median(r["bytes_written_per_step"] for r in lora),
        "copy_bytes_written_per_step": statistics.median(r["bytes_written_per_step"] for r in copy),
        "in_place_bytes": lora[0]["in_place_bytes"], "in_place_blocks": lora[0]["in_place_blocks"],
        "o_direct": lora[0]["o_direct"],
        "lora_starts_s": [round(r["start_s"], 3) for r in lora], "copy_starts_s": [round(r["start_s"], 3) for r in copy],
        "losses_equal": all(a["losses"] == b["losses"] for a, b in zip(lora, copy)),
        "lora_losses": lora[0]["losses"], "steps": args.steps, "seq": args.seq, "batch": args.batch,
        "cpu": cpu_name(), "cpus": os.cpu_count(), "written_base": written,
        "load_avg_1min": {"min": min(load), "max": max(load), "samples": [round(x, 2) for x in load]},
    }
    out["lora_start_vs_copy_median"] = out["lora_start_vs_copy"]["median"]
    out["lora_store_GiB"] = round(out["lora_store_bytes"] / GiB, 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
