"""The seed user's model on this machine (#21): a 7 B Llama full-finetuned with everything offloaded, then LoRA.

A Llama checkpoint with Llama-2-7B's shape (hidden 4096, 32 layers, intermediate 11008, 32 heads, vocab
32000: 6.74 B parameters), random-initialized, bf16, sharded safetensors in the Hugging Face layout, is
written once into ``--ckpt-dir`` (a cache, reused; ~13.5 GB; ``_llama_ckpt.py``) — no download. Then, each
in a fresh process (its peak RSS its own):

  empty    the same imports, nothing else: the interpreter + torch + Lightning + transformers baseline RSS
  full     the model built on the meta device under ``trainer.init_module(empty_init=True)``, its weights
           streamed from the checkpoint into the store block by block; ``precision="bf16-true"``,
           ``NVMeOffloadStrategy(offload_params=True, state_format="int8", master_format="bf16_sr",
           overlap="backward", restore_params=False)``, ``AdamW(fused=True)``, activation checkpointing
           (transformers' gradient checkpointing); ``--warmup`` + ``--steps`` steps on the embedded corpus
           (Python's stdlib sources, byte tokens): by default one window of it repeated every step
           (``--data fixed``, the overfit check), ``--data stream`` for a new window per step
  lora     the same base with rank-``--lora-rank`` LoRA through peft (q/k/v/o and MLP projections): the
           base frozen in the store, never written back
  compute  one decoder block in memory at the same shape, bf16: forward (no grad, as checkpointing's
           first pass) + forward again + backward, timed; times ``num_hidden_layers``, plus the embedding,
           final norm, head and loss forward + backward: what the step costs with no I/O at all

Raw ``O_DIRECT`` write and read speed of the store's disk (``_disk.raw_disk``) is measured before and after
the full run; ``io_bound_s = bytes_read_per_step / raw_read + bytes_written_per_step / raw_write`` with the
store's own counters and the median raw speeds; ``step_vs_bound = step_s / max(io_bound_s, compute_s)``.
``--rounds N`` (N > 1) alternates the reference and the subject: compute, full, compute, full, ..., compute, a raw
disk measurement after each full run; each round's ``step_vs_bound_with_optimizer`` uses the compute references and
disk speeds on either side of it (``rounds`` in the JSON), the top-level figure is their median.
``plain_would_need_GiB``: 16 B/param (what plain mixed-precision AdamW keeps: bf16 weights and gradients,
fp32 master, two fp32 moments) + the empty process's RSS. Disk needed: the checkpoint (~2 B/param) + the
store (~2 B/param of weights + ~2.06 B/param of int8 moments and their scales); checked before anything runs.

    python benchmarks/hf_7b.py --dir /mnt/nvme/bench --ckpt-dir /mnt/nvme/llama-7b-shape   # the 7 B
    python benchmarks/hf_7b.py --smoke --dir /tmp/x                                        # tiny Llama, seconds
    python benchmarks/hf_7b.py --layers 4 --vocab 4096 --no-lora --emulate-no-bf16 ...     # 7 B blocks, 3.1 GB store

``--emulate-no-bf16`` runs the children as on a CPU without AVX512-BF16 (AVX2 only; ``EMULATE_NO_BF16`` below says
how and docs/performance.md how it compares with such a CPU); ``--layers``/``--vocab`` keep the 7 B's block shape
with fewer blocks. ``phases`` in the JSON: where each timed step's time went (forward, backward with the updates
made in it, the rest of the optimizer step, between steps), each with its wall time, the CPU seconds of the main
thread, the store's I/O workers and the other threads (torch's and numba's pools), the bytes moved and the time
the main thread waited for the store, by request kind (``_profile.PhaseClock``).

Why ``--data fixed`` by default: the loss must show, within the three or four steps a 7 B step's time
allows, whether the optimizer learns. Windows of 8 byte tokens differ from each other by about half a nat
for a random-initialized model that does not move at all (measured at the 7 B width with 2 layers,
docs/performance.md), so the loss of a new window per step says more about the window than the model;
the same window repeated must fall if gradients and updates are right.

Progress goes to stderr; the last line of stdout is one JSON object.
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
from _disk import GiB, MiB, raw_disk, spread  # noqa: E402
from _llama_ckpt import LLAMA2_7B, TINY, llama_config, tensor_shapes, write_checkpoint  # noqa: E402
from _profile import PhaseClock  # noqa: E402

BYTES_PER_PARAM_PLAIN = 16  # mixed-precision AdamW: bf16 weight + bf16 grad + fp32 master + exp_avg + exp_avg_sq
# Store bytes per parameter with int8 moments and bf16_sr (no master): 2 (bf16 weight) + 2 x (1 code + 4/256 scale)
STORE_BYTES_PER_PARAM = 2 + 2 * (1 + 4 / 256)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _imports() -> None:
    """What every child imports, the empty one included (its RSS is the baseline)."""
    import lightning.pytorch  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import lightning_nvme.models  # noqa: F401
    import lightning_nvme.strategies  # noqa: F401


def _peak_rss_bytes() -> int:
    from lightning_nvme.memory import peak_rss_bytes  # VmHWM: ru_maxrss would include the parent's RSS

    return peak_rss_bytes()


def _disk_bytes(path: str) -> int:
    """Allocated bytes of every file under ``path`` (what the store takes on the disk)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


