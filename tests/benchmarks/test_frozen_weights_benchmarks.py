"""benchmarks/lora_start.py and benchmarks/frozen_read.py run end to end at tiny sizes and print the figures #38 asks
for (never timing assertions: only that the figures exist and what must hold whatever the machine's speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def _run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                         text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lora_start_benchmark_tiny(tmp_path):
    r = _run("lora_start.py", "--shape", "tiny", "--dir", str(tmp_path), "--pairs", "1", "--steps", "3",
             "--lora-rank", "2")
    for key in ("lora_store_bytes", "copy_store_bytes", "lora_start_s", "copy_start_s", "bytes_written_per_step"):
        assert r[key] > 0, key
    # one pair: the median is that pair's ratio (of unrounded times; the listed times are rounded to 1 ms)
    lora, copy = r["lora_starts_s"][0], r["copy_starts_s"][0]
    slack = lora / copy * 0.0005 * (1 / lora + 1 / copy) + 0.0005
    assert abs(r["lora_start_vs_copy"]["median"] - lora / copy) <= slack
    assert r["in_place_blocks"] == 2 and r["in_place_bytes"] > 0  # TINY: 2 layers, their base read in place
    assert r["lora_store_bytes"] < r["copy_store_bytes"]  # the base is not in the store
    assert r["losses_equal"]  # the same numbers either way
    assert os.listdir(tmp_path) == []  # stores and the written base removed


def test_frozen_read_benchmark_tiny(tmp_path):
    r = _run("frozen_read.py", "--dir", str(tmp_path), "--layers", "2", "--hidden", "256", "--intermediate", "512",
             "--pairs", "1", "--read-bytes", "65536", "--with-reader")
    assert r["tensor_bytes"] == 2 * 2 * (4 * 256 * 256 + 3 * 256 * 512 + 2 * 256)  # bf16, every tensor served
    assert r["requests"] > 2 and r["in_place_GBps"][0] > 0 and r["raw_GBps"][0] > 0 and r["reader_GBps"][0] > 0
    assert os.listdir(tmp_path) == []
