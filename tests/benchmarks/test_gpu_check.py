"""``benchmarks/gpu_check.py`` without a GPU: it exits cleanly with a line that says so, and its verdict
asks for a deterministic baseline before it calls a bitwise match a pass."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def test_without_cuda_it_says_so_and_exits_cleanly(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--store-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["skipped"] == "no CUDA device" and result["ok"] is False
    assert tuple(result["cases"]) == CASES_ON_CPU  # every case, by default
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


def _gpu_check(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    return importlib.import_module("gpu_check")


def _on_fake_cuda(monkeypatch):
    """The offload strategy's staging is ``CudaStaging``'s logic over ``fake_cuda`` (device copies are separate CPU
    buffers, every copy and event recorded), as on a GPU; so are the optimizer state's copies to the device and
    back (``fake_cuda_optimizer``)."""
    from fake_cuda import fake_cuda_optimizer, fake_cuda_staging

    fake_cuda_optimizer(monkeypatch)
    return fake_cuda_staging(monkeypatch)


def _small(gc_mod, tmp_path, *extra: str):
    args = gc_mod.parser().parse_args(["--accelerator", "cpu", "--steps", "4", "--layers", "2", "--d-model", "64",
                                       "--seq", "32", "--batch", "4", "--chunk-mib", "1", "--store-dir",
                                       str(tmp_path), *extra])
    torch.manual_seed(0)
    base = gc_mod.AdamGPT(vocab=256, d=args.d_model, heads=4, layers=args.layers, mlp=4)
    data = gc_mod.Tokens(max(1, args.steps // 2), args.batch, args.seq, 256)
    return args, gc_mod.Baselines(args, base, data, str(tmp_path / "base"))


def test_bf16_case_compares_against_the_fp32_master_reference(monkeypatch, tmp_path):
    """Issue #33, defect 2: the offloaded bf16-true run keeps fp32 masters; ``params_bf16``'s baseline does too
    (plain bf16 AdamW differs from it, so the old baseline failed correct code). Run on CPU through the fake CUDA."""
    gc_mod = _gpu_check(monkeypatch)
    rt, made = _on_fake_cuda(monkeypatch)
    args, baselines = _small(gc_mod, tmp_path)
    result = gc_mod.run_case("params_bf16", args, baselines, str(tmp_path / "store"))
    assert made and result["bitwise_equal"] and result["baseline_deterministic"], result
    plain, _, _, _ = baselines.get("bf16-true")  # what the case compared against before
    masters, _, _, _ = baselines.get("bf16-true", ("exact", "fp32"))
    assert any(not torch.equal(plain[k], masters[k]) for k in plain)
    assert rt.live == {}


def test_help_lists_the_cases_and_the_deadline():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--help"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0
    for name in ("params_stress", "params_exception", "params_compile", "ddp_smoke", "sanitizer", "params_int8",
                 "params_prefetch2"):
        assert name in out.stdout, name
    assert "--deadline-min" in out.stdout and "(default 7.0)" in " ".join(out.stdout.split())


@pytest.fixture(scope="module")
def small_check(tmp_path_factory):
    """The script's module, small arguments and its baselines (shared: each is trained once for every case)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        gc_mod = importlib.import_module("gpu_check")
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    root = tmp_path_factory.mktemp("gpu_check")
    args = gc_mod.parser().parse_args(["--accelerator", "cpu", "--steps", "4", "--layers", "2", "--d-model", "32",
                                       "--seq", "16", "--batch", "2", "--chunk-mib", "1", "--store-dir", str(root)])
    torch.manual_seed(0)
    base = gc_mod.AdamGPT(vocab=256, d=args.d_model, heads=4, layers=args.layers, mlp=4)
    data = gc_mod.Tokens(max(1, args.steps // 2), args.batch, args.seq, 256)
    return gc_mod, args, gc_mod.Baselines(args, base, data, str(root / "base")), root


CASES_ON_CPU = ("activation_offload", "params_backward", "params_step", "params_bf16", "params_resume", "params_keep",
                "params_delayed", "sanitizer", "params_desk", "params_desk_half", "params_prefetch2", "params_int8",
                "params_stress", "params_exception", "params_compile", "ddp_smoke")


def test_every_case_is_run_on_cpu_below(small_check):
    assert CASES_ON_CPU == small_check[0].CASES  # a new case gets its CPU run here


@pytest.mark.parametrize("name", CASES_ON_CPU)
def test_case_body_runs_on_cpu_through_the_fake_cuda(small_check, monkeypatch, name):
    """Each case's body on CPU, the parameter path through ``CudaStaging``'s logic (fake CUDA), small sizes: the
    script cannot rot unnoticed before a GPU runs it. What a GPU adds (real streams, the sanitizer, timings,
    device memory) is not checked here."""
    from lightning_nvme.preflight import resources as preflight

    gc_mod, args, baselines, root = small_check
    rt, made = _on_fake_cuda(monkeypatch)
    monkeypatch.setattr(preflight, "device_free_bytes", lambda device: 64 << 30)
    store = root / name
    store.mkdir()
    result = gc_mod.run_case(name, args, baselines, str(store))
    if name == "sanitizer":  # the child runs the same script; without CUDA it says so and exits cleanly
        assert result["returncode"] == 0 and result["child"] == {}, result
    elif name in ("params_compile", "params_exception"):
        assert result["ok"], result
    else:
        assert result["bitwise_equal"] and result["baseline_deterministic"], result
    if name.startswith("params_") and name not in ("params_compile", "params_exception"):
        assert made, "the fake CUDA staging was used"
    assert rt.live == {}
