"""Quality cost of compressed optimizer state: the same runs, from the same seed, with each format.

Two configurations of the embedded quickstart recipe (a byte-level GPT on Python's stdlib sources):
  quickstart  the recipe as shipped (fp32 params: formats exact, bf16, int8), --steps steps
  long        a smaller GPT in bf16-true trained --long-steps steps (fp32 masters: exact, bf16, int8;
              plus int8 with master_format="bf16_sr"), so quantization errors have time to accumulate
For each run: final train loss (mean of the last 10 steps), val loss and perplexity, and the max
relative deviation of the per-step train-loss curve (raw, and after a 10-step moving average) from the
"exact" run of the same configuration. With --plot, outputs/state_format_quality-<config>.png overlays
the curves (10-step moving average) of every format.

    python benchmarks/state_format_quality.py                       # ~5 min on 2 free cores
    python benchmarks/state_format_quality.py --steps 400 --long-steps 1000
    # the recipe's full length, one process per format (in parallel, or on other machines), then compare;
    # each run appends its loss per step to DIR as it goes, so a run cut short still reports its prefix:
    python benchmarks/state_format_quality.py --steps 400 --val-every 100 --configs quickstart --formats exact --save DIR &
    python benchmarks/state_format_quality.py ... --formats bf16 --save DIR &   # ... and int8
    python benchmarks/state_format_quality.py --report DIR

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = {
    "quickstart": dict(formats=[("exact", "fp32"), ("bf16", "fp32"), ("int8", "fp32")], overrides=[]),
    "long": dict(formats=[("exact", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("int8", "bf16_sr")],
                 overrides=["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "data.batch_size=8",
                            "trainer.precision=bf16-true"]),
}


def train_once(overrides: list[str], store_dir: str, log: str | None = None) -> dict:
    from lightning.pytorch import Callback

    from lightning_nvme.launch import build, compose_config

    cfg = compose_config("quickstart", overrides + [f"strategy.store_dir={store_dir}", "callbacks=none", "logger=none",
                                                   "trainer.enable_progress_bar=false",
                                                   "trainer.enable_model_summary=false",
                                                   "trainer.enable_checkpointing=false",
                                                   f"paths.output_dir={store_dir}/out"])
    run = build(cfg)
    curve: list[float] = []
    val: list[tuple[int, float]] = []

    def append(record: dict) -> None:
        if log is not None:
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            curve.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
            append({"step": len(curve), "loss": curve[-1]})

        def on_validation_end(self, trainer, pl_module):
            if "val/loss" in trainer.callback_metrics and not trainer.sanity_checking:
                val.append((len(curve), float(trainer.callback_metrics["val/loss"])))
                append({"step": len(curve), "val_loss": val[-1][1]})

    run.trainer.callbacks.append(Record())
    t0 = time.perf_counter()
    run.trainer.fit(run.model, datamodule=run.datamodule)
    return {"curve": curve, "val": val, "seconds": time.perf_counter() - t0}


def smooth(xs: list[float], k: int = 10) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def max_rel_dev(a: list[float], ref: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, ref))


def summarize(runs: dict[str, dict], steps: int) -> dict:
    """Each format against "exact", over the steps every run completed (all of them unless one was cut)."""
    ref = runs["exact"]
    n = min(len(r["curve"]) for r in runs.values())
    out: dict = {"steps": steps, "steps_compared": n}
    for label, r in runs.items():
        curve, ref_curve = r["curve"][:n], ref["curve"][:n]
        vals = {s: v for s, v in r["val"] if s <= n}
        ref_vals = {s: v for s, v in ref["val"] if s <= n}
        last = max(set(vals) & set(ref_vals), default=None)
        out[label] = {"final_train_loss": sum(curve[-10:]) / len(curve[-10:]),
                      "val_step": last,
                      "val_loss": vals.get(last), "val_ppl": math.exp(vals[last]) if last else None,
                      "val_loss_vs_exact": vals[last] / ref_vals[last] - 1 if last else None,
                      "max_rel_dev_curve": max_rel_dev(curve, ref_curve),
                      "max_rel_dev_curve_smoothed10": max_rel_dev(smooth(curve), smooth(ref_curve)),
                      "seconds": r.get("seconds")}
    return out


def load_runs(directory: str, name: str) -> dict[str, dict]:
    """The runs of configuration ``name`` that ``--save`` wrote to ``directory`` (possibly cut short)."""
    runs: dict[str, dict] = {}
    for fname in sorted(os.listdir(directory)):
        if fname.startswith(name + "-") and fname.endswith(".jsonl"):
            curve: list[float] = []
            val: list[tuple[int, float]] = []
            with open(os.path.join(directory, fname)) as f:
                for line in f:
                    rec = json.loads(line)
                    if "loss" in rec:
                        curve.append(rec["loss"])
                    elif "val_loss" in rec:
                        val.append((rec["step"], rec["val_loss"]))
            runs[fname[len(name) + 1:-len(".jsonl")]] = {"curve": curve, "val": val}
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="quickstart steps")
    p.add_argument("--long-steps", type=int, default=300)
    p.add_argument("--val-every", type=int, default=None, help="validation every N steps (default: steps / 2)")
    p.add_argument("--configs", default="quickstart,long")
    p.add_argument("--formats", default=None, help="only these labels (e.g. exact,int8+bf16_sr; default: all)")
    p.add_argument("--save", default=None, help="append each run's per-step losses to DIR/<config>-<label>.jsonl")
    p.add_argument("--report", default=None, help="no training: compare the runs saved in DIR")
    p.add_argument("--plot", action="store_true", help="save outputs/state_format_quality-<config>.png (matplotlib)")
    p.add_argument("--dir", default=None, help="store directory (default: a temp dir beside the checkout)")
    args = p.parse_args()
    results: dict = {}
    for name in args.configs.split(","):
        if args.report:
            runs = load_runs(args.report, name)
            if "exact" not in runs:
                continue
            steps = max(len(r["curve"]) for r in runs.values())
        else:
            runs = _train_config(name, args)
            steps = args.steps if name == "quickstart" else args.long_steps
        if "exact" not in runs:
            continue
        results[name] = summarize(runs, steps)
        print(json.dumps({name: results[name]}), file=sys.stderr, flush=True)  # kept if a later config is cut short
        if args.plot:
            os.makedirs(os.path.join(ROOT, "outputs"), exist_ok=True)
            _plot(name, runs, os.path.join(ROOT, "outputs", f"state_format_quality-{name}.png"))
    print(json.dumps(results))


def _train_config(name: str, args: argparse.Namespace) -> dict[str, dict]:
    conf = CONFIGS[name]
    steps = args.steps if name == "quickstart" else args.long_steps
    every = args.val_every or max(1, steps // 2)
    runs = {}
    for state, master in conf["formats"]:
        label = state if master == "fp32" else f"{state}+{master}"
        if args.formats and label not in args.formats.split(","):
            continue
        log = None
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            log = os.path.join(args.save, f"{name}-{label}.jsonl")
            open(log, "w").close()
        with tempfile.TemporaryDirectory(dir=args.dir or ROOT, prefix=".bench-quality-") as tmp:
            r = train_once(conf["overrides"] + [f"trainer.max_steps={steps}", f"data.steps_per_epoch={every}",
                                                f"strategy.state_format={state}",
                                                f"strategy.master_format={master}"], tmp, log)
        runs[label] = {"curve": r["curve"], "val": r["val"], "seconds": r["seconds"]}
        print(f"{name} {label}: final train {sum(r['curve'][-10:]) / 10:.4f} val {r['val'][-1:]} "
              f"({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return runs


def _plot(name: str, runs: dict, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for label, r in runs.items():
        ax.plot(smooth(r["curve"]), label=label, lw=1)
    ax.set_xlabel("step"), ax.set_ylabel("train loss (10-step mean)"), ax.set_title(f"state_format: {name}")
    ax.legend(), ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    print(f"saved {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
