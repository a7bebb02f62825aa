"""Parameter offload (#12): memory flat in model size, and the offloaded step vs the larger of disk and compute.

Two (or more) GPT sizes at one width, differing only in depth (``--sizes`` layer counts: same block size,
so what grows is the number of blocks). Each configuration runs in a fresh process (its peak RSS is its own):

  empty    the same imports, nothing else: the interpreter + torch + Lightning baseline RSS
  offload  meta-device build (``configure_model``), ``NVMeOffloadStrategy(offload_params=True,
           overlap="backward")`` + ``NVMeActivationOffload``, activation checkpointing, AdamW fp32
  plain    Lightning's default strategy, same model, same activation checkpointing (smallest size only:
           it must fit in memory), alternating with ``offload`` pair by pair
  state    (``--state-offload``, smallest size) optimizer state offloaded, parameters in memory
           (``offload_params=False``, ``overlap="backward"``): the middle row of the memory table

Between the children the raw O_DIRECT write and read speed of the store's disk is measured
(``_disk.raw_disk``), so each step's I/O lower bound uses this run's disk speed:
``io_bound_s = bytes_read / raw_read + bytes_written / raw_write`` (the store's own counters, per step).
Step time: median interval between consecutive training-step starts after ``--warmup`` steps (the first
step creates the optimizer state); writes of step k drain during step k+1, as in training.

``plain_would_need_GiB`` = 16 B/param (fp32 weights, gradients, AdamW exp_avg and exp_avg_sq) + the empty
process's RSS: a lower bound for plain training (activations, the loss's logits and allocator slack come on
top; the measured plain peak at the smaller size shows how much).

    python benchmarks/bigger_than_memory.py                        # 7 and 32 layers at width 2560 (~0.55 B, ~2.5 B)
    python benchmarks/bigger_than_memory.py --sizes 2,8 --width 256 --steps 2 --pairs 1   # a smoke run

Every run above measures the memory floor: ``host_memory_budget=0`` (passed explicitly). ``--budgets`` instead
measures the shelf (#25, docs/shelf.md): at the small size budget 0, "everything fits" and plain Lightning,
alternating (plain, 0, all, plain, 0, all, ...); at the larger sizes each budget given, alternating. Each
record of the JSON's ``budgets`` list: ``params``, ``budget_bytes``, the bytes the plan put in RAM and on the
SSD, ``peak_rss_MiB``, ``bytes_per_step``, ``step_s``, ``io_bound_s``, and the medians of per-pair ratios to
budget 0 (and to plain, at the small size).

    python benchmarks/bigger_than_memory.py --sizes 7 --budgets 0,8G,16G       # 0.55 B: 0, all, plain

Progress goes to stderr; the last line of stdout is one JSON object.
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
from _disk import GiB, MiB, raw_disk, spread  # noqa: E402

BYTES_PER_PARAM_PLAIN = 16  # fp32 AdamW: weight + gradient + exp_avg + exp_avg_sq


def _imports() -> None:
    """What every child imports, the empty one included (its RSS is the baseline)."""
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401

    import lightning_nvme.callbacks  # noqa: F401
    import lightning_nvme.models  # noqa: F401
    import lightning_nvme.strategies  # noqa: F401


def _peak_rss_bytes() -> int:
    from lightning_nvme.memory import peak_rss_bytes  # VmHWM: ru_maxrss would include the parent's RSS

    return peak_rss_bytes()


def child(args: argparse.Namespace) -> dict:
    _imports()
    if args.child == "empty":
        return {"peak_rss_bytes": _peak_rss_bytes()}
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_nvme.callbacks import NVMeActivationOffload
    from lightning_nvme.models import GPTLightningModule
    from lightning_nvme.strategies import NVMeOffloadStrategy

    torch.manual_seed(0)
    n = args.warmup + args.steps
    tokens = torch.randint(0, 256, (n * args.batch, args.seq + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    offload = args.child == "offload"
    state_only = args.child == "state"
    model = GPTLightningModule(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                               n_embd=args.width, activation_checkpointing=True, empty_init=offload,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    starts: list[float] = []
    cpu: list[float] = []  # process CPU time (all threads): what a step costs whatever else loads the machine
    stats: list = []
    strategy: object = "auto"
    callbacks: list = []
    budget = _budget_bytes(args.host_memory_budget)
    if offload:
        strategy = NVMeOffloadStrategy(args.dir, offload_params=True, overlap="backward", restore_params=False,
                                       param_prefetch=args.param_prefetch, host_memory_budget=budget)
        callbacks.append(NVMeActivationOffload(args.dir, min_bytes=args.act_min_bytes))
    elif state_only:
        strategy = NVMeOffloadStrategy(args.dir, overlap="backward", host_memory_budget=budget)

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
            store = getattr(trainer.strategy, "nvme_store", None)
            stats.append(store.stats if store is not None else None)
            starts.append(time.perf_counter())
            cpu.append(time.process_time())
            print(f"  {args.child} L={args.layers}: step {len(starts) - 1} starts", file=sys.stderr, flush=True)

        def on_train_end(self, trainer: pl.Trainer, *_: object) -> None:
            store = getattr(trainer.strategy, "nvme_store", None)
            if store is not None:
                store.fence(durable=True)  # the last step's write-backs are part of it
            stats.append(store.stats if store is not None else None)
            starts.append(time.perf_counter())
            cpu.append(time.process_time())

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=n, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[*callbacks, Clock()], num_sanity_val_steps=0, limit_val_batches=0)
    t0 = time.perf_counter()
    trainer.fit(model, train_dataloaders=data)
    setup_s = starts[0] - t0
    steps = [b - a for a, b in zip(starts[args.warmup:], starts[args.warmup + 1:])]
    out: dict = {"params": sum(p.numel() for p in model.parameters()), "peak_rss_bytes": _peak_rss_bytes(),
                 "step_s": statistics.median(steps), "steps_s": steps, "setup_s": setup_s,
                 "cpu_s": statistics.median(b - a for a, b in zip(cpu[args.warmup:], cpu[args.warmup + 1:]))}
    print(f"  {args.child} L={args.layers}: step {out['step_s']:.2f}s wall, {out['cpu_s']:.2f}s CPU", file=sys.stderr,
          flush=True)
    if offload:
        moved = [b - a for a, b in zip(stats[args.warmup:], stats[args.warmup + 1:])]
        out["bytes_read_per_step"] = statistics.median(m.bytes_read for m in moved)
        out["bytes_written_per_step"] = statistics.median(m.bytes_written for m in moved)
        params = trainer.strategy.param_offload.stats  # type: ignore[attr-defined]
        out["peak_resident_blocks"] = params.peak_resident_blocks
        out["peak_resident_block_MiB"] = params.peak_resident_bytes / MiB
        out["store_wait_s_per_step"] = statistics.median(m.wait_seconds for m in moved)
        out["placement"] = trainer.strategy.shelf_plan.as_dict()  # type: ignore[attr-defined]
    return out


def _budget_bytes(text: str) -> int:
    """``--budgets`` items: bytes, ``8G``/``512M``, or ``all``: what is available now less 2 GiB (the plan
    then takes everything the model has, if it fits)."""
    from lightning_nvme.memory import available_host_memory

    if text == "all":
        return max(0, available_host_memory() - 2 * GiB)
    units = {"G": GiB, "M": MiB, "K": 1024}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _run_child(args: argparse.Namespace, kind: str, layers: int, budget: str = "0") -> dict:
    """One configuration in a fresh process with its own store directory, deleted afterwards (a 2.5 B
    model's store is ~30 GB; the next child must not find it)."""
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=f"{kind}-") as store_dir:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--layers", str(layers)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("child", "layers", "sizes", "pairs", "dir", "state_offload", "budgets", "host_memory_budget")
            and v is not None] + [f"--dir={store_dir}", f"--host-memory-budget={budget}"]
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    if res.returncode != 0:
        raise SystemExit(f"child {kind} (layers={layers}) failed with exit code {res.returncode}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _raw(args: argparse.Namespace, nbytes: int) -> tuple[float, float]:
    w, r = raw_disk(args.dir, max(8 * MiB, min(nbytes, args.raw_max_mib * MiB)))
    print(f"  raw O_DIRECT: write {w:.2f} GB/s, read {r:.2f} GB/s", file=sys.stderr, flush=True)
    return w, r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="7,32", help="layer counts, comma-separated; the first is the small size "
                   "(also trained plain, so it must fit in memory)")
    p.add_argument("--width", type=int, default=2560, help="n_embd")
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=1, help="timed steps per child (the last one through a durable fence)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (optimizer state created)")
    p.add_argument("--pairs", type=int, default=2, help="plain/offload pairs at the small size (one run per larger size)")
    p.add_argument("--param-prefetch", type=int, default=1)
    p.add_argument("--act-min-bytes", type=int, default=64 * 1024,
                   help="NVMeActivationOffload min_bytes: a block input of seq x width fp32 must reach it")
    p.add_argument("--raw-max-mib", type=int, default=2048, help="bytes per raw-disk measurement, at most")
    p.add_argument("--dir", default=None, help="store directory (default: a temp dir beside the checkout)")
    p.add_argument("--state-offload", action="store_true", help="also the optimizer-state-only offload at the "
                   "small size (peak RSS and step time: the memory table's middle row)")
    p.add_argument("--budgets", default=None, help="host_memory_budget values, comma-separated (bytes, 8G, 512M): "
                   "measure the shelf instead of the memory floor (see above)")
    p.add_argument("--host-memory-budget", default="0", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=["empty", "offload", "plain", "state"], help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    tmp = tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-big-")
    args.dir = tmp.name
    sizes = [int(s) for s in args.sizes.split(",")]
    load: list[float] = [os.getloadavg()[0]]
    t_start = time.perf_counter()
    empty = _run_child(args, "empty", sizes[0])["peak_rss_bytes"]
    print(f"empty process (same imports): {empty / MiB:.0f} MiB", file=sys.stderr, flush=True)
    mem_total = _mem_total()
    if args.budgets is not None:
        return _budgets(args, sizes, empty, load, t_start, tmp)
    results = []
    for i, layers in enumerate(sizes):
        pairs = args.pairs if i == 0 else 1
        rows = []
        for pair in range(pairs):
            print(f"size {layers} layers, pair {pair}", file=sys.stderr, flush=True)
            plain = _run_child(args, "plain", layers) if i == 0 else None
            state = _run_child(args, "state", layers) if i == 0 and args.state_offload else None
            load.append(os.getloadavg()[0])
            off = _run_child(args, "offload", layers)
            w, r = _raw(args, off["bytes_read_per_step"])
            load.append(os.getloadavg()[0])
            bound = off["bytes_read_per_step"] / (r * 1e9) + off["bytes_written_per_step"] / (w * 1e9)
            rows.append({"off": off, "plain": plain, "state": state, "raw_write_GBps": w, "raw_read_GBps": r, "io_bound_s": bound})
            print(f"  offload step {off['step_s']:.2f}s (I/O bound {bound:.2f}s, {off['peak_rss_bytes'] / MiB:.0f} MiB "
                  f"peak)" + (f" | plain step {plain['step_s']:.2f}s ({plain['peak_rss_bytes'] / MiB:.0f} MiB peak)"
                              if plain else ""), file=sys.stderr, flush=True)
        results.append(_summarize(layers, rows, empty, mem_total))
    tmp.cleanup()
    load.append(os.getloadavg()[0])
    small = results[0]
    out = {
        "sizes": results,
        "empty_process_MiB": round(empty / MiB, 1),
        "mem_total_GiB": round(mem_total / GiB, 2),
        "peak_rss_ratio_large_vs_small": round(results[-1]["peak_rss_MiB"] / small["peak_rss_MiB"], 3),
        "params_ratio_large_vs_small": round(results[-1]["params"] / small["params"], 3),
        "step_vs_bound_small": small.get("step_vs_bound"),
        "width": args.width, "seq": args.seq, "batch": args.batch, "steps": args.steps, "pairs": args.pairs,
        "load_avg_1min": {"min": min(load), "max": max(load), "samples": [round(x, 2) for x in load]},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(out))


def _budgets(args: argparse.Namespace, sizes: list[int], empty: int, load: list[float], t_start: float,
             tmp: tempfile.TemporaryDirectory) -> None:
    """The shelf: per size, the budgets alternating pair by pair (the small size: 0, all and plain)."""
    records = []
    for i, layers in enumerate(sizes):
        budgets = ["0", "all"] if i == 0 else args.budgets.split(",")
        runs: dict[str, list[dict]] = {b: [] for b in budgets}
        plain: list[dict] = []
        for pair in range(args.pairs):
            print(f"size {layers} layers, pair {pair}", file=sys.stderr, flush=True)
            if i == 0:
                plain.append(_run_child(args, "plain", layers))
                print(f"  plain step {plain[-1]['step_s']:.2f}s", file=sys.stderr, flush=True)
            for b in budgets:
                off = _run_child(args, "offload", layers, b)
                w, r = _raw(args, max(off["bytes_read_per_step"], 8 * MiB))
                load.append(os.getloadavg()[0])
                off["io_bound_s"] = off["bytes_read_per_step"] / (r * 1e9) + off["bytes_written_per_step"] / (w * 1e9)
                runs[b].append(off)
                print(f"  budget {b}: step {off['step_s']:.2f}s (I/O bound {off['io_bound_s']:.2f}s), "
                      f"{(off['bytes_read_per_step'] + off['bytes_written_per_step']) / 1e9:.2f} GB/step, "
                      f"{off['placement']['shelf_bytes'] / GiB:.2f} GiB in RAM, peak {off['peak_rss_bytes'] / MiB:.0f} MiB",
                      file=sys.stderr, flush=True)
        med = statistics.median
        for b, offs in runs.items():
            rec: dict = {
                "layers": layers, "params": offs[0]["params"], "budget": b,
                "budget_bytes": offs[0]["placement"]["budget_bytes"],
                "ram_bytes": offs[0]["placement"]["shelf_bytes"], "ssd_bytes": offs[0]["placement"]["ssd_bytes"],
                "peak_rss_MiB": round(max(o["peak_rss_bytes"] for o in offs) / MiB, 1),
                "bytes_per_step": med(o["bytes_read_per_step"] + o["bytes_written_per_step"] for o in offs),
                "planned_bytes_per_step": offs[0]["placement"]["io_bytes_per_step_after"],
                "step_s": round(med(o["step_s"] for o in offs), 3),
                "cpu_s_per_step": round(med(o.get("cpu_s", float("nan")) for o in offs), 3),
                "io_bound_s": round(med(o["io_bound_s"] for o in offs), 3),
                "step_vs_budget0": spread([o["step_s"] / z["step_s"] for o, z in zip(offs, runs[budgets[0]])]),
            }
            if plain:
                rec["plain_step_s"] = round(med(q["step_s"] for q in plain), 3)
                rec["plain_cpu_s_per_step"] = round(med(q.get("cpu_s", float("nan")) for q in plain), 3)
                rec["plain_peak_rss_MiB"] = round(max(q["peak_rss_bytes"] for q in plain) / MiB, 1)
                rec["step_vs_plain"] = spread([o["step_s"] / q["step_s"] for o, q in zip(offs, plain)])
            records.append(rec)
    tmp.cleanup()
    load.append(os.getloadavg()[0])
    print(json.dumps({"budgets": records, "empty_process_MiB": round(empty / MiB, 1), "width": args.width,
                      "seq": args.seq, "batch": args.batch, "steps": args.steps, "pairs": args.pairs,
                      "load_avg_1min": {"min": min(load), "max": max(load), "samples": [round(x, 2) for x in load]},
                      "wall_s": round(time.perf_counter() - t_start, 1)}))


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _summarize(layers: int, rows: list[dict], empty: int, mem_total: int) -> dict:
    med = statistics.median
    off = [r["off"] for r in rows]
    params = off[0]["params"]
    peak = max(o["peak_rss_bytes"] for o in off)
    need = BYTES_PER_PARAM_PLAIN * params + empty
    res: dict = {
        "layers": layers,
        "params": params,
        "peak_rss_MiB": round(peak / MiB, 1),
        "resident_bytes_per_param": round((peak - empty) / params, 4),
        "plain_would_need_GiB": round(need / GiB, 2),
        "plain_would_need_vs_ram": round(need / mem_total, 3),
        "bytes_read_per_step": med(o["bytes_read_per_step"] for o in off),
        "bytes_written_per_step": med(o["bytes_written_per_step"] for o in off),
        "bytes_per_step": med(o["bytes_read_per_step"] + o["bytes_written_per_step"] for o in off),
        "step_s": round(med(o["step_s"] for o in off), 3),
        "io_bound_s": round(med(r["io_bound_s"] for r in rows), 3),
        "raw_read_GBps": round(med(r["raw_read_GBps"] for r in rows), 3),
        "raw_write_GBps": round(med(r["raw_write_GBps"] for r in rows), 3),
        "store_wait_s_per_step": round(med(o["store_wait_s_per_step"] for o in off), 3),
        "peak_resident_blocks": max(o["peak_resident_blocks"] for o in off),
        "setup_s": round(med(o["setup_s"] for o in off), 1),
    }
    if rows[0]["plain"] is not None:
        plain = [r["plain"] for r in rows]
        ratios = [r["off"]["step_s"] / max(r["io_bound_s"], r["plain"]["step_s"]) for r in rows]
        res.update({
            "plain_step_s": round(med(q["step_s"] for q in plain), 3),
            "plain_peak_rss_MiB": round(max(q["peak_rss_bytes"] for q in plain) / MiB, 1),
            "step_vs_bound": spread(ratios),
            "step_vs_plain": spread([r["off"]["step_s"] / r["plain"]["step_s"] for r in rows]),
            "plain_resident_bytes_per_param": round((max(q["peak_rss_bytes"] for q in plain) - empty) / params, 3),
        })
    if rows[0].get("state") is not None:
        peak_state = max(r["state"]["peak_rss_bytes"] for r in rows)
        res.update({"state_offload_peak_rss_MiB": round(peak_state / MiB, 1),
                    "state_offload_resident_bytes_per_param": round((peak_state - empty) / params, 3),
                    "state_offload_step_s": round(med(r["state"]["step_s"] for r in rows), 3)})
    return res


if __name__ == "__main__":
    main()
