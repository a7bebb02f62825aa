"""``lightning-nvme``: train a recipe, run the benchmarks, check a store directory.

    lightning-nvme train [recipe=NAME] [key=value ...] [--dry-run]   (no recipe: the default config, nvme_offload)
    lightning-nvme recipes
    lightning-nvme bench [NAME ...]       (runs ./benchmarks/*.py of a source checkout)
    lightning-nvme doctor PATH [...]
    lightning-nvme convert {to-lightning,from-lightning} SRC DST   (lightning_nvme.checkpoint.convert)
    lightning-nvme export CKPT DIR [--config MODEL_DIR] [--merge-adapters]   (a Hugging Face model in the Hub layout)

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
    sub = parser.add_subparsers(dest="command", metavar="{train,recipes,bench,doctor,convert,export}")
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
