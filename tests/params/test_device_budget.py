"""device_memory_budget: parameter blocks kept on the GPU between uses, checked on CPU through the fake CUDA of
``fake_cuda`` (the CUDA transfer's logic: device copies are separate buffers, host <-> device copies recorded).
Which blocks stay (the plan), that a kept block is never read, copied or written back again during training
(every host <-> device copy and store request counted per block), results bitwise equal to the budget-0 path
through the same fake runtime and to in-memory training, checkpoints and resume unchanged, the refusals."""

from __future__ import annotations

import pytest
import torch
from _param_offload_model import TinyGPT
from fake_cuda import FakeOps, install
from lightning.pytorch import Callback
from test_param_offload import assert_same_params, fit, offload, reference, trainer
from torch import nn

from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.callbacks import IOTelemetry
from lightning_nvme.checks import ConfigError
from lightning_nvme.params import find_blocks, is_placeholder, transfer
from lightning_nvme.params.layout import plan_layout
from lightning_nvme.params.residency import BlockResidency
from lightning_nvme.params.transfer import CudaTransfer
from lightning_nvme.preflight import resources
from lightning_nvme.store import FlatStore
from lightning_nvme.strategies.placement import desk_block_item, plan_desk

CPU = torch.device("cpu")
EVERYTHING = 1 << 30


class CountingCuda(CudaTransfer):
    """The CUDA transfer's logic on CPU, recording which block each host <-> device copy moved once ``training``."""

    made: list[CountingCuda] = []

    def __init__(self, device, buffer_bytes, pool_size):
        super().__init__(CPU, buffer_bytes, pool_size, ops=FakeOps())
        self.residency: BlockResidency | None = None
        self.training = False
        self.uploads: list[int] = []  # block index of each host -> device copy
        self.downloads: list[int] = []
        CountingCuda.made.append(self)

    def _owner(self, t: torch.Tensor, *fields: str) -> int:
        assert self.residency is not None
        for block in self.residency.blocks:
            st = self.residency._state[block.index]
            if any(getattr(st, f) is not None and getattr(st, f).data_ptr() == t.data_ptr() for f in fields):
                return block.index
        raise AssertionError("a copy of a buffer no block holds")

    def upload(self, host):
        if self.training:
            self.uploads.append(self._owner(host, "buffer"))
        return super().upload(host)

    def to_host(self, device, host):
        if self.training:
            self.downloads.append(self._owner(device, "device", "kept"))
        return super().to_host(device, host)


class Watch(Callback):
    """While training runs: the copies per block (``CountingCuda``), the store requests per region, and that a kept
    block's parameters stay views of the same device copy from the first step to the last."""

    def __init__(self, monkeypatch) -> None:
        self.requests: set[str] = set()
        self.training = False
        self.kept_storage: dict[str, int] = {}
        self.rebound: list[str] = []
        for name in ("read", "write"):
            original = getattr(FlatStore, name)

            def recorded(store, region, t, offset=0, _do=original, **kwargs):
                if self.training:
                    self.requests.add(region)
                return _do(store, region, t, offset, **kwargs)
            monkeypatch.setattr(FlatStore, name, recorded)

    def _kept(self, trainer):
        off = trainer.strategy.param_offload
        return {s.name: s.param.untyped_storage().data_ptr() for b in off.blocks if off.residency.kept(b)
                for s in b.slots}

    def on_train_start(self, trainer, pl_module):
        stage = CountingCuda.made[-1]
        stage.residency, stage.training, self.training = trainer.strategy.param_offload.residency, True, True
        self.kept_storage = self._kept(trainer)

    def on_train_batch_end(self, trainer, pl_module, *args):
        now = self._kept(trainer)
        self.rebound += [n for n, ptr in self.kept_storage.items() if now.get(n) != ptr]

    def on_train_end(self, trainer, pl_module):
        CountingCuda.made[-1].training = self.training = False


@pytest.fixture
def fake_cuda(monkeypatch):
    """Blocks staged through ``CountingCuda``; the device reports 64 GiB free."""
    install(monkeypatch)
    CountingCuda.made = []
    monkeypatch.setattr(transfer, "transfer_for", CountingCuda)
    monkeypatch.setattr(resources, "device_free_bytes", lambda device: 64 << 30)
    return monkeypatch


def _block_bytes(tmp_path) -> int:
    """One block's region (all TinyGPT blocks are the same size)."""
    model = TinyGPT()
    layout = plan_layout(model, find_blocks(model, None))
    store = FlatStore(tmp_path / "probe", io_chunk_bytes=4096)
    store.add_regions([(layout.blocks[0].region, layout.blocks[0].nbytes)])
    capacity = store.region(layout.blocks[0].region).capacity
    store.close(delete=True)
    return capacity


