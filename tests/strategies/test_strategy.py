"""NVMeOffloadStrategy: bitwise equality with in-memory training, construction from a string,
argument validation, and that no large optimizer state is resident."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from models import MLP

import lightning_nvme  # noqa: F401  (registers the strategy)
from lightning_nvme import NVMeOffloadStrategy


def fit(tmp_path, strategy, *, optimizer="adamw", steps=32, accumulate=2, clip=0.5, clip_algo="norm",
        precision="32-true", **module_kwargs):
    model = MLP(optimizer, **module_kwargs)
    trainer = Trainer(default_root_dir=tmp_path, strategy=strategy, accelerator="cpu", devices=1,
                      max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                      gradient_clip_algorithm=clip_algo, precision=precision, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    return model, trainer


def assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused", "adam", "sgd", "rmsprop", "adagrad"])
def test_bitwise_equal_to_in_memory(tmp_path, optimizer):
    ref, _ = fit(tmp_path / "ref", "auto", optimizer=optimizer)
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=16 << 10, prefetch_depth=2)
    off, trainer = fit(tmp_path / "off", strategy, optimizer=optimizer)
    assert trainer.global_step == 32
    assert_same_params(ref, off)


def test_backward_overlap_bitwise_equal_with_value_clipping(tmp_path):
    ref, _ = fit(tmp_path / "ref", "auto", clip_algo="value")
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=16 << 10, overlap="backward")
    off, _ = fit(tmp_path / "off", strategy, clip_algo="value")
    assert_same_params(ref, off)


def test_backward_overlap_refuses_norm_clipping(tmp_path):
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), overlap="backward")
    with pytest.raises(ValueError, match="norm clipping"):
        fit(tmp_path, strategy, clip=1.0, clip_algo="norm")


def test_from_string_uses_default_store_dir_and_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_NVME_STORE_DIR", raising=False)
    model = MLP()
    trainer = Trainer(default_root_dir=tmp_path, strategy="nvme_offload", accelerator="cpu", max_steps=3,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, NVMeOffloadStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")
    trainer.fit(model)
    assert (tmp_path / "nvme_store" / "store-rank0.bin").exists()


def test_store_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_NVME_STORE_DIR", str(tmp_path / "env_store"))
    trainer = Trainer(default_root_dir=tmp_path / "root", strategy="nvme_offload", accelerator="cpu", max_steps=2,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(MLP())
    assert (tmp_path / "env_store" / "store-rank0.bin").exists()


@pytest.mark.parametrize("kwargs, key", [
    ({"chunk_bytes": -1}, "chunk_bytes"),
    ({"io_chunk_bytes": 5000}, "io_chunk_bytes"),
    ({"prefetch_depth": 0}, "prefetch_depth"),
    ({"io_workers": 0}, "io_workers"),
    ({"overlap": "sometimes"}, "overlap"),
    ({"staging_bytes": 4096, "io_chunk_bytes": 8192}, "staging_bytes"),
    ({"io_profile": "/nonexistent/profile.json"}, "io_profile"),
])
def test_invalid_arguments_are_named(kwargs, key):
    with pytest.raises(ValueError, match=key):
        NVMeOffloadStrategy(**kwargs)


def test_unknown_argument_is_named():
    with pytest.raises(TypeError, match="chunk_size"):
        NVMeOffloadStrategy(chunk_size=1)


def test_no_large_state_resident(tmp_path):
    """During training the optimizer's own ``state`` (what Lightning's device walks see) stays empty,
    the state is spread over several chunks, and the store holds all of it."""
    from lightning.pytorch.callbacks import Callback

    seen = {}

    class Inspect(Callback):
        def on_train_batch_end(self, trainer, *args):
            off = trainer.strategy.offloaded[0]
            seen.update(state_entries=len(trainer.optimizers[0].state), chunks=len(off.chunks),
                        state_bytes=off.state_bytes, ring=off.ring.total_bytes)

    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=8 << 10)
    model = MLP()
    trainer = Trainer(default_root_dir=tmp_path, strategy=strategy, accelerator="cpu", max_steps=4, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, callbacks=[Inspect()])
    trainer.fit(model)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert seen["state_entries"] == 0
    assert seen["chunks"] > 4
    assert seen["state_bytes"] >= 2 * trainable  # AdamW: exp_avg + exp_avg_sq, all on disk
    assert seen["ring"] < seen["state_bytes"]


def test_bf16_true_matches_fp32_master_weight_reference(tmp_path):
    """bf16 params, fp32 master weights and moments in the store: equal to an in-memory loop that keeps
    fp32 masters, steps AdamW on them and casts back."""
    from models import dataset, fp32_master_step

    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=16 << 10)
    off, _ = fit(tmp_path, strategy, steps=20, accumulate=1, clip=None, precision="bf16-true")

    ref = MLP().bfloat16()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    masters = {p: p.detach().float().clone() for p in trainable}
    names = {p: n for n, p in ref.named_parameters()}
    decay = [masters[p] for p in trainable if names[p].endswith("weight")]
    no_decay = [masters[p] for p in trainable if not names[p].endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "lr": 5e-3, "weight_decay": 0.0}],
                            lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=False)
    for step, (x, y) in zip(range(20), loader):
        loss = torch.nn.functional.cross_entropy(ref(x.bfloat16()).float(), y)
        loss.backward()
        fp32_master_step(trainable, masters, opt)
        sched.step()
    for (name, p), q in zip(off.named_parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, q), f"parameter {name} differs"


def test_manual_optimization_with_two_optimizers(tmp_path):
    from models import TwoOptimizers

    def run(strategy, root):
        model = TwoOptimizers()
        Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", max_steps=40, logger=False,
                enable_checkpointing=False, enable_progress_bar=False).fit(model)
        return model

    ref = run("auto", tmp_path / "ref")
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=8 << 10)
    off = run(strategy, tmp_path / "off")
    assert_same_params(ref, off)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_configure_optimizers_returning_none_trains_as_under_the_default_strategy(tmp_path, manual):
    """Lightning steps its ``_MockOptimizer`` then: nothing to offload, no store is opened, and the run (manual
    optimization updating the parameters by hand included) equals the default strategy's."""
    from models import NoOptimizer

    def run(strategy, root):
        model = NoOptimizer(manual=manual)
        # one short epoch: manual optimization without an optimizer never advances global_step (max_steps)
        trainer = Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", max_epochs=1,
                          limit_train_batches=6, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(model)
        return model, trainer

    ref, ref_trainer = run("auto", tmp_path / "ref")
    for overlap in ("step", "backward"):
        strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / f"store-{overlap}"), chunk_bytes=8 << 10,
                                       overlap=overlap)
        off, trainer = run(strategy, tmp_path / f"off-{overlap}")
        assert trainer.global_step == ref_trainer.global_step
        assert strategy.offloaded == [] and strategy.nvme_store is None
        assert_same_params(ref, off)
    start = NoOptimizer(manual=manual)
    assert any(not torch.equal(p, q) for p, q in zip(ref.parameters(), start.parameters())) == manual


