"""``lightning-nvme``: train a recipe, run the benchmarks, check a store directory.

    lightning-nvme train [recipe=NAME] [key=value ...] [--dry-run]   (no recipe: the default config, nvme_offload)
    lightning-nvme recipes
    lightning-nvme bench [NAME ...]       (runs ./benchmarks/*.py of a source checkout)
    lightning-nvme doctor PATH [...]
    lightning-nvme convert {to-lightning,from-lightning} SRC DST   (lightning_nvme.checkpoint.convert)
    lightning-nvme export CKPT DIR [--config MODEL_DIR] [--merge-adapters]   (a Hugging Face model in the Hub layout)
    lightning-nvme generate MODEL_OR_CKPT --prompt TEXT [--prompt ...] [--batch-file F] --max-new-tokens N
    lightning-nvme eval MODEL_OR_CKPT data=stdlib|docstrings|generated|FILE.txt [--eval-window W] [...]

``generate`` and ``eval`` stream the model's blocks from where they are (a Hugging Face directory read in place, or a
checkpoint's weights), one block in memory at a time, with the figures (tokens/s, bytes read per token).

Config problems (unknown key, wrong type, missing or unwritable store directory) are reported as one
line naming the key and the fix, with exit code 2 and no traceback, before anything is built.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_nvme.checkpoint import convert
from lightning_nvme.checks import ConfigError
from lightning_nvme.doctor import command as doctor

# lightning_nvme.launch is imported where it is used: it needs Hydra, an optional dependency (the "recipes" extra).
EXIT_CONFIG = 2
BENCHMARKS_HELP = ("the benchmarks are scripts in the source repository, not part of the installed package: from a "
                   "checkout, run `lightning-nvme bench` there or `python benchmarks/<name>.py`")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lightning-nvme", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{train,recipes,bench,doctor,convert,export,generate,eval}")
    p_train = sub.add_parser("train", help="train a recipe: train recipe=NAME [key=value ...]")
    p_train.add_argument("--dry-run", action="store_true", help="validate and print the config, do not train")
    p_train.add_argument("overrides", nargs="*", help="recipe=NAME and Hydra overrides (trainer.max_steps=100)")
    sub.add_parser("recipes", help="list the recipes")
    p_bench = sub.add_parser("bench", help="run ./benchmarks/*.py of a source checkout (all, or the names given)")
    p_bench.add_argument("names", nargs="*")
    p_doctor = sub.add_parser("doctor", help="check a store directory: doctor PATH", add_help=False)
    p_doctor.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("convert", help="convert a checkpoint: convert to-lightning SRC DST (one plain Lightning file)",
                   add_help=False).add_argument("rest", nargs=argparse.REMAINDER)
    p_export = sub.add_parser("export", help="a Hugging Face model's checkpoint to the Hub layout (config.json + "
                              "sharded safetensors + index), streamed: export CKPT DIR")
    p_export.add_argument("checkpoint")
    p_export.add_argument("directory")
    p_export.add_argument("--config", help="the directory of the model's config.json (default: the checkpoint's "
                                           "model.path hyperparameter)")
    p_export.add_argument("--max-shard-bytes", type=int, default=None, help="bytes per shard (default 5e9)")
    p_export.add_argument("--merge-adapters", action="store_true",
                          help="a LoRA model: the base with its adapters merged (default: the adapters alone, peft's layout)")
    p_gen = sub.add_parser("generate", help="greedy generation with the blocks streamed: generate MODEL_OR_CKPT "
                           "--prompt TEXT --max-new-tokens N")
    p_gen.add_argument("target", help="a Hugging Face model directory, or a checkpoint file of an HFCausalLM")
    p_gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p_gen.add_argument("--batch-file", help="a file of prompts, one per line (the batch shares each block read)")
    p_gen.add_argument("--max-new-tokens", type=int, default=32)
    p_gen.add_argument("--prefetch", type=int, default=1, help="blocks read ahead")
    p_eval = sub.add_parser("eval", help="loss and perplexity of a dataset with the blocks streamed: eval "
                            "MODEL_OR_CKPT data=stdlib|docstrings|generated|FILE.txt")
    p_eval.add_argument("target", help="a Hugging Face model directory, or a checkpoint file of an HFCausalLM")
    p_eval.add_argument("data", help="data=stdlib, docstrings, generated (the embedded corpora) or a text file")
    p_eval.add_argument("--block-size", type=int, default=128, help="tokens per scored sequence")
    p_eval.add_argument("--batch-size", type=int, default=8)
    p_eval.add_argument("--max-batches", type=int, default=8)
    p_eval.add_argument("--max-bytes", type=int, default=1_000_000, help="corpus size cap")
    p_eval.add_argument("--eval-window", type=int, default=1, help="batches per block read (layer-major)")
    p_eval.add_argument("--store-dir", default=None, help="the strategy's store_dir (nothing is written to it)")
    if argv[:1] == ["doctor"]:  # pass everything through untouched, including --help
        return _doctor(argv[1:])
    if argv[:1] == ["convert"]:
        return convert.main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "train":
        return _train(args.overrides, args.dry_run)
    if args.command == "recipes":
        return _recipes()
    if args.command == "bench":
        return _bench(args.names)
    if args.command == "export":
        return _export(args.checkpoint, args.directory, args.config, args.max_shard_bytes, args.merge_adapters)
    if args.command == "generate":
        return _generate(args)
    if args.command == "eval":
        return _eval(args)
    parser.print_help()
    return EXIT_CONFIG


def _export(checkpoint: str, directory: str, config: str | None, max_shard_bytes: int | None,
            merge_adapters: bool) -> int:
    from lightning_nvme.models.hub_export import MAX_SHARD_BYTES, export_checkpoint

    try:
        files = export_checkpoint(checkpoint, directory, config, max_shard_bytes=max_shard_bytes or MAX_SHARD_BYTES,
                                  merge_adapters=merge_adapters)
    except (ValueError, FileNotFoundError) as e:
        return _config_error(str(e))
    print(f"exported {checkpoint} to {directory}: {', '.join(files)}")
    return 0


def _inference_model(target: str, backend: str, block_size: int | None = None) -> tuple[Any, Any, str | None]:
    """``(HFCausalLM built on the meta device, its weights source or None, checkpoint path or None)`` for a Hugging
    Face directory (its weights read in place) or a checkpoint file of an ``HFCausalLM`` (hyperparameters from it,
    weights from its beside file or the file itself). Refused by name otherwise, before any weight is read."""
    import os

    import torch

    from lightning_nvme.checkpoint import weights
    from lightning_nvme.checkpoint.load import open_checkpoint
    from lightning_nvme.models import HFCausalLM
    from lightning_nvme.params.stream import BesideSource, MappingSource

    if os.path.isdir(target):
        with torch.device("meta"):
            return HFCausalLM(target, block_size=block_size or 1, backend=backend), None, None  # 1: any model
    if not os.path.isfile(target):
        raise FileNotFoundError(f"{target}: neither a model directory (config.json + safetensors) nor a checkpoint file")
    checkpoint, _ = open_checkpoint(target)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    if "path" not in hparams:
        raise ValueError(f"{target}: not a checkpoint of lightning_nvme.models.HFCausalLM (no 'path' hyperparameter); "
                         "streamed inference needs the model's config.json directory")
    hparams["backend"] = backend if backend == "transformers" else hparams.get("backend", "auto")
    if block_size:
        hparams["block_size"] = block_size
    hparams.pop("optimizer", None)
    with torch.device("meta"):
        model = HFCausalLM(**hparams)
    state = checkpoint["state_dict"]
    source = BesideSource(state) if weights.has_refs(checkpoint) else MappingSource(state)
    return model, source, target


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.batch_file:
        with open(args.batch_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts


def _generate(args: argparse.Namespace) -> int:
    import torch

    from lightning_nvme.data.tokenizers import make_tokenizer

    prompts = _prompts(args)
    if not prompts:
        return _config_error("generate: no prompt. Fix: --prompt TEXT (repeatable) or --batch-file FILE")
    try:
        model, source, _ = _inference_model(args.target, "transformers")
        tokenizer = make_tokenizer(str(model.hparams["path"]))
        encoded = [tokenizer.encode(p) for p in prompts]
        too_big = [p for p, ids in zip(prompts, encoded) if ids.numel() and int(ids.max()) >= model.vocab_size]
        if too_big:
            raise ValueError(f"prompt {too_big[0]!r} has token ids beyond the model's vocabulary ({model.vocab_size}): "
                             "the model directory has no tokenizer of its own (bytes were used)")
        width = max(ids.numel() for ids in encoded)
        pad = 0
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(encoded):  # left padding: every prompt ends where generation starts
            input_ids[i, width - ids.numel():] = ids
            mask[i, width - ids.numel():] = 1
        result = model.generate(input_ids, args.max_new_tokens, attention_mask=mask, source=source,
                                prefetch=args.prefetch, pad_token_id=pad)
    except (ValueError, FileNotFoundError, ConfigError) as e:
        return _config_error(str(e))
    for prompt, row in zip(prompts, result.sequences):
        print(f"{prompt!r} -> {tokenizer.decode(row[width:])!r}")
    print(json.dumps({"command": "generate", "target": args.target, "batch": len(prompts), **result.figures()}))
    return 0


def _eval(args: argparse.Namespace) -> int:
    import os

    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_nvme.data.corpus import load_corpus
    from lightning_nvme.data.tokenizers import make_tokenizer
    from lightning_nvme.strategies.nvme_offload import NVMeOffloadStrategy

    key, sep, spec = args.data.partition("=")
    if not sep or key != "data":
        return _config_error(f"eval: expected data=stdlib|docstrings|generated|FILE.txt, got {args.data!r}")
    try:
        if args.eval_window < 1:
            raise ConfigError("eval_window", f"must be an integer >= 1, got {args.eval_window}")
        model, _, ckpt = _inference_model(args.target, "auto", args.block_size)  # a checkpoint: loaded by validate
        tokenizer = make_tokenizer(str(model.hparams["path"]))
        if os.path.isfile(spec):
            with open(spec, encoding="utf-8", errors="replace") as f:
                text = f.read(args.max_bytes)
        else:
            text = load_corpus(spec, args.max_bytes)
        tokens = tokenizer.encode(text)
        n = min(tokens.numel() // (args.block_size + 1), args.max_batches * args.batch_size)
        if n == 0:
            raise ValueError(f"data={spec}: {tokens.numel()} tokens, fewer than one sequence of {args.block_size + 1}")
        seqs = tokens[:n * (args.block_size + 1)].view(n, args.block_size + 1)
        if int(seqs.max()) >= model.vocab_size:
            raise ValueError(f"data={spec}: token ids beyond the model's vocabulary ({model.vocab_size})")
        data = DataLoader(TensorDataset(seqs[:, :-1], seqs[:, 1:]), batch_size=args.batch_size)
        store_dir = args.store_dir or os.path.join(os.getcwd(), "lightning_nvme_eval_store")
        strategy = NVMeOffloadStrategy(store_dir=store_dir, offload_params=True, eval_window=args.eval_window)
        trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False)
        start = time.perf_counter()
        metrics = trainer.validate(model, data, ckpt_path=ckpt, verbose=False)[0]
        seconds = time.perf_counter() - start
    except (ValueError, FileNotFoundError, ConfigError) as e:
        return _config_error(str(e))
    stats = strategy.eval_stats
    scored = n * args.block_size
    figures = {"command": "eval", "target": args.target, "data": spec, "sequences": n, "tokens_scored": scored,
               "loss": float(metrics["val/loss"]), "perplexity": float(metrics["val/ppl"]),
               "seconds": round(seconds, 3), "tokens_per_s": round(scored / seconds, 1),
               "eval_window": args.eval_window, "block_reads": stats.reads if stats else 0,
               "bytes_read": stats.bytes_read if stats else 0,
               "bytes_read_per_token": round((stats.bytes_read if stats else 0) / scored, 1)}
    rows = [("sequences x tokens", f"{n} x {args.block_size}"), ("loss", f"{figures['loss']:.4f}"),
            ("perplexity", f"{figures['perplexity']:.3f}"), ("seconds", f"{seconds:.2f}"),
            ("scored tokens/s", f"{figures['tokens_per_s']}"), ("eval_window", str(args.eval_window)),
            ("block reads", str(figures["block_reads"])), ("bytes read", f"{figures['bytes_read'] / 2**20:.1f} MiB"),
            ("bytes read / token", f"{figures['bytes_read_per_token']:.0f}")]
    print("\n".join(f"| {k:<20} | {v:>16} |" for k, v in rows))
    print(json.dumps(figures))
    return 0


def _config_error(message: str) -> int:
    print(f"lightning-nvme: config error: {message}", file=sys.stderr)
    return EXIT_CONFIG


def _train(overrides: list[str], dry_run: bool) -> int:
    try:
        from lightning_nvme.launch import compose_config, train, validate
        from lightning_nvme.launch.instantiate import to_yaml
    except ModuleNotFoundError as e:
        if e.name not in ("hydra", "omegaconf"):
            raise
        return _config_error(f"`train` composes recipes with Hydra, which is not installed ({e.name}). Fix: "
                             "pip install 'lightning-nvme[recipes,plot]'")
    recipe = None
    rest = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in ("recipe", "recipes"):
            recipe = value
        else:
            rest.append(item)
    try:
        cfg = compose_config(recipe, rest)
        if dry_run:
            validate(cfg)
            print(to_yaml(cfg))
            return 0
        run = train(cfg)
    except ConfigError as e:
        return _config_error(str(e))
    print(f"\nlightning-nvme: finished {cfg.name}: {run.trainer.global_step} steps; logs in {run.trainer.log_dir}")
    return 0


def _recipes() -> int:
    from lightning_nvme.launch.compose import list_recipes, recipe_header

    for name in list_recipes():
        print(f"{name:24s} {recipe_header(name)}")
    print("\nrun one: lightning-nvme train recipe=NAME [key=value ...]")
    return 0


def _bench(names: list[str]) -> int:
    """``bench``: ./benchmarks/run_all.py (the figures table of docs/performance.md); ``bench NAME ...``: each script of
    ``./benchmarks`` in its own process, whose last printed line is a JSON object of figures."""
    bench_dir = Path.cwd() / "benchmarks"
    if not bench_dir.is_dir():
        return _config_error(f"no benchmarks/ directory in {Path.cwd()}: {BENCHMARKS_HELP}")
    if not names and (bench_dir / "run_all.py").is_file():  # docs/performance.md's figures table, with spreads
        return subprocess.run([sys.executable, str(bench_dir / "run_all.py")]).returncode
    scripts = sorted(p for p in bench_dir.glob("*.py") if not p.name.startswith("_"))
    if names:
        wanted = {n.removesuffix(".py") for n in names}
        unknown = wanted - {p.stem for p in scripts}
        if unknown:
            return _config_error(f"unknown benchmark(s) {sorted(unknown)}; available: {[p.stem for p in scripts]}")
        scripts = [p for p in scripts if p.stem in wanted]
    if not scripts:
        return _config_error(f"no benchmark scripts in {bench_dir}")
    results, failed = {}, []
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        print(proc.stdout, end="", flush=True)
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        try:
            results[script.stem] = json.loads(last)
        except json.JSONDecodeError:
            results[script.stem] = None
        if proc.returncode != 0:
            failed.append(script.stem)
        print(f"== {script.stem}: exit {proc.returncode} in {time.perf_counter() - t0:.1f} s", flush=True)
    print(json.dumps({"benchmarks": results, "failed": failed}))
    return 1 if failed else 0


def _doctor(argv: list[str]) -> int:
    return int(doctor.main(argv) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
