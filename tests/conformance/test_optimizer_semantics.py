"""Optimizer semantics under ``nvme_offload`` are Lightning's and torch's: every optimizer step updates what
the default strategy updates (bit for bit), the plan follows the optimizer as it changes, step hooks and
kwargs behave as in torch, and what cannot be offloaded exactly is refused with a message saying why.
Each test names the failure of issue #11 it covers."""

from __future__ import annotations

import copy
import os
import pickle
from collections import Counter

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import BackboneFinetuning
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from conformance._lightning_models import Net, assert_same_params, assert_same_state, train
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.optim import ELEMENTWISE_OPT_IN, UnsupportedOptimizerError, plan_chunks
from lightning_nvme.optim.plan import describe_params
from lightning_nvme.store import FlatStore, StoreFormatError

OVERLAPS = ["step", "backward"]
SMALL_CHUNK = 4096  # smaller than the 96x16 backbone weight's state: big params are cut into ranges


def nvme(tmp_path, name: str = "store", **kwargs) -> NVMeOffloadStrategy:
    return NVMeOffloadStrategy(store_dir=str(tmp_path / name), chunk_bytes=SMALL_CHUNK, **kwargs)


def both(tmp_path, make, overlap: str = "step", **train_kwargs):
    """The same model trained by the default strategy and by nvme_offload."""
    ref = Net(make, **train_kwargs.pop("net", {}))
    net_kwargs = {k: getattr(ref, k) for k in ("frozen_backbone", "in_optimizer")}
    off = Net(make, **net_kwargs)
    callbacks = train_kwargs.pop("callbacks", lambda: [])
    train(ref, tmp_path / "ref", callbacks=callbacks(), **train_kwargs)
    trainer = train(off, tmp_path / "off", nvme(tmp_path, overlap=overlap), callbacks=callbacks(), **train_kwargs)
    return ref, off, trainer


def moved(model: Net, name: str) -> bool:
    start = dict(Net(model.make_optimizer).named_parameters())[name]
    return not torch.equal(start, dict(model.named_parameters())[name])


# ---- 1. stateless optimizers and groups step -----------------------------------------------------------
@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_plain_sgd_updates_like_default(tmp_path, overlap, weight_decay):
    ref, off, _ = both(tmp_path, lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=weight_decay), overlap)
    assert moved(ref, "backbone.0.weight")
    assert_same_params(ref, off)


def test_stateless_and_stateful_groups_in_one_optimizer(tmp_path):
    def make(params):
        params = list(params)
        return torch.optim.SGD([{"params": params[:2], "momentum": 0.9}, {"params": params[2:], "momentum": 0.0}],
                               lr=0.1)

    ref, off, trainer = both(tmp_path, make)
    assert_same_params(ref, off)
    assert_same_state(ref.trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict())


# ---- 2. the plan follows the optimizer -----------------------------------------------------------------
@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("make", [lambda p: torch.optim.Adam(p, lr=1e-2), lambda p: torch.optim.SGD(p, lr=0.1)],
                         ids=["adam", "plain_sgd"])
def test_backbone_finetuning_add_param_group(tmp_path, overlap, make):
    ref, off, _ = both(tmp_path, make, overlap, net={"in_optimizer": False}, steps=-1, epochs=2,
                       callbacks=lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)])
    assert moved(ref, "backbone.0.weight")
    assert_same_params(ref, off)


class UnfreezeAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            pl_module.backbone.requires_grad_(True)


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_unfreeze_mid_run(tmp_path, overlap):
    ref, off, trainer = both(tmp_path, lambda p: torch.optim.AdamW(p, lr=1e-2), overlap,
                             net={"frozen_backbone": True}, callbacks=lambda: [UnfreezeAt(5)])
    assert moved(ref, "backbone.0.weight")
    assert_same_params(ref, off)
    assert_same_state(ref.trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict())
    assert any(not p.whole for c in trainer.strategy.offloaded[0].chunks for p in c.pieces)  # stored, and split