def test_preflight_refuses_a_disk_too_small_before_training(tmp_path, monkeypatch):
    """The strategy plans the store's size and refuses at setup, naming the path and the bytes."""
    import shutil
    from collections import namedtuple

    from lightning_nvme.preflight.resources import ConfigError

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 20, 10 << 20, 4096))
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=16 << 10, min_free_bytes=0)
    with pytest.raises(ConfigError, match="store_dir") as info:
        fit(tmp_path, strategy, steps=1)
    assert str(tmp_path / "store") in str(info.value)


def test_preflight_refuses_missing_parent(tmp_path, monkeypatch):
    from lightning_nvme.preflight import resources
    from lightning_nvme.preflight.resources import ConfigError

    monkeypatch.setattr(resources, "MOUNT_ROOTS", resources.MOUNT_ROOTS + (str(tmp_path),))
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "not-mounted" / "store"))
    with pytest.raises(ConfigError, match="store_dir"):
        fit(tmp_path, strategy, steps=1)


@pytest.mark.parametrize("threshold", [1 << 20, None])
def test_malloc_threshold_is_applied_at_setup(tmp_path, monkeypatch, threshold):
    """Freed chunk temporaries must go back to the OS (see lightning_nvme.memory); None leaves malloc alone."""
    from lightning_nvme.strategies import store_open

    calls = []
    monkeypatch.setattr(store_open, "release_freed_memory", lambda t: calls.append(t) or True)
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "s"), malloc_mmap_threshold=threshold)
    fit(tmp_path, strategy, steps=1)
    assert calls == ([threshold] if threshold else [])


def test_auto_malloc_threshold_is_lower_when_parameters_are_offloaded():
    """Memory first when the model does not fit: 8 MiB with offload_params, else glibc's 32 MiB maximum."""
    from lightning_nvme.memory import HEAP_MMAP_THRESHOLD_MAX, OFF_HEAP_THRESHOLD
    from lightning_nvme.settings import OffloadSettings

    assert OffloadSettings().mmap_threshold() == HEAP_MMAP_THRESHOLD_MAX == 32 << 20
    assert OffloadSettings(offload_params=True).mmap_threshold() == OFF_HEAP_THRESHOLD == 8 << 20
    assert OffloadSettings(offload_params=True, malloc_mmap_threshold=1 << 20).mmap_threshold() == 1 << 20
    assert OffloadSettings(malloc_mmap_threshold=None).mmap_threshold() is None


def test_release_freed_memory_on_glibc():
    import platform

    from lightning_nvme.memory import release_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert release_freed_memory(1 << 20)
