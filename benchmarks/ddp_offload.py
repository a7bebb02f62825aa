"""nvme_offload_ddp vs plain DDP on 2 processes (Gloo, CPU): per-rank bytes on disk, shard balance, step time.

One 2-process job (started by Lightning's own launcher) alternates, pair by pair (the disk drifts up to 3x
over minutes, so a ratio is only honest between neighbours):
  ddp      Lightning's "ddp", AdamW in memory on every rank
  offload  "nvme_offload_ddp", each rank's 1/2 of the AdamW state in its own store file
Each fit runs ``--warmup`` steps, then ``--steps`` timed steps; the offloaded window ends with a durable
fence of the store (writes are timed through fdatasync). Step time is the slower rank's. Reported: the
median of the per-pair ratios offload / ddp.

    python benchmarks/ddp_offload.py                  # ~8M params, 7 pairs of 30 timed steps, ~2-4 minutes on 2 cores
    python benchmarks/ddp_offload.py --overlap backward

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
from _disk import raw_disk, spread  # noqa: E402
from _profile import Counters, pyspy_command, summarize_pyspy  # noqa: E402


def build(width: int, blocks: int, vocab: int):
    """A transformer-shaped MLP stack: many mid-size matrices, small norms/biases, one large output head."""
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                   torch.nn.Linear(4 * width, width)]
    layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab)]
    return torch.nn.Sequential(*layers)


def worker(args) -> None:
    """Runs in every rank (Lightning relaunches this command for rank 1)."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_nvme  # noqa: F401
    from lightning_nvme import NVMeOffloadDDPStrategy
    from lightning_nvme.optim import plan_chunks

    total_steps = args.warmup + args.steps
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(total_steps * args.batch * 2, args.tokens, args.width, generator=g),
                         torch.randint(0, args.vocab, (total_steps * args.batch * 2, args.tokens), generator=g))

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build(args.width, args.blocks, args.vocab)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return DataLoader(data, batch_size=args.batch, shuffle=False)

    class Clock(Callback):
        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0
            self.counters: Counters | None = None

        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == args.warmup:
                trainer.strategy.barrier()
                store = getattr(trainer.strategy, "nvme_store", None)
                self.counters = Counters(stores=[store] if store is not None else []).__enter__()
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, *_):
            store = getattr(trainer.strategy, "nvme_store", None)
            if store is not None:
                store.fence(durable=True)
            self.t1 = time.perf_counter()
            self.counters.__exit__(None, None, None)

    records = []
    for pair in range(args.pairs):
        for kind in ("ddp", "offload"):
            if kind == "ddp":
                strategy = DDPStrategy()
            else:
                strategy = NVMeOffloadDDPStrategy(store_dir=os.path.join(args.dir, "store"),
                                                  chunk_bytes=args.chunk_mib << 20, min_free_bytes=0,
                                                  overlap=args.overlap)
            clock = Clock()
            trainer = Trainer(default_root_dir=args.dir, strategy=strategy, accelerator="cpu", devices=2,
                              max_steps=total_steps, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
            model = Model()
            trainer.fit(model)
            rec = {"pair": pair, "kind": kind, "rank": trainer.global_rank,
                   "step_s": (clock.t1 - clock.t0) / args.steps, "counters": clock.counters.as_dict(per=args.steps),
                   "params": sum(p.numel() for p in model.parameters())}
            if kind == "offload":
                off = trainer.strategy.offloaded[0]
                path = off.store.path
                rec.update(state_bytes=off.state_bytes, store_file_bytes=os.path.getsize(path),
                           store_allocated_bytes=os.stat(path).st_blocks * 512, io_mode=off.store.mode,
                           single_process_state_bytes=sum(c.nbytes for c in plan_chunks(
                               off.optimizer, args.chunk_mib << 20, "probe").chunks))
            records.append(rec)
    with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump(records, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per fit (10 gave pair ratios 0.79-1.64 under load 5)")
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--overlap", choices=["step", "backward"], default="step")
    parser.add_argument("--dir", default=None, help="store and scratch directory (default: a temp dir here)")
    parser.add_argument("--profile", action="store_true",
                        help="run the 2-rank job under py-spy (every thread of rank 0's process tree); its top "
                             "frames per thread go to stderr and .bench-profile/ddp.txt")
    parser.add_argument("--worker", dest="out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out is not None:
        return worker(args)

    with tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-ddp-") as scratch:
        out = os.path.join(scratch, "result")
        cmd = [sys.executable, os.path.abspath(__file__), *[a for a in sys.argv[1:] if a != "--profile"],
               "--worker", out, "--dir", scratch]
        raw_profile = os.path.join(ROOT, ".bench-profile", "ddp.pyspy.txt")
        if args.profile and pyspy_command(raw_profile):
            os.makedirs(os.path.dirname(raw_profile), exist_ok=True)
            cmd = pyspy_command(raw_profile)[:-1] + ["--subprocesses", "--"] + cmd
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
        env.setdefault("OMP_NUM_THREADS", "1")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-5000:])
            raise SystemExit(f"benchmark worker failed with exit code {proc.returncode}")
        ranks = [json.load(open(f"{out}.rank{r}.json")) for r in range(2)]
        wall = time.perf_counter() - t0
        raw_w, raw_r = raw_disk(scratch, 256 << 20)
    if args.profile and os.path.exists(raw_profile):
        summary = summarize_pyspy(raw_profile)
        with open(raw_profile.replace(".pyspy.txt", ".txt"), "w") as f:
            f.write(summary)
        print(summary, file=sys.stderr)

    step = {}  # (pair, kind) -> the slower rank's step time
    for recs in ranks:
        for rec in recs:
            key = (rec["pair"], rec["kind"])
            step[key] = max(step.get(key, 0.0), rec["step_s"])
    ratios = [step[(p, "offload")] / step[(p, "ddp")] for p in range(args.pairs)]
    last = [next(r for r in reversed(recs) if r["kind"] == "offload") for recs in ranks]
    per_rank = [r["state_bytes"] for r in last]
    mean = sum(per_rank) / len(per_rank)
    for p in range(args.pairs):
        print(f"pair {p}: ddp {step[(p, 'ddp')] * 1e3:7.1f} ms/step   nvme_offload_ddp "
              f"{step[(p, 'offload')] * 1e3:7.1f} ms/step   ratio {ratios[p]:.2f}")
    for rank, r in enumerate(last):
        print(f"rank {rank}: {r['state_bytes'] / 2**20:.1f} MiB of state, "
              f"store file {r['store_file_bytes'] / 2**20:.1f} MiB "
              f"({r['store_allocated_bytes'] / 2**20:.1f} MiB allocated, {r['io_mode']} I/O)")
    print(json.dumps({
        "world_size": 2, "params": last[0]["params"], "overlap": args.overlap,
        "state_bytes_total": sum(per_rank),
        "state_bytes_single_process": last[0]["single_process_state_bytes"],
        "state_bytes_per_rank": per_rank,
        "state_bytes_per_rank_max": max(per_rank),
        "store_file_bytes_per_rank": [r["store_file_bytes"] for r in last],
        "shard_balance": round(max(per_rank) / mean, 4),
        "step_ms_ddp_median": round(statistics.median(step[(p, "ddp")] for p in range(args.pairs)) * 1e3, 1),
        "step_ms_offload_median": round(statistics.median(step[(p, "offload")] for p in range(args.pairs)) * 1e3, 1),
        "step_ratio_vs_ddp": round(statistics.median(ratios), 3),
        "step_ratio_vs_ddp_spread": spread(ratios),
        "raw_write_GBps": round(raw_w, 3), "raw_read_GBps": round(raw_r, 3),
        # rank 0, per step, median over pairs: CPU seconds by thread group, page faults, store waits
        "counters_rank0": {kind: {k: statistics.median(r["counters"][k] for r in ranks[0] if r["kind"] == kind)
                                  for k in next(r for r in ranks[0] if r["kind"] == kind)["counters"]}
                           for kind in ("ddp", "offload")},
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "pair_ratios": [round(r, 3) for r in ratios], "pairs": args.pairs, "timed_steps": args.steps,
        "wall_s": round(wall, 1),
    }))


if __name__ == "__main__":
    main()
