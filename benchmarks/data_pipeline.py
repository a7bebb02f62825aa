"""The finetuning data pipeline on a corpus bigger than it is comfortable to hold: tokenization throughput, the
share of a training step spent waiting for data, and memory while iterating the whole tokenized set.

One run:
  1. writes a JSONL corpus of ``--gb`` GB (``{"text": ...}`` rows of generated prose) under ``--dir``;
  2. tokenizes it once with the ``text`` data group (``TextDataModule``) and the quickstart recipe's tokenizer
     and block size (bytes, 128): ``tokens_per_s`` = tokens / seconds of that pass (reading, JSON, encoding,
     writing the memory-mapped arrays); then builds it again to show the cache is reused (``reuse_s``);
  3. trains the quickstart model (``conf/model/gpt_small.yaml``, batch 16) for ``--steps`` steps reading from
     the cached set: ``data_wait_fraction`` = time in ``next(loader)`` / whole step time (precondition < 0.02);
  4. iterates the whole training set once (every batch, shuffled order, as an epoch does) sampling VmRSS:
     ``rss_growth_MiB`` = peak - the RSS before the epoch (precondition < 200).
The corpus and the cache are deleted at the end (``--keep`` keeps them).

    nice python benchmarks/data_pipeline.py                      # 2 GB, ~10 minutes on 2 busy cores
    python benchmarks/data_pipeline.py --gb 0.05 --steps 5        # a quick check

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORDS = ("the store keeps optimizer state on a local disk and streams it back in chunks so that memory stays flat "
         "while a model larger than the machine trains bitwise equal to plain training every step reads writes "
         "fences blocks layers gradients parameters activations checkpoints recipes tokens batches epochs").split()


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def write_corpus(path: str, nbytes: int, seed: int = 0) -> int:
    """``{"text": ...}`` lines of generated sentences until ``nbytes``; returns the rows written."""
    rng = random.Random(seed)
    pool = []
    for _ in range(512):  # distinct documents, reused with a number so rows differ
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20))).capitalize() + "."
                     for _ in range(rng.randint(5, 40))]
        pool.append(" ".join(sentences))
    written = rows = 0
    with open(path, "w") as f:
        while written < nbytes:
            line = json.dumps({"text": f"Document {rows}. {pool[rows % len(pool)]}"}) + "\n"
            f.write(line)
            written += len(line)
            rows += 1
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.0, help="corpus size in GB (1e9 bytes)")
    p.add_argument("--dir", default=os.path.join(ROOT, ".bench-data"), help="where the corpus and the cache go")
    p.add_argument("--steps", type=int, default=30, help="timed training steps")
    p.add_argument("--keep", action="store_true", help="keep the corpus and the cache")
    args = p.parse_args()

    import torch

    from lightning_nvme.data import TextDataModule
    from lightning_nvme.models import GPTLightningModule

    os.makedirs(args.dir, exist_ok=True)
    corpus, cache = os.path.join(args.dir, "corpus.jsonl"), os.path.join(args.dir, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    result: dict = {"benchmark": "data_pipeline", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_before": os.getloadavg()[0]}
    try:
        t = time.perf_counter()
        result["rows"] = write_corpus(corpus, int(args.gb * 1e9))
        result["corpus_bytes"] = os.path.getsize(corpus)
        result["write_s"] = round(time.perf_counter() - t, 1)
        kw = dict(block_size=128, batch_size=16, tokenizer="byte", cache_dir=cache, val_fraction=0.001)

        t = time.perf_counter()
        dm = TextDataModule(corpus, **kw)
        seconds = time.perf_counter() - t
        stats = dm.train_data.stats
        result.update(tokens=stats.tokens, tokenize_s=round(seconds, 1), tokens_per_s=round(stats.tokens / seconds),
                      tokenize_MB_per_s=round(result["corpus_bytes"] / seconds / 1e6, 1),
                      cache_bytes=sum(os.path.getsize(os.path.join(dm.train_data.directory, f))
                                      for f in os.listdir(dm.train_data.directory)))
        del dm
        t = time.perf_counter()
        dm = TextDataModule(corpus, **kw)
        result["reuse_s"] = round(time.perf_counter() - t, 2)
        assert dm.reused

        torch.manual_seed(0)
        torch.set_num_threads(os.cpu_count() or 1)
        model = GPTLightningModule()  # the quickstart recipe's model (conf/model/gpt_small.yaml)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        loader = iter(dm.train_dataloader())
        wait = total = 0.0
        for step in range(args.steps + 2):
            t0 = time.perf_counter()
            batch = next(loader)
            t1 = time.perf_counter()
            loss = model._loss(batch, model.train_ppl)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if step >= 2:  # the first steps warm up allocators and kernels
                wait, total = wait + (t1 - t0), total + (t2 - t0)
        result.update(data_wait_fraction=round(wait / total, 5), step_ms=round(1000 * total / args.steps, 1),
                      data_wait_ms=round(1000 * wait / args.steps, 3))

        base = peak = rss_mib()
        t = time.perf_counter()
        n = 0
        for n, _batch in enumerate(dm.train_dataloader(), start=1):
            if n % 256 == 0:
                peak = max(peak, rss_mib())
        peak = max(peak, rss_mib())
        result.update(epoch_batches=n, epoch_s=round(time.perf_counter() - t, 1), rss_before_MiB=round(base, 1),
                      rss_peak_MiB=round(peak, 1), rss_growth_MiB=round(peak - base, 1))
        result["load_after"] = os.getloadavg()[0]
        result["preconditions"] = {"data_wait_fraction < 0.02": result["data_wait_fraction"] < 0.02,
                                   "rss_growth_MiB < 200": result["rss_growth_MiB"] < 200}
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
