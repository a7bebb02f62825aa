"""Benchmark: NVMeActivationOffload on a GPT-style model whose blocks all run under checkpoint.

One Lightning run alternates steps without (A) and with (B) the callback, so both see the same disk
and CPU weather; ratios are medians of per-pair ratios. Saved-activation memory is measured exactly
from the saved-tensor hooks (bytes of saved storages alive, counted until each storage is freed); RSS
is sampled every 5 ms. The last line printed is one JSON object.

    python benchmarks/activation_offload.py [--store-dir DIR] [--pairs 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset

from lightning_nvme.activations import SavedActivationMeter
from lightning_nvme.callbacks import NVMeActivationOffload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _disk import raw_disk, spread  # noqa: E402
from _profile import Counters, pyspy_command, summarize_pyspy  # noqa: E402

MiB = 1 << 20


class Block(nn.Module):
    def __init__(self, d: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, mlp * d), nn.Linear(mlp * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(pl.LightningModule):
    """Every block and the head (final norm, logits, loss) run under non-reentrant checkpoint, so what
    stays saved through the step is exactly the input of each of them."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, mlp: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, mlp) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def _loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return checkpoint(self._loss, x, targets, use_reentrant=False)

    def training_step(self, batch, batch_idx):
        return self(*batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Tokens(Dataset):
    def __init__(self, steps: int, batch: int, seq: int, vocab: int) -> None:
        self.steps, self.shape, self.vocab = steps, (batch, seq), vocab

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        idx = torch.randint(0, self.vocab, self.shape, generator=g)
        return idx, torch.roll(idx, -1, dims=1)


class RSSSampler:
    """Peak resident set size between ``reset`` and ``peak``, sampled from /proc every few ms."""

    def __init__(self, every_s: float = 0.005) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._peak = 0
        self._lock = threading.Lock()  # a sample taken before reset must not land after it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with self._lock:
                self._peak = max(self._peak, self._rss())

    def reset(self) -> None:
        with self._lock:
            self._peak = self._rss()

    def peak(self) -> int:
        with self._lock:
            return max(self._peak, self._rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Alternate(pl.Callback):
    """Even steps: baseline (callback off, pass-through meter on); odd steps: callback on. Times the
    step, forward and backward, and records each step's saved-activation and RSS peaks."""

    def __init__(self, offload: NVMeActivationOffload) -> None:
        self.offload = offload
        self.baseline_meter = SavedActivationMeter()
        self.rss = RSSSampler()
        self.rows: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode = "offload" if batch_idx % 2 else "inmem"
        self.offload.enabled = self.mode == "offload"
        self.rss.reset()
        if self.mode == "inmem":
            self.baseline_meter.meter.reset_peak()
            self.baseline_meter.begin(exclude=[*pl_module.parameters(), *pl_module.buffers()])
        else:
            self.offload.meter.reset_peak()
        store = self.offload.nvme_store
        self.counters = Counters(stores=[store] if store is not None and self.mode == "offload" else [])
        self.counters.__enter__()
        self.t0 = time.perf_counter()

    def on_before_backward(self, trainer, pl_module, loss):
        self.baseline_meter.end()
        self.t1 = time.perf_counter()

    def on_after_backward(self, trainer, pl_module):
        self.t2 = time.perf_counter()

    def record(self) -> None:
        """Called by ``Recorder``, which runs after the offload callback has ended its step."""
        t3 = time.perf_counter()
        self.counters.__exit__(None, None, None)
        row = dict(mode=self.mode, step_s=t3 - self.t0, forward_s=self.t1 - self.t0, backward_s=self.t2 - self.t1,
                   rss_peak=self.rss.peak(), counters=self.counters.as_dict())
        if self.mode == "inmem":
            row["saved_peak"] = self.baseline_meter.meter.peak_bytes
        else:
            stats = self.offload.last_step_stats
            row.update(saved_peak=self.offload.meter.peak_bytes, written=stats.bytes_written, read=stats.bytes_read,
                       io_busy_s=stats.io_busy_s, read_wait_s=stats.read_wait_s, write_wait_s=stats.write_wait_s,
                       misses=stats.misses)
        self.rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "counters"}),
              file=sys.stderr, flush=True)


