"""nvme_offload_fsdp vs plain DDP on 2 processes (Gloo, CPU): memory and store bytes per rank, step time against
its bound.

2-process jobs (Lightning's own launcher, fresh processes each, so a peak RSS is that run's own) alternate, pair by
pair (the disk and the shared cores drift, so a ratio is only honest between neighbours):
  ddp   Lightning's "ddp": the whole model, gradient and AdamW state in memory on every rank
  fsdp  "nvme_offload_fsdp": each rank's 1/2 of every block, of its gradient and of the AdamW state, in its store
then a 1-process job runs one step of "nvme_offload_fsdp" to measure the single-process store (the baseline of
``store_share_per_rank``). The model is the package's GPT (tied embeddings, ``--layers`` blocks of width ``--embd``).
Peak RSS is the training's: VmHWM reset when training starts (after setup, which builds the model in memory and
shards it: a meta-device build is not supported yet) and read when it ends (before the weights are gathered back).

The bound of an fsdp step is max(compute, each rank's bytes moved / its disk's bandwidth, collective bytes / the
measured bandwidth of the collectives the run used): compute is the ddp step of the same pair (forward, backward,
AdamW on the whole model: an upper estimate of the fsdp rank's compute), the disk bandwidth is this run's raw
read/write of the store's disk, the collectives' bandwidth an all-gather of 64 MiB timed in the job, through Gloo
(``gloo_GBps``) and through shared memory (``shm_GBps``; ``collectives="auto"``, the default, uses it on one host).
Bytes moved per rank and step: its block shards read twice
(forward, backward) and written once, its optimizer state read and written once. Collective bytes per rank: every
block gathered twice and reduce-scattered once, the replicated parameters all-reduced and gathered once, each moving
(N - 1)/N of the tensor per rank.

    python benchmarks/fsdp_offload.py                         # ~55M params, 2 pairs of 4 timed steps
    python benchmarks/fsdp_offload.py --layers 12 --embd 1024 # bigger (store: ~12 bytes/param over both ranks)
    python benchmarks/fsdp_offload.py --no-ddp --meta --checkpointing --layers 32 --embd 2560 --pairs 1 --steps 1  # 2.5 B
    python benchmarks/fsdp_offload.py --no-ddp --meta --checkpointing --vs-backend ...  # + fsdp over Gloo, alternating

``--vs-backend``: each pair also runs fsdp with ``collectives="backend"`` (Gloo) just before its fsdp run;
``step_vs_backend`` is the median of the per-pair step ratios (shared memory ÷ Gloo).

Bigger than memory (``--no-ddp --meta``): plain DDP cannot run (16 bytes/param on each rank), so there is no DDP
step; the model is built on the meta device and initialized block by block into the shards (never whole in
memory). The compute term is then measured in the same job, after the fit, on both ranks at once (they share the
cores as in the fit): forward + backward of one block in memory (same width, batch and tokens) times the number of
blocks, plus the embeddings, tied head and loss, plus AdamW on this rank's 1/N of the parameters (one block's
shard, times the blocks). With DDP pairs this estimate is reported beside the DDP step.

Each rank's disk bandwidth: both ranks share this machine's one disk, so it is measured with both ranks writing and
then reading at once (after the fit, ``--disk-mib`` each, in the store directory): each rank's own GB/s is its
share. The raw single-process figure is reported too.

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
from _disk import peak_rss_mib, raw_disk, spread  # noqa: E402

MiB = 1 << 20


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, so each fit's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _gather_gbps(mode: str, nbytes: int = 64 * MiB, reps: int = 3) -> float:
    """Bytes each rank receives per second in an all-gather of ``nbytes`` (the default group, after a fit), through
    the collectives ``mode`` (``params.comm``: ``"backend"`` is Gloo's sockets, ``"auto"`` shared memory here)."""
    import torch
    import torch.distributed as dist

    from lightning_nvme.params.comm import open_comm

    world = dist.get_world_size()
    comm = open_comm(mode, dist.group.WORLD, torch.device("cpu"), 128 * MiB)
    shard = torch.ones(nbytes // 4 // world)
    out = torch.empty(shard.numel() * world)
    comm.all_gather(out, shard).wait()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        comm.all_gather(out, shard).wait()
    seconds = (time.perf_counter() - t0) / reps
    comm.close()
    return shard.numel() * 4 * (world - 1) / seconds / 1e9


def _compute_estimate(args, world: int) -> dict:
    """Seconds of one rank's compute per step, measured in memory (see the module docstring)."""
    import torch

    from lightning_nvme.models.gpt import Block, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, n_positions=args.tokens, n_embd=args.embd, n_layer=args.layers,
                    n_head=max(1, args.embd // 64))
    block = Block(cfg)
    x = torch.randn(args.batch, args.tokens, args.embd, requires_grad=True)

    def timed(fn, reps: int = 2) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    def block_pass() -> None:
        block.zero_grad(set_to_none=True)
        if args.checkpointing:  # forward, then forward again and backward, as in the fit
            torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
        else:
            block(x).sum().backward()

    t_block = timed(block_pass)
    wte = torch.nn.Embedding(args.vocab, args.embd)
    wpe = torch.nn.Embedding(args.tokens, args.embd)
    idx = torch.randint(0, args.vocab, (args.batch, args.tokens))

    def head_pass() -> None:
        wte.zero_grad(set_to_none=True)
        h = wte(idx) + wpe(torch.arange(args.tokens))
        logits = torch.nn.functional.layer_norm(h, (args.embd,)) @ wte.weight.T
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()

    t_head = timed(head_pass)
    block_numel = sum(p.numel() for p in block.parameters())

    shard = torch.nn.Parameter(torch.zeros(-(-block_numel // world)))
    shard.grad = torch.ones_like(shard)
    opt = make_optimizer(args, [shard])
    t_adam = timed(opt.step)
    outside = (args.vocab + args.tokens) * args.embd + 2 * args.embd
    total = args.layers * (t_block + t_adam) + t_head + t_adam * outside / block_numel
    return {"compute_estimate_s": total, "t_block_fwd_bwd_s": t_block, "t_head_fwd_bwd_s": t_head,
            "t_adamw_block_shard_s": t_adam}


def make_optimizer(args, params):
    """AdamW, the same for ddp, fsdp and the compute estimate. ``adamw_fused`` (default): torch's one-pass CPU kernel
    (``fused=True``), what a CPU user picks: 0.028 s per 39 M-element block shard here against 0.237 s for the
    default per-tensor loop (``adamw``: the benchmark's optimizer before 2026-12-04), ~7 s of each rank's core per
    step at 2.56 B."""
    import torch

    return torch.optim.AdamW(params, lr=1e-4, fused=args.optimizer == "adamw_fused")


def _concurrent_disk(directory: str, nbytes: int) -> tuple[float, float]:
    """This rank's write and read GB/s while every rank does the same at once (a barrier before each)."""
    import torch.distributed as dist
    from _disk import gbps, preallocate, raw_read, raw_write

    path = os.path.join(directory, f"raw-concurrent-{dist.get_rank()}.bin")
    preallocate(path, nbytes)
    try:
        dist.barrier()
        w = gbps(nbytes, raw_write(path, nbytes))
        dist.barrier()
        r = gbps(nbytes, raw_read(path, nbytes))
        dist.barrier()
        return w, r
    finally:
        os.remove(path)


def worker(args) -> None:
    """Runs in every rank (Lightning relaunches this command for the other ranks)."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_nvme  # noqa: F401
    from lightning_nvme import NVMeOffloadFSDPStrategy
    from lightning_nvme.models.gpt import GPT, GPTConfig

    total_steps = args.warmup + args.steps
    g = torch.Generator().manual_seed(0)
    n = total_steps * args.batch * args.world
    x = torch.randint(0, args.vocab, (n, args.tokens + 1), generator=g)
    data = TensorDataset(x[:, :-1], x[:, 1:])

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(vocab_size=args.vocab, n_positions=args.tokens, n_embd=args.embd,
                                       n_layer=args.layers, n_head=max(1, args.embd // 64)),
                             activation_checkpointing=args.checkpointing)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return make_optimizer(args, self.parameters())

        def train_dataloader(self):
            return DataLoader(data, batch_size=args.batch, shuffle=False)

    class Clock(Callback):
        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0

        def on_train_start(self, trainer, *_):
            _reset_peak_rss()

        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == args.warmup:
                trainer.strategy.barrier()
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, *_):
            store = getattr(trainer.strategy, "nvme_store", None)
            if store is not None:
                store.fence(durable=True)
            self.t1 = time.perf_counter()
            self.peak = peak_rss_mib()

    records = []
    gbps: dict[str, float] = {}
    for pair in range(args.pairs):
        for kind in [args.kind]:
            store_dir = os.path.join(args.dir, f"store-{kind}-{pair}")
            # restore_params=False: the weights are not gathered back into each rank's memory after the fit (at
            # 2.5 B that would be 10 GB per rank); the figures are taken before
            strategy = (DDPStrategy() if kind == "ddp" else
                        NVMeOffloadFSDPStrategy(store_dir=store_dir, chunk_bytes=args.chunk_mib << 20, min_free_bytes=0,
                                                inline_weights_bytes=1 << 40, restore_params=False,
                                                collectives="backend" if kind == "fsdp_backend" else args.collectives))
            clock = Clock()
            trainer = Trainer(default_root_dir=args.dir, strategy=strategy, accelerator="cpu", devices=args.world,
                              max_steps=total_steps, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
            if args.meta and kind != "ddp":
                with trainer.init_module(empty_init=True):  # on the meta device: built block by block into the shards
                    model = Model()
            else:
                model = Model()
            trainer.fit(model)
            rec = {"pair": pair, "kind": kind, "rank": trainer.global_rank, "peak_rss_MiB": clock.peak,
                   "step_s": (clock.t1 - clock.t0) / args.steps, "params": sum(p.numel() for p in model.parameters())}
            if kind != "ddp":
                s = trainer.strategy
                path = s.offloaded[0].store_ref.path
                units = s.sharded.units
                rec.update(store_file_bytes=os.path.getsize(path),
                           shard_bytes=sum(u.flat.shard_bytes for u in units),
                           block_bytes=sum(u.flat.total * 4 for u in units),
                           replicated_bytes=sum(f.total * 4 for f in s.sharded.replicated),
                           state_bytes=s.offloaded[0].state_bytes, collectives=s.sharded.io.comm.name)
                os.remove(path)  # the next fit's store: the disk budget holds one at a time
                if args.world > 1:
                    w, r = _concurrent_disk(os.path.dirname(path), args.disk_mib * MiB)
                    rec.update(concurrent_write_GBps=w, concurrent_read_GBps=r)
                    trainer.strategy.barrier()
                    rec.update(_compute_estimate(args, args.world))
            records.append(rec)
            if args.world > 1 and not gbps:
                gbps = {"backend": _gather_gbps("backend"), "shared_memory": _gather_gbps("shared_memory")}
    for rec in records:
        rec["gloo_GBps"], rec["shm_GBps"] = gbps.get("backend", 0.0), gbps.get("shared_memory", 0.0)
    with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump(records, f)
    import torch.distributed as dist

    if dist.is_initialized():  # gloo's threads, left to interpreter exit, can abort it (SIGABRT, "terminate called")
        dist.destroy_process_group()


def _job(args, scratch: str, kind: str, world: int, steps: int, warmup: int, pair: int = 0) -> list[dict]:
    """One fit in fresh processes; each rank's record."""
    out = os.path.join(scratch, f"result-{kind}-w{world}-{pair}")
    forwarded = [a for a in sys.argv[1:]]
    cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", out, "--dir", scratch, "--kind", kind,
           "--world", str(world), "--pairs", "1", "--steps", str(steps), "--warmup", str(warmup)]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"benchmark worker failed with exit code {proc.returncode}")
    records = [json.load(open(f"{out}.rank{r}.json"))[0] for r in range(world)]
    for rec in records:
        rec["pair"] = pair
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--optimizer", default="adamw_fused", choices=["adamw_fused", "adamw"],
                        help="AdamW's fused CPU kernel (default) or torch's per-tensor loop")
    parser.add_argument("--dir", default=None, help="store and scratch directory (default: a temp dir here)")
    parser.add_argument("--no-ddp", action="store_true", help="no plain DDP pairs (a model DDP cannot hold): the "
                        "compute term is the in-job estimate")
    parser.add_argument("--meta", action="store_true", help="build the fsdp model on the meta device")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every block (a "
                        "bigger-than-memory model needs it: without it autograd keeps each block's gathered weights "
                        "from its forward to its backward, F.linear saving a view of the weight)")
    parser.add_argument("--disk-mib", type=int, default=512, help="bytes each rank writes and reads at once")
    parser.add_argument("--collectives", default="auto", choices=["auto", "shared_memory", "backend"],
                        help="the fsdp runs' collectives setting (auto: shared memory on this host)")
    parser.add_argument("--vs-backend", action="store_true", help="each pair also runs fsdp with "
                        "collectives='backend' (Gloo) just before the fsdp run: the step ratio between them, "
                        "alternating")
    parser.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="fsdp", help=argparse.SUPPRESS)
    parser.add_argument("--worker", dest="out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out is not None:
        return worker(args)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-fsdp-") as scratch:
        ranks: list[list[dict]] = [[], []]
        for pair in range(args.pairs):
            kinds = (() if args.no_ddp else ("ddp",)) + (("fsdp_backend",) if args.vs_backend else ()) + ("fsdp",)
            for kind in kinds:
                for rank, rec in enumerate(_job(args, scratch, kind, 2, args.steps, args.warmup, pair)):
                    ranks[rank].append(rec)
        single = _job(args, scratch, "fsdp", 1, 1, 0)[0]
        raw_w, raw_r = raw_disk(scratch, 256 << 20)
    wall = time.perf_counter() - t0

    world = 2
    step: dict[tuple[int, str], float] = {}  # (pair, kind) -> the slower rank's step time
    for recs in ranks:
        for rec in recs:
            key = (rec["pair"], rec["kind"])
            step[key] = max(step.get(key, 0.0), rec["step_s"])
    last = [next(r for r in reversed(recs) if r["kind"] == "fsdp") for recs in ranks]
    ddp_last = [next((r for r in reversed(recs) if r["kind"] == "ddp"), None) for recs in ranks]
    gloo = statistics.median(r["gloo_GBps"] for r in ranks[0] if r["gloo_GBps"])
    shm = statistics.median(r["shm_GBps"] for r in ranks[0] if r["shm_GBps"])
    share = (world - 1) / world
    collective = share * (3 * last[0]["block_bytes"] + 3 * last[0]["replicated_bytes"])
    recs_of = {(r["pair"], r["kind"], rank): r for rank, recs in enumerate(ranks) for r in recs}

    def against_bound(p: int, kind: str) -> tuple[float, float, dict]:
        """(step ÷ bound, bound, its terms) of pair ``p``'s run ``kind``; its collectives at its own comm's speed."""
        this = [recs_of[(p, kind, rank)] for rank in range(world)]
        estimate = max(r["compute_estimate_s"] for r in this)
        compute = estimate if args.no_ddp else step[(p, "ddp")]
        # each rank's bytes over its own bandwidth while both ranks use the disk at once
        disk = max((2 * r["shard_bytes"] + r["state_bytes"]) / (r["concurrent_read_GBps"] * 1e9) +
                   (r["shard_bytes"] + r["state_bytes"]) / (r["concurrent_write_GBps"] * 1e9) for r in this)
        speed = shm if this[0]["collectives"] == "shared_memory" else gloo
        bound = max(compute, disk, collective / (speed * 1e9))
        return step[(p, kind)] / bound, bound, {
            "collectives": this[0]["collectives"], "compute_s": round(compute, 3),
            "compute_estimate_s": round(estimate, 3), "disk_s": round(disk, 3),
            "collective_s": round(collective / (speed * 1e9), 3)}

    bounds, ratios, terms, vs_backend, backend_ratios = [], [], [], [], []
    for p in range(args.pairs):
        ratio, bound, term = against_bound(p, "fsdp")
        bounds.append(bound)
        ratios.append(ratio)
        terms.append(term)
        if args.vs_backend:
            vs_backend.append(step[(p, "fsdp")] / step[(p, "fsdp_backend")])
            backend_ratios.append(against_bound(p, "fsdp_backend")[0])
    params = last[0]["params"]
    for p in range(args.pairs):
        backend = (f"   fsdp over Gloo {step[(p, 'fsdp_backend')]:.2f} s/step (ratio {backend_ratios[p]:.2f})"
                   if args.vs_backend else "")
        print(f"pair {p}: ddp {step.get((p, 'ddp'), float('nan')):.2f} s/step{backend}   nvme_offload_fsdp "
              f"{step[(p, 'fsdp')]:.2f} s/step   bound {bounds[p]:.2f} s   ratio {ratios[p]:.2f}")
    print(json.dumps({
        "world_size": world, "params": params,
        "peak_rss_MiB_per_rank": [round(r["peak_rss_MiB"], 1) for r in last],
        "peak_rss_MiB_per_rank_ddp": [None if r is None else round(r["peak_rss_MiB"], 1) for r in ddp_last],
        "resident_bytes_per_param_per_rank": [round(r["peak_rss_MiB"] * MiB / params, 3) for r in last],
        "store_bytes_per_rank": [r["store_file_bytes"] for r in last],
        "store_bytes_single_process": single["store_file_bytes"],
        "store_share_per_rank": [round(r["store_file_bytes"] / single["store_file_bytes"], 4) for r in last],
        "step_s": round(statistics.median(step[(p, "fsdp")] for p in range(args.pairs)), 3),
        "step_s_ddp": (None if args.no_ddp else round(statistics.median(step[(p, "ddp")] for p in range(args.pairs)), 3)),
        "bound_terms": terms,
        "step_vs_bound": round(statistics.median(ratios), 3), "step_vs_bound_spread": spread(ratios),
        "bound_s": [round(b, 3) for b in bounds],
        "disk_bytes_per_rank_step": [3 * r["shard_bytes"] + 2 * r["state_bytes"] for r in last],
        "collective_bytes_per_rank_step": int(collective), "gloo_GBps": round(gloo, 3), "shm_GBps": round(shm, 3),
        "collectives": terms[0]["collectives"],
        "step_s_backend": ([round(step[(p, "fsdp_backend")], 3) for p in range(args.pairs)] if args.vs_backend
                           else None),
        "step_vs_backend": round(statistics.median(vs_backend), 3) if vs_backend else None,
        "step_vs_backend_spread": spread(vs_backend) if vs_backend else None,
        "step_vs_bound_backend": round(statistics.median(backend_ratios), 3) if backend_ratios else None,
        "raw_write_GBps": round(raw_w, 3), "raw_read_GBps": round(raw_r, 3),
        "concurrent_GBps_per_rank": [[round(r["concurrent_write_GBps"], 3), round(r["concurrent_read_GBps"], 3)]
                                     for r in last],
        "meta_init": args.meta, "checkpointing": args.checkpointing, "layers": args.layers, "embd": args.embd,
        "tokens": args.tokens, "batch": args.batch, "optimizer": args.optimizer,
        "load_avg_1min": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
        "pairs": args.pairs, "timed_steps": args.steps, "wall_s": round(wall, 1),
    }))


if __name__ == "__main__":
    main()