@pytest.mark.parametrize("which", ["partial", "everything"])
def test_kept_blocks_never_move_and_results_are_bitwise_equal(tmp_path, tmp_path_factory, fake_cuda, which):
    ref, _ = reference(tmp_path_factory, checkpointing=True)  # required on CUDA for the streamed blocks
    zero = offload(tmp_path / "zero")
    model0, _ = fit(tmp_path / "zero", zero, {"checkpointing": True})
    budget = 2 * _block_bytes(tmp_path) + 100 if which == "partial" else EVERYTHING
    watch, telemetry = Watch(fake_cuda), IOTelemetry(plot=False, prog_bar=False)
    strategy = offload(tmp_path / "desk", device_memory_budget=budget)
    model, _ = fit(tmp_path / "desk", strategy, {"checkpointing": True}, [watch, telemetry])
    assert_same_params(model0, model)  # the budget-0 path through the same fake CUDA runtime
    assert_same_params(ref, model)  # and in-memory training

    plan = strategy.desk_plan
    blocks = strategy.param_offload.blocks
    kept = [b.index for b in blocks if b.region in plan.kept]
    streamed = [b.index for b in blocks if b.index not in kept]
    if which == "partial":
        assert kept == [0, 1] and streamed == [2, 3]  # same density: the plan takes them in order while they fit
        assert plan.kept_bytes <= budget and 0 < plan.io_after < plan.io_before
    else:
        assert streamed == [] and plan.io_after == 0 and plan.streamed_bytes == 0
    stage = CountingCuda.made[-1]
    assert not set(kept) & set(stage.uploads), "a kept block was copied to the device again during training"
    assert not set(kept) & set(stage.downloads), "a kept block was copied back to the host during training"
    assert not {blocks[i].region for i in kept} & watch.requests, "a kept block was read or written in the store"
    assert watch.rebound == [] and watch.kept_storage  # bound to one device copy from the first step to the last
    if which == "partial":  # the count is not trivially empty: the others stream every step
        assert set(stage.uploads) == set(streamed) and set(stage.downloads) == set(streamed)
        assert {blocks[i].region for i in streamed} <= watch.requests
    else:  # the whole model fits: parameters never leave the device; only optimizer state streams
        assert stage.uploads == [] and stage.downloads == []
        assert watch.requests and all(r.startswith("opt") for r in watch.requests), watch.requests
    stats = strategy.param_offload.stats
    assert stats.kept_blocks == 0 and stats.peak_bound_blocks >= len(kept)  # let go at the end of fit
    summary = telemetry.summary_dict()["desk_plan"]
    assert summary == plan.as_dict() and summary["blocks_on_desk"] == len(kept)


class SaveAtEpochEnd(Callback):
    """``trainer.save_checkpoint`` at the end of the first epoch, mid-fit (where ``ModelCheckpoint`` saves)."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def test_checkpoint_from_kept_blocks_resumes_with_any_budget(tmp_path, fake_cuda):
    """Saved mid-fit with every block kept on the device (the weights streamed beside the file from the device
    copies), resumed with budget 0; saved with budget 0 (weights inline), resumed with every block kept (the
    weights loaded into the device copies): both bitwise equal to in-memory training's same save and resume."""
    ref_ckpt = tmp_path / "ref.ckpt"
    trainer(tmp_path / "ref", "auto", steps=-1, max_epochs=1, callbacks=[SaveAtEpochEnd(ref_ckpt)]).fit(
        TinyGPT(checkpointing=True))
    ref = TinyGPT(checkpointing=True)
    trainer(tmp_path / "ref2", "auto").fit(ref, ckpt_path=str(ref_ckpt))
    expected = torch.load(ref_ckpt, weights_only=True)["state_dict"]
    for save_budget, resume_budget, extra in ((EVERYTHING, 0, {"inline_weights_bytes": 0}), (0, EVERYTHING, {})):
        run = tmp_path / f"save{save_budget}"
        ckpt = run / "epoch1.ckpt"
        fit(run, offload(run, device_memory_budget=save_budget, **extra), {"checkpointing": True},
            [SaveAtEpochEnd(ckpt)], steps=-1, max_epochs=1)
        if not extra:  # weights gathered into the file: exactly in-memory training's
            saved = torch.load(ckpt, weights_only=True)["state_dict"]
            for name, p in expected.items():
                assert torch.equal(saved[name], p), name
        model = TinyGPT(checkpointing=True)
        again = run / "resume"
        strategy = offload(again, device_memory_budget=resume_budget)
        trainer(again, strategy).fit(model, ckpt_path=str(ckpt))
        assert_same_params(ref, model)


