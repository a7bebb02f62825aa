"""host_memory_budget: parameter blocks and optimizer chunks kept in RAM instead of the SSD give the same
numbers bitwise (budget 0, partial, everything resident; offload_params on and off; AdamW and SGD-momentum;
exact and int8 state), never touch the disk for what is in RAM during training, and a checkpoint saved with
one budget resumes in a new process with another."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
from _param_offload_model import TinyGPT
from lightning.pytorch import Callback, Trainer

import lightning_nvme  # noqa: F401  (registers the strategies)
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.checks import ConfigError
from lightning_nvme.constants import GiB
from lightning_nvme.memory import available_host_memory
from lightning_nvme.store import FlatStore
from lightning_nvme.store.dispatch import IODispatch

STEPS = 8
EVERYTHING = 1 << 30  # far more than the tiny model's regions (checked below: nothing left on the SSD)


def trainer(root, strategy, steps=STEPS, callbacks=(), **kwargs):
    return Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", devices=1, max_steps=steps,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=list(callbacks), **kwargs)


def offload(root, budget, offload_params=True, **kwargs):
    return NVMeOffloadStrategy(store_dir=str(root / "store"), chunk_bytes=16 << 10, overlap="backward",
                               offload_params=offload_params, host_memory_budget=budget, **kwargs)


_CHUNK_JOB = IODispatch.chunk_job


class DiskRegions(Callback):
    """The regions the store moved to or from the disk while training ran (a chunk job is one disk request)."""

    def __init__(self, monkeypatch) -> None:
        self.regions: set[str] = set()
        self.training = False
        original = _CHUNK_JOB  # the store's own, not a previous DiskRegions' wrapper

        def chunk_job(dispatch, *args, **kwargs):
            if self.training:
                self.regions.add(inspect.signature(original).bind(dispatch, *args, **kwargs).arguments["region"])
            return original(dispatch, *args, **kwargs)

        monkeypatch.setattr(IODispatch, "chunk_job", chunk_job)

    def on_train_start(self, trainer, pl_module):
        self.training = True

    def on_train_end(self, trainer, pl_module):
        self.training = False


def fit(root, strategy, optimizer, callbacks=()):
    model = TinyGPT(optimizer=optimizer)
    trainer(root, strategy, callbacks=callbacks).fit(model)
    return model


def assert_same(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{what}: parameter {name} differs"


def partial_budget(placement):
    """Two blocks and half a block of chunks (blocks save 3 bytes of I/O per byte, chunks 2: the greedy plan
    takes blocks first, and the chunks fill what is left), or half the chunks without parameter offload."""
    blocks = [i.nbytes for i in placement.items if i.kind == "block"]
    if blocks:
        return blocks[0] + blocks[1] + blocks[2] // 2
    return sum(i.nbytes for i in placement.items) // 2


CONFIGS = [  # (offload_params, optimizer, state_format)
    (True, "adamw", "exact"), (True, "sgd", "exact"), (False, "adamw", "exact"), (False, "sgd", "exact"),
    (True, "adamw", "int8"), (False, "sgd", "int8"),
]


@pytest.mark.parametrize("offload_params, optimizer, state_format", CONFIGS,
                         ids=[f"{'params' if p else 'state'}-{o}-{f}" for p, o, f in CONFIGS])
def test_bitwise_equal_at_every_budget(tmp_path, monkeypatch, offload_params, optimizer, state_format):
    """Exact state: equal to the default strategy at budgets 0, partial and everything; int8 state (which no
    in-memory torch run reproduces): every budget equal to budget 0, today's offload."""
    reference = fit(tmp_path / "ref", "auto", optimizer) if state_format == "exact" else None
    runs = {}
    for name in ("zero", "partial", "everything"):
        if name == "zero":
            budget = 0
        elif name == "partial":
            budget = partial_budget(runs["zero"][1].shelf_plan)
        else:
            budget = EVERYTHING
        disk = DiskRegions(monkeypatch)
        strategy = offload(tmp_path / name, budget, offload_params, state_format=state_format)
        model = fit(tmp_path / name, strategy, optimizer, [disk])
        runs[name] = (model, strategy, disk)
        plan = strategy.shelf_plan
        assert plan is not None and plan.budget == budget
        assert not plan.kept & disk.regions, "a region kept in RAM was read or written on the disk"
        if reference is not None:
            assert_same(reference, model, f"budget {name}")
        else:
            assert_same(runs["zero"][0], model, f"budget {name} vs 0")
        kinds = ("block", "chunk") if offload_params else ("chunk",)
        for kind in kinds:
            in_ram, on_ssd = plan.count(kind, True), plan.count(kind, False)
            if name == "zero":
                assert in_ram == 0 and on_ssd > 0
            elif name == "partial":
                assert in_ram > 0 and on_ssd > 0, (kind, plan.as_dict())
            else:
                assert on_ssd == 0 and in_ram > 0
        if name == "everything":
            assert plan.io_after == 0
            assert not any(r.startswith(("opt", "params/")) for r in disk.regions), disk.regions
        elif name == "partial":
            assert 0 < plan.io_after < plan.io_before and plan.kept_bytes <= budget