# ---- the children ------------------------------------------------------------------------------------
def train_child(args: argparse.Namespace) -> dict:
    import lightning.pytorch as pl
    import torch
    from _hf_model import build_module

    from lightning_nvme.data.datamodule import EmbeddedTextDataModule
    from lightning_nvme.strategies import NVMeOffloadStrategy

    torch.manual_seed(0)
    lora = args.child == "lora"
    n = args.warmup + (args.lora_steps if lora and args.lora_steps is not None else args.steps)
    data = EmbeddedTextDataModule(source="stdlib", max_bytes=2_000_000, block_size=args.seq, batch_size=args.batch,
                                  steps_per_epoch=n, tokenizer="byte")
    extra: dict[str, Any] = {} if getattr(args, "prefetch_depth", None) is None else {"prefetch_depth": args.prefetch_depth}
    if getattr(args, "param_prefetch", None) is not None:
        extra["param_prefetch"] = args.param_prefetch
    if getattr(args, "host_memory_budget", None) is not None:
        extra["host_memory_budget"] = args.host_memory_budget
    if args.frozen_weights is not None:  # hf_15b's LoRA start
        extra["frozen_weights"] = args.frozen_weights
    strategy = NVMeOffloadStrategy(args.dir, offload_params=True, state_format="int8", master_format="bf16_sr",
                                   overlap="backward", restore_params=False, **extra)
    starts: list[float] = []
    stats: list[Any] = []
    losses: list[float] = []
    store_bytes: list[int] = []
    phases = PhaseClock()

    def timed_step() -> bool:
        return len(starts) > args.warmup  # the step that just started is a timed one

    class Clock(pl.Callback):
        """Step boundaries, and the phases of each timed step (``PhaseClock``): forward (the closure's forward),
        backward (with ``overlap="backward"`` the updates of the chunks whose gradients are final run inside it),
        after_backward (the rest of the optimizer step: chunks not updated in backward, resident parameters),
        between (Lightning's bookkeeping until the next step starts; the last step's write-backs, fenced)."""

        def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
            store = trainer.strategy.nvme_store  # type: ignore[attr-defined]
            if not starts:
                phases.watch(store, lambda h: ("block_" if h.region.startswith("params/") else "chunk_") + h.kind)
                for off in trainer.strategy.offloaded:  # type: ignore[attr-defined]
                    phases.timed(off.updater, "_run_inner_step", "update")
            stats.append(store.stats)
            starts.append(time.perf_counter())
            phases.mark("forward" if timed_step() else None)
            _log(f"  {args.child}: step {len(starts) - 1} starts (RSS peak {_peak_rss_bytes() / MiB:.0f} MiB)")

        def on_before_backward(self, *_: object) -> None:
            phases.mark("backward" if timed_step() else None)

        def on_after_backward(self, *_: object) -> None:
            phases.mark("after_backward" if timed_step() else None)

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *_: object) -> None:
            phases.mark("between" if timed_step() else None)
            losses.append(float(outputs["loss"]))
            _log(f"  {args.child}: step {len(losses) - 1} loss {losses[-1]:.4f}")

        def on_train_end(self, trainer: pl.Trainer, *_: object) -> None:
            store = trainer.strategy.nvme_store  # type: ignore[attr-defined]
            store.fence(durable=True)  # the last step's write-backs are part of it
            phases.mark(None)
            stats.append(store.stats)
            starts.append(time.perf_counter())
            store_bytes.append(_disk_bytes(args.dir))

    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-true", strategy=strategy, max_steps=n,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Clock()], num_sanity_val_steps=0, limit_val_batches=0)
    t0 = time.perf_counter()
    with trainer.init_module(empty_init=True):
        model = build_module(args.ckpt, block_size=args.seq, lora_rank=args.lora_rank if lora else 0,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr, fused=True),
                             init_seed=args.init_seed)
    t_fit = time.perf_counter()
    if args.data == "fixed":
        from torch.utils.data import DataLoader

        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
        trainer.fit(model, train_dataloaders=DataLoader([batch] * n, batch_size=None))
    else:
        trainer.fit(model, datamodule=data)
    steps = [b - a for a, b in zip(starts[args.warmup:], starts[args.warmup + 1:])]
    moved = [b - a for a, b in zip(stats[args.warmup:], stats[args.warmup + 1:])]
    params = trainer.strategy.param_offload.stats  # type: ignore[attr-defined]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "peak_rss_bytes": _peak_rss_bytes(), "losses": losses, "setup_s": starts[0] - t0,
        "fit_to_first_step_s": starts[0] - t_fit,
        "step_s": statistics.median(steps), "steps_s": steps,
        "bytes_read_per_step": statistics.median(m.bytes_read for m in moved),
        "bytes_written_per_step": statistics.median(m.bytes_written for m in moved),
        "store_wait_s_per_step": statistics.median(m.wait_seconds for m in moved),
        "store_bytes": store_bytes[0], "peak_resident_blocks": params.peak_resident_blocks,
        "phases": phases.as_dict(per=len(steps)), "threads": _threads(),
    }


