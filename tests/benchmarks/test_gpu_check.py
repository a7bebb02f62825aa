"""``benchmarks/gpu_check.py`` without a GPU: it exits cleanly with a line that says so, its verdict asks for a
deterministic baseline before it calls a bitwise match a pass, and every case's body runs on CPU through the fake
CUDA. Kept short: one module-wide set of small arguments and baselines (each plain run trained once for every
case), ``main`` called in this process (the script runs as a subprocess once, in the ``sanitizer`` case)."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/benchmarks/ -> the repository


def test_without_cuda_it_says_so_and_exits_cleanly(small_check, tmp_path, capsys):
    """``main`` in this process (no CUDA here); the script itself runs as a subprocess in the ``sanitizer`` case."""
    assert small_check[0].main(["--store-dir", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["skipped"] == "no CUDA device" and result["ok"] is False
    assert tuple(result["cases"]) == CASES_ON_CPU  # every case, by default
    assert os.listdir(tmp_path) == []


def test_unknown_case_is_refused(small_check, capsys):
    with pytest.raises(SystemExit) as exit_:
        small_check[0].main(["--only", "params_fast"])
    assert exit_.value.code == 2 and "unknown cases ['params_fast']" in capsys.readouterr().err


def test_a_match_counts_only_against_a_deterministic_baseline(small_check):
    verdict = small_check[0].verdict
    a = {"w": torch.tensor([1.0, 2.0])}
    b = {"w": torch.tensor([1.0, 2.5])}
    assert verdict(a, a, a) == {"bitwise_equal": True, "baseline_deterministic": True, "max_abs_diff": 0.0, "ok": True}
    assert verdict(a, b, a)["ok"] is False  # equal to one run of a baseline that differs from itself
    assert verdict(a, a, b) == {"bitwise_equal": False, "baseline_deterministic": True, "max_abs_diff": 0.5,
                                "ok": False}
    assert verdict(a, a, {})["ok"] is False  # a missing parameter is no match


def test_memory_bound_leaves_out_the_blocks_and_the_state_and_adds_the_blocks_in_use(small_check):
    """``params_memory``'s bound (on a GPU; on CPU there is no device memory to hold to it)."""
    bound = small_check[0].memory_bound_MiB
    mib = 1 << 20
    assert bound(1000.0, 100 * mib, 200 * mib, 10 * mib, 1) == 1000 - 100 - 200 + 3 * 10
    assert bound(1000.0, 100 * mib, 200 * mib, 10 * mib, 2) == 1000 - 100 - 200 + 4 * 10


def test_bf16_case_compares_against_the_fp32_master_reference(small_check):
    """Issue #33, defect 2: the offloaded bf16-true run keeps fp32 masters; ``params_bf16``'s baseline does too
    (plain bf16 AdamW differs from it, so the old baseline failed correct code). That the offloaded run equals
    this reference is ``params_bf16``'s own case below."""
    gc_mod, _, baselines, _ = small_check
    assert gc_mod.REFERENCE["params_bf16"] == ("bf16-true", ("exact", "fp32"))
    plain, _, _, _ = baselines.get("bf16-true")  # what the case compared against before
    masters, _, _, _ = baselines.get("bf16-true", ("exact", "fp32"))  # shared with the case below
    assert any(not torch.equal(plain[k], masters[k]) for k in plain)


def test_help_lists_the_cases_and_the_deadline(small_check, capsys):
    with pytest.raises(SystemExit) as exit_:
        small_check[0].main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for name in small_check[0].CASES:
        assert name in out, name
    assert "--deadline-min" in out and "(default 7.0)" in " ".join(out.split())


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
                                       "--seq", "16", "--batch", "2", "--chunk-mib", "1", "--store-dir", str(root),
                                       "--memory-d-model", "32", "--memory-layers", "2", "--disk-probe-mib", "8",
                                       "--time-steps", "3"])
    torch.manual_seed(0)
    base = gc_mod.AdamGPT(vocab=256, d=args.d_model, heads=4, layers=args.layers, mlp=4)
    data = gc_mod.Tokens(max(1, args.steps // 2), args.batch, args.seq, 256)
    return gc_mod, args, gc_mod.Baselines(args, base, data, str(root / "base")), root


CASES_ON_CPU = ("activation_offload", "params_backward", "params_step", "params_bf16", "params_resume", "params_keep",
                "params_delayed", "sanitizer", "params_desk", "params_desk_half", "params_prefetch2", "params_int8",
                "params_stress", "params_exception", "params_compile", "ddp_smoke", "fsdp_smoke", "params_memory",
                "params_time")


def test_every_case_is_run_on_cpu_below(small_check):
    assert CASES_ON_CPU == small_check[0].CASES  # a new case gets its CPU run here


@pytest.mark.parametrize("name", CASES_ON_CPU)
def test_case_body_runs_on_cpu_through_the_fake_cuda(small_check, monkeypatch, name):
    """Each case's body on CPU, the parameter path through ``CudaTransfer``'s logic (fake CUDA), small sizes: the
    script cannot rot unnoticed before a GPU runs it. What a GPU adds (real streams, the sanitizer, timings,
    device memory) is not checked here."""
    from lightning_nvme.preflight import resources as preflight

    gc_mod, args, baselines, root = small_check
    from fake_cuda import fake_cuda_optimizer, fake_cuda_transfer

    # the parameter path through ``CudaTransfer``'s logic over the fake CUDA (device copies are separate CPU
    # buffers, every copy and event recorded), as on a GPU; so are the optimizer state's copies to the device
    # and back (``fake_cuda_optimizer``)
    fake_cuda_optimizer(monkeypatch)
    rt, made = fake_cuda_transfer(monkeypatch)
    monkeypatch.setattr(preflight, "device_free_bytes", lambda device: 64 << 30)
    monkeypatch.setattr(gc_mod, "TIME_MIN_STEPS", 3)  # CPU timings judge nothing: the body runs, shorter
    store = root / name
    store.mkdir()
    result = gc_mod.run_case(name, args, baselines, str(store))
    if name == "sanitizer":  # the child runs the same script; without CUDA it says so and exits cleanly
        assert result["returncode"] == 0 and result["child"] == {}, result
    elif name in ("params_compile", "params_exception"):
        assert result["ok"], result
    elif name == "params_memory":  # no device memory on CPU: the bound's inputs only
        assert result["ok"] and result["bound_ok"] is None and result["optimizer_state_MiB"] > 0, result
    elif name == "params_time":  # timings on a busy CPU judge nothing: the case runs and reports its figures
        assert result["steps"] >= 3 and result["raw_read_GBps"] > 0 and result["io_mode"], result
    else:
        assert result["bitwise_equal"] and result["baseline_deterministic"], result
    if name == "params_resume":  # the saved optimizer state, bitwise, beside the resumed weights
        assert result["optimizer_state_equal"] and result["optimizer_state_tensors"] > 0, result
    if name.startswith("params_") and name not in ("params_compile", "params_exception"):
        assert made, "the fake CUDA transfer was used"
    assert rt.live == {}