def test_resume_in_a_new_process_with_another_budget(tmp_path):
    """Saved from a partly resident run (the checkpoint is read from the RAM copies), resumed in a new process
    with everything resident: bitwise equal to in-memory Lightning doing the same save and resume."""
    ref_trainer = trainer(tmp_path / "ref", "auto", steps=-1, max_epochs=1)
    ref_trainer.fit(TinyGPT())
    ref_trainer.save_checkpoint(tmp_path / "ref.ckpt")
    ref = TinyGPT()
    trainer(tmp_path / "ref2", "auto", steps=32).fit(ref, ckpt_path=str(tmp_path / "ref.ckpt"))

    ckpt = tmp_path / "epoch1.ckpt"
    first = trainer(tmp_path / "a", offload(tmp_path / "a", 120_000), steps=-1, max_epochs=1)
    first.fit(TinyGPT())
    assert 0 < first.strategy.shelf_plan.kept_bytes < first.strategy.shelf_plan.kept_bytes + first.strategy.shelf_plan.streamed_bytes
    assert first.strategy.shelf_plan.streamed_bytes > 0
    first.save_checkpoint(ckpt)
    tests = os.path.dirname(os.path.abspath(__file__))
    script = f"""
import sys, json, torch
sys.path.insert(0, {tests!r})
sys.path.insert(0, {os.path.dirname(tests)!r})
from test_host_memory_budget import offload, trainer
from _param_offload_model import TinyGPT
from pathlib import Path
model = TinyGPT()
t = trainer({str(tmp_path / 'b')!r}, offload(Path({str(tmp_path / 'b')!r}), {EVERYTHING}), steps=32)
t.fit(model, ckpt_path={str(ckpt)!r})
torch.save(dict(model.named_parameters()), {str(tmp_path / 'resumed.pt')!r})
print(json.dumps({{"step": t.global_step, "ssd_bytes": t.strategy.shelf_plan.streamed_bytes}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"step": 32, "ssd_bytes": 0}
    resumed = torch.load(tmp_path / "resumed.pt")
    for name, p in ref.named_parameters():
        assert torch.equal(resumed[name], p), name


def test_weights_after_fit_come_from_ram_copies(tmp_path):
    """restore_params=False: the weights stay in the store after fit; the store's close wrote the RAM copies
    back, so the reopened store (export_weights, state_dict of the optimizer) reads the trained values."""
    ref = fit(tmp_path / "ref", "auto", "adamw")
    strategy = offload(tmp_path / "off", EVERYTHING, restore_params=False)
    trainer(tmp_path / "off", strategy).fit(TinyGPT())
    strategy.export_weights(str(tmp_path / "w.safetensors"))
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "w.safetensors"))
    for name, p in ref.state_dict().items():
        if name in exported:
            assert torch.equal(exported[name], p), name


class WritesAfterTraining(Callback):
    """The regions written to the store after training ended (teardown: the store's close writes the shelf back)."""

    def __init__(self, monkeypatch) -> None:
        self.regions: list[str] = []
        self.after = False
        original = FlatStore.write

        def write(store, name, tensor, offset=0):
            if self.after:
                self.regions.append(name)
            return original(store, name, tensor, offset)

        monkeypatch.setattr(FlatStore, "write", write)

    def on_train_end(self, trainer, pl_module):
        self.after = True


@pytest.mark.parametrize("restore", [True, False], ids=["restore", "keep-in-store"])
def test_close_writes_back_only_what_is_read_again(tmp_path, monkeypatch, restore):
    """restore_params=True: the blocks' values go back into the module and their store regions are never read
    again (a checkpoint after fit gathers the weights from the module), so the RAM copies of the blocks are not
    written back at close; the optimizer chunks are (a checkpoint after fit streams them from the store).
    restore_params=False: the store is where the weights stay, so the blocks are written back too."""
    ref = fit(tmp_path / "ref", "auto", "adamw")
    writes = WritesAfterTraining(monkeypatch)
    strategy = offload(tmp_path / "off", EVERYTHING, restore_params=restore)
    model = fit(tmp_path / "off", strategy, "adamw", [writes])
    blocks = {b.region for b in strategy.param_offload.blocks}
    chunks = {c.region for off in strategy.offloaded for c in off.chunks}
    assert blocks <= strategy.shelf_plan.kept and chunks <= strategy.shelf_plan.kept
    assert chunks <= set(writes.regions)
    assert not blocks & set(writes.regions) if restore else blocks <= set(writes.regions)
    if restore:
        assert_same(ref, model, "restored from the shelf")


def test_budget_above_available_memory_is_refused(tmp_path):
    too_much = available_host_memory() + 64 * GiB
    with pytest.raises(ConfigError, match="host_memory_budget.*available"):
        trainer(tmp_path, offload(tmp_path, too_much), steps=1).fit(TinyGPT())


@pytest.mark.parametrize("value", [-1, "lots", 1.5, True])
def test_bad_budget_values_are_refused(tmp_path, value):
    with pytest.raises(ConfigError, match="host_memory_budget"):
        offload(tmp_path, value)
