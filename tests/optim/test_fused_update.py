"""The one-pass update kernel (``optim/formats/fused_update.py``): where it runs (AdamW/Adam ``fused=True``, int8 state,
bf16_sr, bf16 CPU params) the run stays bitwise equal to the in-memory ``RoundTripOptimizer`` and to the
generic per-chunk step (params, stored state, step counts), pieces with a partial last block included, in
both overlap modes and across a checkpoint; everywhere else the gate sends the update to the optimizer's own
step, and a torch build the kernel does not reproduce keeps the generic path."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from models import MLP
from test_strategy import assert_same_params, fit

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.optim.formats import fused_update
from lightning_nvme.optim.formats.state_format import StateFormat, StateFormatError

INT8_SR = StateFormat("int8", "bf16_sr")
# hidden 300: every weight and bias of the body ends in a partial int8 block (the part torch's scalar tail computes)
KW = dict(precision="bf16-true", hidden=300, steps=12, optimizer="adamw_fused")

needs_kernel = pytest.mark.skipif(not fused_update.verified(), reason="this torch build's fused AdamW differs "
                                  "from the kernel; the generic path runs (covered by the other format tests)")


def offload(tmp_path, **kw):
    return NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=64 << 10, state_format="int8",
                               master_format="bf16_sr", **kw)


def without_kernel(monkeypatch):
    monkeypatch.setattr(fused_update, "plan", lambda *a, **k: None)


@needs_kernel
@pytest.mark.parametrize("overlap, clip_algo", [("step", "norm"), ("backward", "value")])
def test_kernel_run_is_bitwise_the_round_trip_reference_and_the_generic_step(tmp_path, monkeypatch, overlap,
                                                                                clip_algo):
    ref, _ = fit(tmp_path / "ref", "auto", ref_state_format="int8", ref_master_format="bf16_sr",
                 clip_algo=clip_algo, **KW)
    off, t = fit(tmp_path / "off", offload(tmp_path / "a", overlap=overlap), clip_algo=clip_algo, **KW)
    opt = t.strategy.offloaded[0]
    numel = sum(p.numel() for p in off.parameters() if p.requires_grad and p.numel() >= fused_update.BLOCK)
    assert opt.fused_elements > numel  # the kernel did the updates (all full blocks, every step)
    assert_same_params(ref, off)
    with monkeypatch.context() as m:
        without_kernel(m)
        gen, tg = fit(tmp_path / "gen", offload(tmp_path / "b", overlap=overlap), clip_algo=clip_algo, **KW)
        assert tg.strategy.offloaded[0].fused_elements == 0
    assert_same_params(gen, off)
    a, b = t.optimizers[0].state_dict(), tg.optimizers[0].state_dict()
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert torch.is_tensor(v) and v.dtype == w.dtype and torch.equal(v, w), f"state {k} of param {i}"


@needs_kernel
def test_first_steps_partial_blocks_and_small_params_mix_in_one_chunk(tmp_path):
    """One chunk holds kernel pieces and pieces the optimizer's own step updates (under a block): equal."""
    ref, _ = fit(tmp_path / "ref", "auto", ref_state_format="int8", ref_master_format="bf16_sr", **{**KW, "steps": 2})
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=1 << 20, state_format="int8",
                                   master_format="bf16_sr")
    off, t = fit(tmp_path / "off", strategy, **{**KW, "steps": 2})
    assert len(t.strategy.offloaded[0].chunks) == 1 and t.strategy.offloaded[0].fused_elements > 0
    assert_same_params(ref, off)


@pytest.mark.parametrize("optimizer, group, fmt, why", [
    (torch.optim.AdamW, {"fused": False}, INT8_SR, "not fused"),
    (torch.optim.AdamW, {"fused": True, "amsgrad": True}, INT8_SR, "amsgrad"),
    (torch.optim.AdamW, {"fused": True, "maximize": True}, INT8_SR, "maximize"),
    (torch.optim.AdamW, {"fused": True, "lr": torch.tensor(1e-3)}, INT8_SR, "tensor lr"),
    (torch.optim.Adam, {"fused": True, "weight_decay": 0.1}, INT8_SR, "L2 decay in the gradient"),
    (torch.optim.AdamW, {"fused": True}, StateFormat("bf16", "bf16_sr"), "bf16 state"),
    (torch.optim.AdamW, {"fused": True}, StateFormat("int8", "fp32"), "fp32 masters"),
    (torch.optim.SGD, {"lr": 0.1}, INT8_SR, "another optimizer"),
])
def test_gate_sends_what_the_kernel_does_not_implement_to_the_optimizers_own_step(optimizer, group, fmt, why):
    opt = optimizer([torch.nn.Parameter(torch.zeros(4))], **group)
    assert fused_update.plan(opt, fmt, {}) is None, why


@needs_kernel
def test_gate_takes_adamw_and_decay_free_adam_and_not_a_subclass_or_step_kwargs():
    param = [torch.nn.Parameter(torch.zeros(4))]
    assert fused_update.plan(torch.optim.AdamW(param, fused=True), INT8_SR, {}) is not None
    assert fused_update.plan(torch.optim.Adam(param, fused=True), INT8_SR, {}) is not None
    assert fused_update.plan(torch.optim.Adam(param, fused=True, weight_decay=0.1, decoupled_weight_decay=True),
                             INT8_SR, {}) is not None

    class Custom(torch.optim.AdamW):
        pass

    assert fused_update.plan(Custom(param, fused=True), INT8_SR, {}) is None
    opt = torch.optim.AdamW(param, fused=True)
    assert fused_update.plan(opt, INT8_SR, {"closure": None}) is None
    opt.grad_scale = torch.tensor(2.0)  # what torch's GradScaler sets for fused optimizers
    assert fused_update.plan(opt, INT8_SR, {}) is None


def test_a_torch_build_the_kernel_does_not_reproduce_keeps_the_generic_path(monkeypatch):
    monkeypatch.setattr(fused_update, "verified", lambda: False)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], fused=True)
    assert fused_update.plan(opt, INT8_SR, {}) is None


@needs_kernel
def test_self_check_compares_against_torchs_own_update(monkeypatch):
    """The self-check is not vacuous: a kernel one ulp off (the update without torch's fused multiply-add) fails it."""
    from lightning_nvme.optim.formats import adamw_kernel

    real = adamw_kernel.update_blocks

    def off_by_a_bit(p16, *args):
        real(p16, *args)
        p16[::7] ^= 1  # flip the last bit of some params

    monkeypatch.setattr(adamw_kernel, "update_blocks", off_by_a_bit)
    fused_update.verified.cache_clear()
    try:
        assert not fused_update.verified()
    finally:
        monkeypatch.undo()
        fused_update.verified.cache_clear()
    assert fused_update.verified()


class DivergingMLP(MLP):
    """Its third batch's loss is NaN: every gradient, then the kernel's new moments, become NaN."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 2 else loss


@needs_kernel
def test_a_nonfinite_update_is_refused_naming_the_state_parameter_and_elements(tmp_path):
    model = DivergingMLP("adamw_fused", hidden=300)
    trainer = Trainer(default_root_dir=tmp_path, strategy=offload(tmp_path), accelerator="cpu", devices=1,
                      max_steps=4, precision="bf16-true", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(StateFormatError, match=r"optimizer state exp_avg of parameter \d+ became NaN/inf in "
                                               r"elements \[\d+, \d+\) at this update: state_format='int8'"):
        trainer.fit(model)