class Recorder(pl.Callback):
    """Listed after the offload callback, so the step's I/O is drained and its stats are final."""

    def __init__(self, alternate: Alternate) -> None:
        self.alternate = alternate

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.alternate.record()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store-dir", default=os.environ.get("LIGHTNING_NVME_STORE_DIR"))
    p.add_argument("--pairs", type=int, default=3, help="measured (baseline, offload) pairs after one warm-up pair")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--mlp", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=10500)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--keep-last", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a small config to check the script runs")
    p.add_argument("--profile", action="store_true",
                   help="run under py-spy (every thread) and print its top frames per thread to stderr")
    args = p.parse_args()
    if args.profile and pyspy_command("x") and not os.environ.get("_NVME_BENCH_PROFILED"):
        raise SystemExit(profiled(sys.argv))
    if args.quick:
        args.layers, args.batch, args.pairs = 12, 512, 1
    torch.manual_seed(0)
    ckpt_bytes = (args.layers + 1) * args.batch * args.seq * args.d_model * 4
    scratch = None if args.store_dir else tempfile.TemporaryDirectory(prefix="nvme-act-bench-", dir=os.getcwd())
    store_dir = args.store_dir or scratch.name
    offload = NVMeActivationOffload(store_dir=store_dir, prefetch_depth=args.prefetch_depth, keep_last=args.keep_last)
    alternate = Alternate(offload)
    steps = 2 * (args.pairs + 1)
    model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.mlp)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[alternate, offload, Recorder(alternate)],
                         default_root_dir=store_dir)
    t_start = time.perf_counter()
    trainer.fit(model, DataLoader(Tokens(steps, args.batch, args.seq, args.vocab), batch_size=None))
    alternate.rss.stop()

    raw_w, raw_r = raw_disk(store_dir, max(256 * MiB, int(statistics.median(
        r.get("written", 0) for r in alternate.rows if r["mode"] == "offload"))))
    rows = alternate.rows[2:]  # drop the warm-up pair
    inmem = [r for r in rows if r["mode"] == "inmem"]
    off = [r for r in rows if r["mode"] == "offload"]
    med = statistics.median
    inmem_peak, off_peak = med(r["saved_peak"] for r in inmem), med(r["saved_peak"] for r in off)
    result = {
        "config": dict(layers=args.layers, d_model=args.d_model, heads=args.heads, mlp=args.mlp, seq=args.seq,
                       batch=args.batch, prefetch_depth=args.prefetch_depth, keep_last=args.keep_last,
                       store_mode=offload_mode(store_dir)),
        "checkpointed_activation_GiB": round(ckpt_bytes / 2**30, 3),
        "pairs": len(off),
        "saved_bytes_inmem_peak": int(inmem_peak),
        "saved_bytes_offload_peak": int(off_peak),
        "activation_memory_reduction": round(1 - off_peak / inmem_peak, 4),
        "step_ratio": round(med(o["step_s"] / i["step_s"] for i, o in zip(inmem, off)), 4),
        "step_ratio_spread": spread([o["step_s"] / i["step_s"] for i, o in zip(inmem, off)]),
        "step_s_inmem": round(med(r["step_s"] for r in inmem), 3),
        "step_s_offload": round(med(r["step_s"] for r in off), 3),
        "backward_s_inmem": round(med(r["backward_s"] for r in inmem), 3),
        "bytes_written_per_step": int(med(r["written"] for r in off)),
        "bytes_read_per_step": int(med(r["read"] for r in off)),
        "io_vs_backward": round(med(o["io_busy_s"] / i["backward_s"] for i, o in zip(inmem, off)), 4),
        "io_vs_backward_spread": spread([o["io_busy_s"] / i["backward_s"] for i, o in zip(inmem, off)]),
        "raw_write_GBps": round(raw_w, 3),
        "raw_read_GBps": round(raw_r, 3),
        # per step, median over the measured steps: CPU seconds by thread group, page faults, store waits
        "counters": {mode: {k: med(r["counters"][k] for r in rs) for k in rs[0]["counters"]}
                     for mode, rs in (("inmem", inmem), ("offload", off))},
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "read_wait_s_per_step": round(med(r["read_wait_s"] for r in off), 4),
        "write_wait_s_per_step": round(med(r["write_wait_s"] for r in off), 4),
        "prefetch_misses": sum(r["misses"] for r in off),
        "rss_inmem_MiB": round(med(r["rss_peak"] for r in inmem) / MiB, 1),
        "rss_offload_MiB": round(med(r["rss_peak"] for r in off) / MiB, 1),
        "total_s": round(time.perf_counter() - t_start, 1),
    }
    if scratch is not None:
        scratch.cleanup()
    print(json.dumps(result))


def profiled(argv: list[str]) -> int:
    """Re-run this benchmark under py-spy; print its result, then the top frames per thread."""
    os.makedirs(".bench-profile", exist_ok=True)
    raw = os.path.abspath(".bench-profile/activation.pyspy.txt")
    env = dict(os.environ, _NVME_BENCH_PROFILED="1")
    res = subprocess.run(pyspy_command(raw) + [sys.executable, *argv], env=env, stdout=subprocess.PIPE, text=True)
    summary = summarize_pyspy(raw)
    with open(raw.replace(".pyspy.txt", ".txt"), "w") as f:
        f.write(summary)
    print(summary, file=sys.stderr)
    print(next((line for line in reversed(res.stdout.splitlines()) if line.startswith("{")), "{}"))
    return res.returncode


def offload_mode(store_dir: str) -> str:
    from lightning_nvme.store import FlatStore
    probe = FlatStore(store_dir, name="mode-probe", io_chunk_bytes=1 * MiB, staging_bytes=1 * MiB, io_workers=1)
    mode = probe.mode
    probe.close(delete=True)
    return mode


if __name__ == "__main__":
    main()
