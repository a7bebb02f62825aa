"""benchmarks/bigger_than_memory.py runs end to end at a tiny size and prints every figure #12 asks for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def test_bigger_than_memory_benchmark_smoke(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bigger_than_memory.py"), "--sizes", "1,4",
                          "--width", "64", "--heads", "2", "--seq", "16", "--steps", "1", "--warmup", "1",
                          "--pairs", "1", "--state-offload", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    small, large = result["sizes"]
    assert large["params"] >= 3 * small["params"]
    for size in (small, large):
        for key in ("params", "peak_rss_MiB", "resident_bytes_per_param", "plain_would_need_GiB", "bytes_per_step",
                    "step_s", "io_bound_s"):
            assert size[key] > 0, key
        assert size["bytes_per_step"] == size["bytes_read_per_step"] + size["bytes_written_per_step"]
    assert small["plain_step_s"] > 0 and "plain_step_s" not in large
    assert small["state_offload_peak_rss_MiB"] > 0 and small["state_offload_step_s"] > 0
    assert small["step_vs_bound"]["min"] <= small["step_vs_bound"]["median"] <= small["step_vs_bound"]["max"]
    assert result["load_avg_1min"]["samples"]
    assert os.listdir(tmp_path) == []  # every store removed


def test_bigger_than_memory_budgets_smoke(tmp_path):
    """``--budgets``: at the small size budget 0, everything in RAM and plain Lightning, one record per budget."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bigger_than_memory.py"), "--sizes", "1",
                          "--width", "64", "--heads", "2", "--seq", "16", "--steps", "1", "--warmup", "1",
                          "--pairs", "1", "--budgets", "0", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    zero, everything = json.loads(out.stdout.strip().splitlines()[-1])["budgets"]
    assert (zero["budget"], everything["budget"]) == ("0", "all")
    for rec in (zero, everything):
        for key in ("params", "peak_rss_MiB", "step_s", "plain_step_s"):
            assert rec[key] > 0, key
        assert rec["step_vs_plain"]["min"] <= rec["step_vs_plain"]["median"] <= rec["step_vs_plain"]["max"]
    assert zero["budget_bytes"] == 0 and zero["ram_bytes"] == 0 and zero["bytes_per_step"] > 0
    assert everything["ssd_bytes"] == 0 and everything["bytes_per_step"] == 0  # nothing of the step on the disk
    assert os.listdir(tmp_path) == []