def _threads() -> dict[str, Any]:
    """The CPU threads this process computes with: torch's intra-op pool, numba's, and the cores it may use."""
    import numba
    import torch

    return {"torch_intra_op": torch.get_num_threads(), "torch_inter_op": torch.get_num_interop_threads(),
            "numba": numba.get_num_threads(), "numba_layer": numba.config.THREADING_LAYER,
            "cores": len(os.sched_getaffinity(0))}


def compute_child(args: argparse.Namespace) -> dict:
    """One block's forward + recompute + backward in memory (bf16), x layers, + embedding/head/loss."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    with open(os.path.join(args.ckpt, "config.json")) as f:
        config = LlamaConfig(**json.load(f))
    config._attn_implementation = "sdpa"  # what from_config picks for the trained model
    torch.manual_seed(0)
    h = config.hidden_size
    with torch.device("cpu"):
        block = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16)
        embed = torch.nn.Embedding(config.vocab_size, h).to(torch.bfloat16)
        norm = LlamaRMSNorm(h, eps=config.rms_norm_eps).to(torch.bfloat16)
        head = torch.nn.Linear(h, config.vocab_size, bias=False).to(torch.bfloat16)
        rotary = LlamaRotaryEmbedding(config)
    ids = torch.randint(0, 256, (args.batch, args.seq))
    x = torch.randn(args.batch, args.seq, h, dtype=torch.bfloat16)
    pos = rotary(x, torch.arange(args.seq).unsqueeze(0))

    forward_s: list[float] = []
    cpu_s: list[float] = []

    def one_block() -> float:
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad():
            block(x, position_embeddings=pos)  # checkpointing's first forward
        forward_s.append(time.perf_counter() - t)
        xi = x.detach().requires_grad_()
        out = block(xi, position_embeddings=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        block.zero_grad(set_to_none=True)
        cpu_s.append(time.process_time() - c)
        return time.perf_counter() - t

    def ends() -> float:
        t = time.perf_counter()
        hid = embed(ids)
        logits = head(norm(hid.detach().requires_grad_()))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        hid.backward(torch.ones_like(hid))
        for m in (embed, norm, head):
            m.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    one_block(), ends()  # warm
    forward_s.clear(), cpu_s.clear()
    block_s = statistics.median(one_block() for _ in range(args.compute_reps))
    ends_s = statistics.median(ends() for _ in range(args.compute_reps))
    block_opt_s = optimizer_seconds(list(block.parameters()), args)
    ends_opt_s = optimizer_seconds([embed.weight, norm.weight, head.weight], args)
    block_gen_s = optimizer_seconds(list(block.parameters()), args, generic=True)
    ends_gen_s = optimizer_seconds([embed.weight, norm.weight, head.weight], args, generic=True)
    return {"block_s": block_s, "block_forward_s": statistics.median(forward_s), "block_cpu_s": statistics.median(cpu_s),
            "ends_s": ends_s, "layers": config.num_hidden_layers,
            "compute_s": block_s * config.num_hidden_layers + ends_s,
            "optimizer_block_s": block_opt_s, "optimizer_ends_s": ends_opt_s,
            "optimizer_s": block_opt_s * config.num_hidden_layers + ends_opt_s,
            "optimizer_generic_s": block_gen_s * config.num_hidden_layers + ends_gen_s}


def optimizer_seconds(params: list, args: argparse.Namespace, generic: bool = False) -> float:
    """The update arithmetic of the training run on ``params`` in memory, no I/O, timed on a second step (the
    first creates the state): AdamW(fused=True) with int8 moments and bf16_sr rounding as the offloaded run
    does it, through the one-pass kernel (``optim/formats/fused_update.py``); ``generic``: as the optimizer's own
    step on decoded fp32 state (``RoundTripOptimizer``), the path without the kernel. The CPU an update
    costs wherever its bytes live; on a machine with few cores it competes with the backward for them."""
    import numpy as np
    import torch

    from lightning_nvme.optim.formats import fused_update
    from lightning_nvme.optim.formats.adamw_kernel import update_blocks
    from lightning_nvme.optim.formats.codec import as_numpy
    from lightning_nvme.optim.formats.state_format import RoundTripOptimizer, StateFormat

    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=args.lr, fused=True)
    block = fused_update.BLOCK

    def kernel_step(step: float) -> None:
        for p, (mc, ms, vc, vs) in zip(params, state):
            n = p.numel() // block
            update_blocks(as_numpy(p.detach().view(-1)[:n * block]), as_numpy(p.grad.view(-1)[:n * block]), mc, ms,
                          vc, vs, step > 1, fused_update.constants(opt.param_groups[0], step), 7, 0, n,
                          fused_update.threads(p.numel()))

    if generic:
        RoundTripOptimizer(opt, StateFormat("int8", "bf16_sr"))
        run = opt.step
    else:
        assert fused_update.plan(opt, StateFormat("int8", "bf16_sr"), {}) is not None, "kernel not verified here"
        state = [(np.zeros(p.numel(), np.int8), np.zeros(p.numel() // block, np.float32),
                  np.zeros(p.numel(), np.uint8), np.zeros(p.numel() // block, np.float32)) for p in params]
        steps = iter(range(1, 1 << 30))
        run = lambda: kernel_step(float(next(steps)))  # noqa: E731
    run()
    times = []
    for _ in range(max(1, args.compute_reps - 1)):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    for p in params:
        p.grad = None
    return statistics.median(times)


# A CPU without AVX512-BF16 (AVX2 only, like the VM of the 7 B runs of 2026-12-02/03), emulated on one that has it:
# oneDNN limited to AVX2 (its bf16 GEMMs gone: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False, so torch
# falls back to ATen's bf16 GEMM and ``_bf16_linear`` routes the input gradient as on that VM), ATen's own
# vectorized kernels at AVX2, and numba's kernels (the optimizer update) compiled for an AVX2 CPU. Environment
# variables, read when torch and numba start: set for the children only.
EMULATE_NO_BF16 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "NUMBA_CPU_NAME": "haswell"}


def child(args: argparse.Namespace) -> dict:
    _imports()
    if args.child == "empty":
        return {"peak_rss_bytes": _peak_rss_bytes()}
    import _bf16_linear
    import torch

    emulated = all(os.environ.get(k) == v for k, v in EMULATE_NO_BF16.items())
    if emulated and not _bf16_linear.needed():
        raise SystemExit("--emulate-no-bf16: oneDNN still reports bf16 support under ONEDNN_MAX_CPU_ISA=AVX2")
    patched = _bf16_linear.install()
    out = compute_child(args) if args.child == "compute" else train_child(args)
    return {**out, "bf16_input_grad_via_forward_kernel": patched, "emulated_no_bf16": emulated,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


# ---- the parent ----------------------------------------------------------------------------------------
def _run_child(args: argparse.Namespace, kind: str) -> dict:
    """``kind`` in a fresh process with its own store directory, deleted afterwards."""
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=f"{kind}-") as store_dir:
        keep = ("seq", "batch", "data", "steps", "warmup", "lr", "lora_rank", "lora_steps", "compute_reps", "ckpt",
                "prefetch_depth", "param_prefetch", "host_memory_budget", "init_seed", "frozen_weights")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, f"--dir={store_dir}",
               *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keep if getattr(args, k, None) is not None]]
        env = dict(os.environ, **EMULATE_NO_BF16) if getattr(args, "emulate_no_bf16", False) else None
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"child {kind} failed with exit code {res.returncode}")
    _log(f"child {kind}: {res.stdout.strip().splitlines()[-1]}")  # kept in the log if a later child fails
    return json.loads(res.stdout.strip().splitlines()[-1])


def _raw(args: argparse.Namespace) -> tuple[float, float]:
    w, r = raw_disk(args.dir, args.raw_mib * MiB)
    _log(f"  raw O_DIRECT: write {w:.2f} GB/s, read {r:.2f} GB/s")
    return w, r


def _compute(args: argparse.Namespace) -> dict:
    compute = _run_child(args, "compute")
    _log(f"compute: block {compute['block_s']:.2f} s x {compute['layers']} + ends {compute['ends_s']:.2f} s "
         f"= {compute['compute_s']:.1f} s; optimizer update in memory {compute['optimizer_s']:.1f} s "
         f"(optimizer's own step: {compute['optimizer_generic_s']:.1f} s)")
    return compute


def _round_ratio(full: dict, computes: list[dict], raws: list[tuple[float, float]]) -> dict:
    """One offloaded run against its neighbours: the mean of the compute references and of the raw disk speeds
    measured just before and just after it. Why: on a shared VM both drift within minutes (the same code's
    compute reference read 34.6 s and 46.2 s hours apart, the disk 1.1-3.2 GB/s), while the step, which
    integrates over its own minutes, moves far less; a bound measured only before the run can flatter or damn it."""
    cpu = statistics.mean(c["compute_s"] + c["optimizer_s"] for c in computes)
    w, r = statistics.mean(x[0] for x in raws), statistics.mean(x[1] for x in raws)
    io = full["bytes_read_per_step"] / (r * 1e9) + full["bytes_written_per_step"] / (w * 1e9)
    return {"step_s": round(full["step_s"], 3), "compute_with_optimizer_s": round(cpu, 3), "io_bound_s": round(io, 3),
            "step_vs_bound_with_optimizer": round(full["step_s"] / max(io, cpu), 3)}


def _check_disk(args: argparse.Namespace, params: int) -> dict:
    """Free space against what the run needs: the checkpoint (unless cached) and the largest store."""
    store = int(params * STORE_BYTES_PER_PARAM * 1.05) + args.raw_mib * MiB
    ckpt = 0 if os.path.isfile(os.path.join(args.ckpt, "config.json")) else 2 * params
    free_store = shutil.disk_usage(args.dir).free
    need = {"store_GB_needed": round(store / 1e9, 1), "checkpoint_GB_needed": round(ckpt / 1e9, 1),
            "free_GB": round(free_store / 1e9, 1)}
    same_disk = os.stat(args.dir).st_dev == os.stat(os.path.dirname(os.path.abspath(args.ckpt))).st_dev
    if (store + ckpt if same_disk else store) > free_store:
        raise SystemExit(f"not enough free disk: {need} (the checkpoint at {args.ckpt}, the store in {args.dir})")
    _log(f"disk: {need}")
    return need


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny Llama of the same architecture (seconds)")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp dir beside the checkout)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint cache (default: <dir>/llama-ckpt, removed "
                   "afterwards unless given)")
    p.add_argument("--seq", type=int, default=8, help="tokens per sequence (compute grows with it, I/O does not)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps per training run")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (the optimizer state is created)")
    p.add_argument("--data", choices=["fixed", "stream"], default="fixed",
                   help="one window repeated every step (the overfit check, default) or a new window per step")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW's lr (1e-5: a usual 7 B finetuning rate)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-steps", type=int, default=None, help="timed steps of the LoRA run (default: --steps)")
    p.add_argument("--compute-reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="offloaded runs, each between two compute references and "
                   "two raw disk measurements (alternating); the ratio is the median over rounds")
    p.add_argument("--raw-mib", type=int, default=2048, help="bytes per raw-disk measurement")
    p.add_argument("--no-lora", action="store_true", help="skip the LoRA run")
    p.add_argument("--prefetch-depth", type=int, default=None, help="the strategy's prefetch_depth (default: its own)")
    p.add_argument("--param-prefetch", type=int, default=None, help="the strategy's param_prefetch (blocks read "
                   "ahead; default: its own)")
    p.add_argument("--host-memory-budget", type=int, default=None, help="the strategy's host_memory_budget in bytes "
                   "(blocks and chunks kept on the shelf in RAM; default: its own, 0)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the 7 B's 32): the 7 B's "
                   "block shape with fewer blocks, for a store of a few GB")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the 7 B's 32000; the byte "
                   "tokens use 256): smaller keeps the embedding and head's share of a few-layer model that of the 7 B")
    p.add_argument("--emulate-no-bf16", action="store_true", help="run the children as on a CPU without "
                   "AVX512-BF16 (AVX2 only): " + " ".join(f"{k}={v}" for k, v in EMULATE_NO_BF16.items()))
    p.add_argument("--child", choices=["empty", "full", "lora", "compute"], help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--init-seed", type=int, default=None, help=argparse.SUPPRESS)  # hf_15b: --ckpt has config.json only
    p.add_argument("--frozen-weights", default=None, help=argparse.SUPPRESS)  # hf_15b: in_place | store
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.smoke:
        args.raw_mib = min(args.raw_mib, 64)
    shape = dict(TINY if args.smoke else LLAMA2_7B)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    if args.vocab is not None:
        shape["vocab_size"] = args.vocab
    tmp = tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-hf7b-")
    args.dir = tmp.name
    args.ckpt = args.ckpt_dir or os.path.join(tmp.name, "llama-ckpt")
    load: list[float] = [os.getloadavg()[0]]
    t_start = time.perf_counter()
    params = sum(_numel(s) for _, s in tensor_shapes(llama_config(shape)))  # meta device: no memory
    disk = _check_disk(args, params)
    written = write_checkpoint(args.ckpt, shape, log=None)
    _log(f"checkpoint {args.ckpt}: {written}")
    empty = _run_child(args, "empty")["peak_rss_bytes"]
    _log(f"empty process (same imports): {empty / MiB:.0f} MiB")
    computes, raws, fulls = [_compute(args)], [_raw(args)], []
    for _ in range(args.rounds):  # reference and subject alternate: compute, full, compute, full, ..., compute
        load.append(os.getloadavg()[0])
        fulls.append(_run_child(args, "full"))
        load.append(os.getloadavg()[0])
        raws.append(_raw(args))
        if args.rounds > 1:
            computes.append(_compute(args))
    full = fulls[-1]  # phases, losses, memory: the last run's
    step = statistics.median(f["step_s"] for f in fulls)  # the step: the median over rounds
    compute = {k: statistics.median(c[k] for c in computes) if isinstance(computes[0][k], float) else computes[0][k]
               for k in computes[0]}
    rounds = [_round_ratio(f, computes[i:i + 2], raws[i:i + 2]) for i, f in enumerate(fulls)]
    lora = None if args.no_lora else _run_child(args, "lora")
    load.append(os.getloadavg()[0])
    if args.ckpt_dir is None:
        shutil.rmtree(args.ckpt)
    tmp.cleanup()
    w = statistics.median(r[0] for r in raws)
    r = statistics.median(r[1] for r in raws)
    io_bound = full["bytes_read_per_step"] / (r * 1e9) + full["bytes_written_per_step"] / (w * 1e9)
    ratios = [x["step_vs_bound_with_optimizer"] for x in rounds]
    need = BYTES_PER_PARAM_PLAIN * full["params"] + empty
    out: dict[str, Any] = {
        "model": "tiny llama (smoke)" if args.smoke else "llama-2-7b shape" if shape == LLAMA2_7B else
                 "llama-2-7b block shape, " + ", ".join(f"{k} {v}" for k, v in shape.items() if LLAMA2_7B[k] != v),
        "params": full["params"],
        "peak_rss_MiB": round(full["peak_rss_bytes"] / MiB, 1),
        "resident_bytes_per_param": round((full["peak_rss_bytes"] - empty) / full["params"], 4),
        "empty_process_MiB": round(empty / MiB, 1),
        "plain_would_need_GiB": round(need / GiB, 2),
        "mem_total_GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 2),
        "store_GiB": round(full["store_bytes"] / GiB, 3), "store_bytes": full["store_bytes"],
        "bytes_read_per_step": full["bytes_read_per_step"],
        "bytes_written_per_step": full["bytes_written_per_step"],
        "step_s": round(step, 4), "steps_s": [round(s, 2) for f in fulls for s in f["steps_s"]],
        "io_bound_s": round(io_bound, 4), "compute_s": round(compute["compute_s"], 4),
        "step_vs_bound": round(step / max(io_bound, compute["compute_s"]), 3),
        # the same with the update's own CPU counted as compute (the compute_s leaves it out)
        "optimizer_s": round(compute["optimizer_s"], 4),
        # the same update through the optimizer's own step on decoded state (no one-pass kernel): before/after
        "optimizer_generic_s": round(compute["optimizer_generic_s"], 4),
        "step_vs_bound_with_optimizer": (round(step / max(io_bound, compute["compute_s"] + compute["optimizer_s"]), 3)
                                         if args.rounds == 1 else round(statistics.median(ratios), 3)),
        # --rounds > 1: each offloaded run against the compute references and raw disk measured either side of it
        "rounds": rounds if args.rounds > 1 else None,
        "step_vs_bound_with_optimizer_spread": spread(ratios) if args.rounds > 1 else None,
        "losses": [round(x, 4) for x in full["losses"]],
        "store_wait_s_per_step": round(full["store_wait_s_per_step"], 2),
        "setup_s": round(full["setup_s"], 1), "peak_resident_blocks": full["peak_resident_blocks"],
        "raw_write_GBps": [round(x[0], 3) for x in raws], "raw_read_GBps": [round(x[1], 3) for x in raws],
        "compute_block_s": round(compute["block_s"], 3), "compute_ends_s": round(compute["ends_s"], 3),
        # of a block's compute: checkpointing's no-grad forward (the forward phase's), and its CPU seconds (all threads)
        "compute_block_forward_s": round(compute["block_forward_s"], 3), "compute_block_cpu_s": round(compute["block_cpu_s"], 3),
        "checkpoint": {**written, **disk},
        "bf16_input_grad_via_forward_kernel": full["bf16_input_grad_via_forward_kernel"],
        "emulated_no_bf16": full["emulated_no_bf16"], "cpu_capability": full["cpu_capability"],
        "phases": full["phases"], "threads": full["threads"],
    }
    if lora is not None:
        out.update({
            "lora_rank": args.lora_rank, "lora_trainable": lora["trainable"], "lora_steps_s": lora["steps_s"],
            "lora_step_s": round(lora["step_s"], 2), "lora_bytes_written_per_step": lora["bytes_written_per_step"],
            "lora_bytes_read_per_step": lora["bytes_read_per_step"],
            "lora_peak_rss_MiB": round(lora["peak_rss_bytes"] / MiB, 1), "lora_losses": [round(x, 4) for x in lora["losses"]],
            "lora_written_vs_full": round(lora["bytes_written_per_step"] / full["bytes_written_per_step"], 5),
            "lora_store_GiB": round(lora["store_bytes"] / GiB, 3),
        })
    load.append(os.getloadavg()[0])
    out.update({"seq": args.seq, "batch": args.batch, "data": args.data, "lr": args.lr, "steps": args.steps, "warmup": args.warmup,
                "load_avg_1min": {"min": min(load), "max": max(load), "samples": [round(x, 2) for x in load]},
                "wall_s": round(time.perf_counter() - t_start, 1)})
    print(json.dumps(out))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    main()
