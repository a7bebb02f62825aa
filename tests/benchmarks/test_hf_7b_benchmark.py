"""benchmarks/hf_7b.py runs end to end on a tiny Llama (``--smoke``) and prints every figure #21 item 5 asks for."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def test_hf_7b_benchmark_smoke(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hf_7b.py"), "--smoke", "--dir", str(tmp_path),
                          "--steps", "2", "--warmup", "1", "--seq", "16", "--compute-reps", "1"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("params", "peak_rss_MiB", "resident_bytes_per_param", "plain_would_need_GiB", "store_bytes",
                "bytes_read_per_step", "bytes_written_per_step", "step_s", "io_bound_s", "compute_s", "step_vs_bound",
                "lora_step_s", "lora_bytes_written_per_step", "lora_peak_rss_MiB"):
        assert r[key] > 0, key
    assert r["store_GiB"] == round(r["store_bytes"] / 2**30, 3)
    # every weight goes through the store: a step reads each block at least once and writes it back
    assert r["bytes_read_per_step"] > 2 * r["params"] * 0.5 and r["bytes_written_per_step"] > r["params"]
    assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
    assert 0 < r["lora_trainable"] < r["params"] / 2
    # LoRA writes the adapters and their moments, never the frozen base
    assert r["lora_bytes_written_per_step"] < r["bytes_written_per_step"]
    # the ratio of the unrounded figures: step_s, io_bound_s and compute_s are printed to 4 decimals (the ratio to 3),
    # so it lies within what their rounding allows (a smoke step's compute of ~0.005 s is then several % off)
    half = 0.5e-4
    bound = max(r["io_bound_s"], r["compute_s"])
    low, high = (r["step_s"] - half) / (bound + half), (r["step_s"] + half) / (bound - half)
    assert low - 0.5e-3 <= r["step_vs_bound"] <= high + 0.5e-3, (r["step_vs_bound"], low, high)
    assert r["load_avg_1min"]["samples"]
    assert os.listdir(tmp_path) == []  # stores and the checkpoint (no --ckpt-dir) removed