# ---- 3. one store per strategy instance -----------------------------------------------------------------
def test_two_trainers_same_root_keep_their_own_state(tmp_path):
    make = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    ref = Net(make)
    expected = train(ref, tmp_path / "ref", steps=6).optimizers[0].state_dict()
    first = train(Net(make), tmp_path / "same", "nvme_offload", steps=6)
    second = train(Net(make, hidden=32), tmp_path / "same", "nvme_offload", steps=9)
    paths = {t.strategy.offloaded[0].store.path for t in (first, second)}
    assert len(paths) == 2
    assert_same_state(expected, first.optimizers[0].state_dict())
    first.save_checkpoint(tmp_path / "first.ckpt")  # after the second trainer's fit: still the first run's state
    resumed = Net(make)
    trainer = train(resumed, tmp_path / "resume", nvme(tmp_path, "resume_store"), steps=6,
                    ckpt_path=str(tmp_path / "first.ckpt"))
    assert_same_state(expected, trainer.optimizers[0].state_dict())


def test_reused_store_file_is_detected_not_read(tmp_path):
    trainer = train(Net(lambda p: torch.optim.Adam(p, lr=1e-2)), tmp_path, nvme(tmp_path), steps=3)
    store = trainer.strategy.offloaded[0].store
    FlatStore(store.directory, name=os.path.basename(store.path)[:-4]).close()  # another process reuses the file
    with pytest.raises(StoreFormatError, match="another run"):
        trainer.optimizers[0].state_dict()


# ---- 7. kwargs, state_dict after fit, copies, closures ------------------------------------------------------
class ScaledSGD(torch.optim.SGD):
    """A custom step taking a keyword argument; element-wise, and says so."""

    nvme_offload_elementwise_step = True

    def step(self, closure=None, lr_scale: float = 1.0):
        for g in self.param_groups:
            g["lr"] *= lr_scale
        try:
            return super().step(closure)
        finally:
            for g in self.param_groups:
                g["lr"] /= lr_scale


class ManualNet(Net):
    def __init__(self, make=None, **kwargs) -> None:
        super().__init__(make or (lambda p: ScaledSGD(p, lr=0.1, momentum=0.9)), **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()

        def closure():
            loss = super(ManualNet, self).training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure, lr_scale=0.5)


def test_step_kwargs_reach_the_optimizer(tmp_path):
    ref, off = ManualNet(), ManualNet()
    train(ref, tmp_path / "ref")
    train(off, tmp_path / "off", nvme(tmp_path))
    assert moved(ref, "head.weight")
    assert_same_params(ref, off)


def test_state_dict_after_fit(tmp_path):
    ref, off, trainer = both(tmp_path, lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True))
    assert trainer.strategy.nvme_store is None  # torn down: the store is closed
    assert_same_state(ref.trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict())


class CopyStrategyAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step
        self.copies: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.copies = [copy.deepcopy(trainer.strategy), pickle.loads(pickle.dumps(trainer.strategy))]


def adamw(params) -> torch.optim.AdamW:  # module level: a picklable model holds it
    return torch.optim.AdamW(params, lr=1e-2)


def test_strategy_deepcopy_and_pickle_during_fit(tmp_path):
    ref, off = Net(adamw), Net(adamw)
    train(ref, tmp_path / "ref")
    copier = CopyStrategyAt(4)
    trainer = train(off, tmp_path / "off", nvme(tmp_path), callbacks=[copier])
    assert_same_params(ref, off)  # copying did not disturb the run
    for copied in copier.copies:
        assert copied.nvme_store is None
        with pytest.raises(RuntimeError, match="is a copy"):
            copied.offloaded[0].step()
    assert trainer.strategy.offloaded[0].store_ref == copier.copies[0].offloaded[0].store_ref


def test_lbfgs_refused_at_setup(tmp_path):
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS needs a closure.*strategy='auto'"):
        train(Net(lambda p: torch.optim.LBFGS(p)), tmp_path, nvme(tmp_path))


