"""Streamed checkpoints: resume in a new process is bitwise equal to the uninterrupted run (moments,
step counts and master weights restored, unlike DeepSpeed's NVMe path), plain-checkpoint conversion
both ways, atomic replacement, and no materialization of the whole state while saving."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from ckpt_helpers import parts_dir
from lightning.pytorch import Trainer
from models import MLP

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.checkpoint import convert

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # models.py, ckpt_helpers.py


def trainer(root, strategy, epochs, precision="32-true", **kw):
    return Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", max_epochs=epochs,
                   accumulate_grad_batches=2, gradient_clip_val=0.5, precision=precision, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, **kw)


def offload(tmp_path, name="store", **kw):
    return NVMeOffloadStrategy(store_dir=str(tmp_path / name), chunk_bytes=16 << 10, **kw)


def resume_in_new_process(tmp_path, ckpt, out, strategy_expr, precision="32-true"):
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {TESTS!r})
        import lightning_nvme
        from lightning_nvme import NVMeOffloadStrategy
        from lightning.pytorch import Trainer
        from models import MLP
        model = MLP()
        t = Trainer(default_root_dir={str(tmp_path / 'resume')!r}, strategy={strategy_expr}, accelerator="cpu",
                    max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, precision={precision!r},
                    logger=False, enable_progress_bar=False, enable_checkpointing=False)
        t.fit(model, ckpt_path={str(ckpt)!r})
        torch.save({{n: p.detach().clone() for n, p in model.named_parameters()}}, {str(out)!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    return torch.load(out)


def assert_params_equal(model, params):
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), f"parameter {name} differs after resume"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    model = MLP()
    trainer(root, "auto", 2, enable_checkpointing=False).fit(model)
    return model


def test_resume_in_new_process_is_bitwise_equal(tmp_path, reference):
    model = MLP()
    t = trainer(tmp_path, offload(tmp_path), 1, enable_checkpointing=False)
    t.fit(model)
    ckpt = tmp_path / "epoch1.ckpt"
    t.save_checkpoint(ckpt)
    assert ckpt.is_file() and os.path.exists(os.path.join(parts_dir(ckpt), "optimizer-0.safetensors"))
    params = resume_in_new_process(
        tmp_path, ckpt, tmp_path / "p.pt",
        f"NVMeOffloadStrategy(store_dir={str(tmp_path / 'store2')!r}, chunk_bytes=16 << 10)")
    assert_params_equal(reference, params)


def test_checkpoint_restores_moments_and_step(tmp_path):
    model = MLP()
    t = trainer(tmp_path, offload(tmp_path), 1, enable_checkpointing=False)
    t.fit(model)
    ckpt = tmp_path / "a.ckpt"
    t.save_checkpoint(ckpt)
    plain = tmp_path / "plain.ckpt"
    convert.to_lightning(str(ckpt), str(plain))
    state = torch.load(plain, weights_only=False)["optimizer_states"][0]["state"]
    assert all(float(s["step"]) == 16 for s in state.values() if "step" in s)
    assert any(s["exp_avg_sq"].abs().sum() > 0 for s in state.values())


def test_plain_conversion_resumes_without_plugin(tmp_path, reference):
    model = MLP()
    t = trainer(tmp_path, offload(tmp_path), 1, enable_checkpointing=False)
    t.fit(model)
    t.save_checkpoint(tmp_path / "dir.ckpt")
    convert.to_lightning(str(tmp_path / "dir.ckpt"), str(tmp_path / "plain.ckpt"))
    params = resume_in_new_process(tmp_path, tmp_path / "plain.ckpt", tmp_path / "p.pt", '"auto"')
    assert_params_equal(reference, params)


def test_plain_checkpoint_resumes_with_plugin_and_converts_back(tmp_path, reference):
    model = MLP()
    t = trainer(tmp_path, "auto", 1, enable_checkpointing=False)
    t.fit(model)
    t.save_checkpoint(tmp_path / "plain.ckpt")
    params = resume_in_new_process(tmp_path, tmp_path / "plain.ckpt", tmp_path / "p.pt",
                                   f"NVMeOffloadStrategy(store_dir={str(tmp_path / 's')!r}, chunk_bytes=16 << 10)")
    assert_params_equal(reference, params)
    convert.from_lightning(str(tmp_path / "plain.ckpt"), str(tmp_path / "back.ckpt"))
    params = resume_in_new_process(tmp_path, tmp_path / "back.ckpt", tmp_path / "q.pt",
                                   f"NVMeOffloadStrategy(store_dir={str(tmp_path / 's')!r}, chunk_bytes=16 << 10)")
    assert_params_equal(reference, params)


def test_model_checkpoint_callback_and_atomic_overwrite(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, every_n_train_steps=4, save_top_k=-1)
    model = MLP()
    trainer(tmp_path, offload(tmp_path), 1, callbacks=[cb]).fit(model)
    last = tmp_path / "ckpts" / "last.ckpt"
    assert last.is_file() and os.listdir(parts_dir(last)) == ["optimizer-0.safetensors"]
    leftovers = [p for p in os.listdir(tmp_path / "ckpts") if ".tmp-" in p or p.endswith(".old")]
    assert leftovers == []
    ckpts = sorted(os.listdir(tmp_path / "ckpts"))  # every top-k checkpoint kept, each one file with its state inside
    assert len(ckpts) > 2 and all(name.endswith(".ckpt") for name in ckpts)
    assert all("optimizer-0.safetensors" in torch.load(tmp_path / "ckpts" / n, mmap=True)["lightning_nvme"]["records"]
               for n in ckpts)


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    from lightning_nvme.checkpoint.copy import streamed

    model = MLP()
    t = trainer(tmp_path, offload(tmp_path), 1, enable_checkpointing=False)
    t.fit(model)
    ckpt = tmp_path / "x.ckpt"
    t.save_checkpoint(ckpt)
    state_file = os.path.join(parts_dir(ckpt), "optimizer-0.safetensors")
    before = ckpt.read_bytes(), open(state_file, "rb").read()

    def boom(*a, **k):
        raise OSError("disk went away mid-checkpoint")

    monkeypatch.setattr(streamed.SafetensorsWriter, "write", boom)
    with pytest.raises(OSError, match="mid-checkpoint"):
        t.save_checkpoint(ckpt)
    assert (ckpt.read_bytes(), open(state_file, "rb").read()) == before
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []
    assert not os.path.exists(str(ckpt) + ".optim")  # the failed save's temp state files are gone


def test_save_streams_without_materializing_state(tmp_path, monkeypatch):
    from lightning_nvme.optim import OffloadedOptimizer

    def forbidden(self):
        raise AssertionError("state_dict() materializes the whole optimizer state")

    monkeypatch.setattr(OffloadedOptimizer, "state_dict", forbidden)
    cb_path = tmp_path / "s.ckpt"
    model = MLP()
    t = trainer(tmp_path, offload(tmp_path), 1, enable_checkpointing=False)

    from lightning.pytorch.callbacks import Callback

    class SaveMidway(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            trainer.save_checkpoint(cb_path)

    t.callbacks.append(SaveMidway())
    t.fit(model)
    assert cb_path.is_file() and os.path.isdir(parts_dir(cb_path))