def test_kept_blocks_are_written_back_when_the_weights_stay_in_the_store(tmp_path, tmp_path_factory, fake_cuda):
    """restore_params=False: at the end of fit each kept block's device copy goes back to the store (its only
    write-back of the run), so the weights exported from the reopened store are the trained ones."""
    from safetensors.torch import load_file

    ref, _ = reference(tmp_path_factory, checkpointing=True)
    strategy = offload(tmp_path, device_memory_budget=EVERYTHING, restore_params=False)
    model, _ = fit(tmp_path, strategy, {"checkpointing": True})
    assert strategy.desk_plan.count("block", False) == 0
    assert all(is_placeholder(s.param) for b in strategy.param_offload.blocks for s in b.slots)
    strategy.export_weights(str(tmp_path / "w.safetensors"))
    exported = load_file(str(tmp_path / "w.safetensors"))
    for name, p in ref.state_dict().items():
        assert torch.equal(exported[name], p), name


# ---- the residency on its own ------------------------------------------------------------------------------
def test_keep_copies_once_then_reads_the_device_copy_and_writes_it_back_at_unkeep(tmp_path, monkeypatch):
    install(monkeypatch)
    ops = FakeOps()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(2)))
    layout = plan_layout(model, find_blocks(model, None))
    store = FlatStore(tmp_path, io_chunk_bytes=4096)
    store.add_regions([(b.region, b.nbytes) for b in layout.blocks])
    capacity = max(store.region(b.region).capacity for b in layout.blocks)
    res = BlockResidency(store, layout.blocks, transfer=CudaTransfer(CPU, capacity, pool_size=3, ops=ops))
    for block in layout.blocks:
        res.place(block)
    res.drain()
    block = layout.blocks[0]
    res.keep(block)
    assert res.kept(block) and not res.is_resident(block) and res.in_store(block)
    loads, copies = res.stats.loads, len(ops.device_buffers)
    for _ in range(3):  # used again and again: nothing read, nothing copied, the parameters stay bound
        res.prefetch(block)
        res.acquire(block, "forward")
        model[0].weight.data.add_(1)
        res.mark_dirty(block)
        res.release(block, "forward")
    assert res.stats.loads == loads and len(ops.device_buffers) == copies and not is_placeholder(model[0].weight)
    assert not res.in_store(block)  # the device copy is newer than the store
    expected = model[0].weight.detach().clone()
    assert torch.equal(res.read_values(block)["0.weight"], expected)  # read from the device copy
    res.unkeep(block)
    res.drain()
    assert is_placeholder(model[0].weight) and not res.kept(block) and res.in_store(block)
    assert torch.equal(res.read_values(block)["0.weight"], expected)  # written back to the store
    store.close()


def test_device_plan_takes_blocks_by_copies_saved_per_byte():
    items = [desk_block_item("params/frozen", 100, False), desk_block_item("params/a", 100, True),
             desk_block_item("params/b", 100, True)]
    plan = plan_desk(items, 250)
    assert plan.kept == {"params/a", "params/b"}  # trainable: up twice, down once; frozen: up twice
    assert plan.io_before == 200 + 300 + 300 and plan.io_after == 200
    assert plan.as_dict()["blocks_on_desk"] == 2 and "device_memory_budget=250 B" in plan.summary()


# ---- refusals ------------------------------------------------------------------------------------------------
def test_refused_where_it_would_be_ignored_or_cannot_fit(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="device_memory_budget.*offload_params=False"):
        NVMeOffloadStrategy(store_dir=str(tmp_path), device_memory_budget=1 << 20)
    with pytest.raises(ConfigError, match="device_memory_budget"):
        offload(tmp_path, device_memory_budget=-1)
    with pytest.raises(ConfigError, match="device_memory_budget.*host memory.*host_memory_budget"):  # a CPU run
        fit(tmp_path / "cpu", offload(tmp_path / "cpu", device_memory_budget=1 << 20), steps=1)
    install(monkeypatch)
    monkeypatch.setattr(transfer, "transfer_for", CountingCuda)
    monkeypatch.setattr(resources, "device_free_bytes", lambda device: 5 << 20)
    with pytest.raises(ConfigError, match=r"device_memory_budget.*6291456 bytes.*only 5242880 bytes"):
        fit(tmp_path / "big", offload(tmp_path / "big", device_memory_budget=6 << 20), {"checkpointing": True},
            steps=1)
