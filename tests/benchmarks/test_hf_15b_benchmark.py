"""benchmarks/hf_15b.py runs end to end on a tiny Llama (``--smoke``): the model initialized straight into the store
(no checkpoint), full-finetuned, then LoRA on a checkpoint of the same shape with the base read in place and copied
into the store, and prints the figures #38 items 2 and 3 ask for; a disk too small is refused before anything runs,
naming the bytes and the directory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository
SCRIPT = os.path.join(ROOT, "benchmarks", "hf_15b.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_hf_15b_benchmark_smoke(tmp_path):
    out = run("--smoke", "--dir", str(tmp_path), "--steps", "2", "--warmup", "1", "--seq", "16",
              "--compute-reps", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("params", "peak_rss_MiB", "store_bytes", "step_s", "io_bound_s", "compute_s", "step_vs_bound"):
        assert r[key] > 0, key
    assert r["params"] == r["params_planned"]
    # every weight goes through the store: a step reads each block at least once and writes it back
    assert r["bytes_read_per_step"] > r["params"] and r["bytes_written_per_step"] > r["params"]
    assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
    assert math.isclose(r["compute_s"], r["compute_model_s"] + r["optimizer_s"], rel_tol=0.01, abs_tol=0.002)
    assert math.isclose(r["step_vs_bound"], r["step_s"] / max(r["io_bound_s"], r["compute_s"]), rel_tol=0.02)
    assert r["load_avg_1min"]["samples"] and "avx512_bf16" in r
    # LoRA: the same numbers both ways; in place, the base is not in the store and the start copies nothing
    assert r["lora_losses"] == r["copy_losses"] and all(math.isfinite(x) for x in r["lora_losses"])
    assert 0 < r["lora_store_bytes"] < r["copy_store_bytes"]
    assert r["lora_start_s"] > 0 and r["copy_start_s"] > 0
    assert math.isclose(r["lora_start_vs_copy"], r["lora_start_s"] / r["copy_start_s"], rel_tol=0.001)
    assert 0 < r["lora_written_vs_full"] < 1  # adapters and their state, never the frozen base
    assert 0 < r["lora_trainable"] < r["params"] / 2
    assert os.listdir(tmp_path) == []  # the store and the config directory removed


def test_hf_15b_refuses_a_disk_too_small_naming_bytes_and_path(tmp_path):
    out = run("--shape", "15b", "--no-lora", "--dir", str(tmp_path), "--raw-mib", str(1 << 30))
    assert out.returncode != 0
    assert "not enough free disk in" in out.stderr and str(tmp_path) in out.stderr
    assert "the full finetune's store needs" in out.stderr and "bytes" in out.stderr
    assert os.listdir(tmp_path) == []
