"""benchmarks/hf_7b_eval.py runs end to end on a tiny Llama (``--smoke``) and prints the figures #35 asks for."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def test_hf_7b_eval_benchmark_smoke(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hf_7b_eval.py"), "--smoke", "--dir",
                          str(tmp_path), "--sequences", "8", "--seq", "16", "--batch", "2", "--gen-tokens", "3",
                          "--gen-batches", "1,4", "--raw-mib", "64"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("params", "peak_rss_MiB", "tokens_per_s", "eval_vs_bound", "compute_s", "raw_read_GBps"):
        assert r[key] > 0, key
    assert r["windows"] == 1 and r["block_reads"] == 2  # 4 batches in one window: each of the 2 blocks read once
    assert math.isclose(r["eval_vs_bound"], r["eval_s"] / max(r["compute_s"], r["disk_bound_s"]), rel_tol=0.02)
    assert set(r["generate_tokens_per_s"]) == {"1", "4"} and all(v > 0 for v in r["generate_tokens_per_s"].values())
    # a batch of 4 shares each block read: a quarter of the bytes per token of batch 1
    assert r["generate_bytes_read_per_token"]["4"] * 4 == r["generate_bytes_read_per_token"]["1"]
    assert math.isfinite(r["loss"])
    assert os.listdir(tmp_path) == []  # the checkpoint (no --ckpt-dir) and the scratch removed
