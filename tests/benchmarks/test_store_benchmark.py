"""The store benchmark runs end to end on a tiny size and prints its JSON summary last (so it cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def test_store_throughput_benchmark_smoke(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "store_throughput.py"), "--gib", "0.0625",
                          "--pairs", "3", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("store_write_GBps", "store_read_GBps", "raw_write_GBps", "raw_read_GBps", "write_ratio",
                "read_ratio", "peak_rss_MiB", "staging_MiB", "mode", "aiofiles_write_GBps", "aiofiles_read_GBps"):
        assert key in result
    assert result["mode"] in ("direct", "buffered") and result["write_ratio"] > 0 and result["read_ratio"] > 0
    assert os.listdir(tmp_path) == []  # the benchmark cleans up its files