# ---- 8. step hooks and custom steps --------------------------------------------------------------------
def _hooked(counts: Counter, make):
    def build(params):
        opt = make(params)
        opt.register_step_pre_hook(lambda *a: counts.update(["own_pre"]))
        opt.register_step_post_hook(lambda *a: counts.update(["own_post"]))
        return opt
    return build


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: ScaledSGD(p, lr=0.1)],
                         ids=["adamw", "custom_step"])
def test_step_hooks_fire_once_per_step(tmp_path, overlap, make):
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # torch wraps SGD.step (hooks) at its first instance
    counts = {"ref": Counter(), "off": Counter()}
    handles = [register_optimizer_step_pre_hook(lambda *a: run.update(["global_pre"])),
               register_optimizer_step_post_hook(lambda *a: run.update(["global_post"]))]
    try:
        for name, strategy in (("ref", "auto"), ("off", nvme(tmp_path, overlap=overlap))):
            run = counts[name]
            train(Net(_hooked(run, make)), tmp_path / name, strategy, steps=10)
    finally:
        for h in handles:
            h.remove()
    # torch fires them once per wrapped step entered: AdamW once per step, a custom step calling super().step() twice
    per_step = 2 if isinstance(make(torch.nn.Linear(1, 1).parameters()), ScaledSGD) else 1
    assert counts["ref"] == Counter({k: 10 * per_step for k in ("global_pre", "global_post", "own_pre", "own_post")})
    assert counts["off"] == counts["ref"]


class CountingSGD(torch.optim.SGD):
    """Does more than update each parameter: counts its steps (must not run once per chunk)."""

    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        return super().step(closure)


def test_custom_step_refused_unless_declared_elementwise(tmp_path):
    with pytest.raises(UnsupportedOptimizerError, match=f"CountingSGD.{ELEMENTWISE_OPT_IN} = True"):
        train(Net(lambda p: CountingSGD(p, lr=0.1)), tmp_path, nvme(tmp_path))


# ---- 9. state that is not element-wise (Adafactor) ----------------------------------------------------------
def test_adafactor_probed_per_shape_class_and_never_split():
    opt = torch.optim.Adafactor([torch.nn.Parameter(torch.randn(96, 16)), torch.nn.Parameter(torch.randn(96))])
    infos, _ = describe_params(opt)
    assert [i.keys for i in infos] == [(), (("variance", torch.float32),)]  # factored row/col state is not stored
    assert not any(i.splittable for i in infos)
    adamw, _ = describe_params(torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 4))]))
    assert adamw[0].splittable


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_adafactor_equal_with_small_chunks(tmp_path, overlap):
    ref, off, trainer = both(tmp_path, lambda p: torch.optim.Adafactor(p, lr=1e-2), overlap)
    assert moved(ref, "backbone.0.weight")
    assert_same_params(ref, off)
    assert all(p.whole for c in trainer.strategy.offloaded[0].chunks for p in c.pieces)


def test_adafactor_param_too_big_for_a_chunk_is_refused():
    opt = torch.optim.Adafactor([torch.nn.Parameter(torch.randn(4096))])
    with pytest.raises(UnsupportedOptimizerError, match="Adafactor.*not element-wise.*chunk_bytes to at least 16384"):
        plan_chunks(opt, SMALL_CHUNK, "opt0")


# ---- torch's optimizers, directly (no Trainer): same bits with parameters cut into ranges ------------------------
TORCH_OPTIMIZERS = {"NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2), "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
                    "Adamax": lambda p: torch.optim.Adamax(p), "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2),
                    "Rprop": lambda p: torch.optim.Rprop(p), "Adadelta": lambda p: torch.optim.Adadelta(p),
                    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2)}


@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZERS))
def test_torch_optimizers_equal_in_small_chunks(tmp_path, name):
    from lightning_nvme.optim import OffloadedOptimizer

    def run(offload: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 48)), torch.nn.Parameter(torch.randn(48))]
        opt = TORCH_OPTIMIZERS[name](params)
        store = FlatStore(tmp_path / str(offload)) if offload else None
        if offload:
            OffloadedOptimizer(opt, store, chunk_bytes=SMALL_CHUNK)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        if store is not None:
            store.close()
        return params

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
