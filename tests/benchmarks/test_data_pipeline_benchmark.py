"""The data pipeline benchmark runs end to end on a tiny corpus and prints its JSON summary last (so it cannot rot);
no timing is asserted, only that every figure is there and the corpus and cache are removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def test_data_pipeline_benchmark_smoke(tmp_path):
    work = tmp_path / "bench"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "data_pipeline.py"), "--gb", "0.002",
                          "--steps", "2", "--dir", str(work)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("tokens_per_s", "data_wait_fraction", "rss_growth_MiB", "tokens", "epoch_batches", "preconditions"):
        assert key in result
    assert result["tokens"] > 0.9 * result["corpus_bytes"]  # byte tokens: about one per byte (JSON quoting aside)
    assert 0 <= result["data_wait_fraction"] < 1
    assert not work.exists()  # the corpus and the cache are deleted
