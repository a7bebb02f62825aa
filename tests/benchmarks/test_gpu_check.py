"""``benchmarks/gpu_check.py`` without a GPU: it exits cleanly with a line that says so, and its verdict
asks for a deterministic baseline before it calls a bitwise match a pass."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def test_without_cuda_it_says_so_and_exits_cleanly(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--store-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["skipped"] == "no CUDA device" and result["ok"] is False
    assert result["cases"] == ["activation_offload", "params_backward", "params_step", "params_bf16", "params_resume",
                               "params_keep", "params_delayed", "sanitizer", "params_desk", "params_desk_half"]
    assert os.listdir(tmp_path) == []


def test_unknown_case_is_refused():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--only", "params_fast"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "unknown cases ['params_fast']" in out.stderr


def test_a_match_counts_only_against_a_deterministic_baseline(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    verdict = importlib.import_module("gpu_check").verdict
    a = {"w": torch.tensor([1.0, 2.0])}
    b = {"w": torch.tensor([1.0, 2.5])}
    assert verdict(a, a, a) == {"bitwise_equal": True, "baseline_deterministic": True, "max_abs_diff": 0.0, "ok": True}
    assert verdict(a, b, a)["ok"] is False  # equal to one run of a baseline that differs from itself
    assert verdict(a, a, b) == {"bitwise_equal": False, "baseline_deterministic": True, "max_abs_diff": 0.5,
                                "ok": False}
    assert verdict(a, a, {})["ok"] is False  # a missing parameter is no match
