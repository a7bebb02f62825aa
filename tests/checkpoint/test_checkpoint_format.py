"""Checkpoints of nvme_offload as Lightning users handle them (issue 11, failures 4-6):

- the path given is one file that ``torch.load`` (weights_only, torch's default), ``load_from_checkpoint`` and a
  plain ``Trainer(strategy="auto")`` open; a plain ``fit`` from it refuses instead of restarting Adam's moments;
- its optimizer state lies beside it, tied by a save id: a file paired with another save's state, or missing
  it, is refused by name; ``on_load_checkpoint`` sees Lightning's usual dict, no private key;
- a user's ``CheckpointIO`` and ``storage_options`` carry what they can (weights-only checkpoints) and streamed
  state is refused with the reason; an fsspec URL is written through fsspec or refused, never to a local
  directory named after it;
- saving over an existing plain file, a directory (another strategy's sharded checkpoint) or a checkpoint of this
  format works, leaving no hidden debris.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from models import MLP
from torch.utils.data import DataLoader

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy


def trainer(root, strategy, epochs, **kw):
    kw.setdefault("enable_checkpointing", False)
    return Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", max_epochs=epochs, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, **kw)


def offload(tmp_path, name="store", **kw):
    return NVMeOffloadStrategy(store_dir=str(tmp_path / name), chunk_bytes=16 << 10, **kw)


def params_equal(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def predict(model_or_none, root, ckpt=None):
    batches = DataLoader(torch.randn(8, 32, generator=torch.Generator().manual_seed(3)), batch_size=4)
    return torch.cat(trainer(root, "auto", 1).predict(model_or_none, batches, ckpt_path=ckpt))


def hidden(directory) -> list[str]:
    out = []
    for root, dirs, files in os.walk(directory):
        out += [n for n in dirs + files if n.startswith(".")]
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One epoch under nvme_offload, saved; the trained model; a default-strategy reference of two epochs."""
    tmp = tmp_path_factory.mktemp("saved")
    model = MLP()
    t = trainer(tmp, offload(tmp), 1)
    t.fit(model)
    path = tmp / "one.ckpt"
    t.save_checkpoint(path)
    reference = MLP()
    trainer(tmp / "ref", "auto", 2).fit(reference)
    return {"tmp": tmp, "trainer": t, "model": model, "path": path, "reference": reference}


# ---- failure 4: Lightning's own loaders open the checkpoint ----------------------------------------------------
def test_checkpoint_is_a_file_lightnings_loaders_open(saved, tmp_path):
    path, model = saved["path"], saved["model"]
    assert path.is_file()
    loaded = torch.load(path)  # torch's default: weights_only=True
    assert loaded["global_step"] == model.trainer.global_step
    for name, p in model.state_dict().items():
        assert torch.equal(loaded["state_dict"][name], p), name
    assert "optimizer_states" not in loaded  # so a plain Trainer never resumes without the moments
    restored = MLP.load_from_checkpoint(path)
    assert params_equal(restored, model)
    assert torch.equal(predict(MLP(), tmp_path, ckpt=str(path)), predict(model, tmp_path))


def test_one_file_torch_zip_with_4k_aligned_state_records(saved):
    """The checkpoint is one torch zip: every record at a 4 KiB-aligned offset, the optimizer state a record of it
    (read by torch.load with weights_only=True and with mmap=True), nothing beside the file."""
    from lightning_nvme.checkpoint.onefile import record_offsets
    from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader

    path = saved["path"]
    assert sorted(os.listdir(path.parent)) == sorted(p for p in os.listdir(path.parent) if not p.endswith(".optim"))
    offsets = record_offsets(str(path))
    assert offsets and all(off % 4096 == 0 for off, _ in offsets.values()), offsets
    for kw in ({"weights_only": True}, {"weights_only": True, "mmap": True}, {"weights_only": False}):
        records = torch.load(path, **kw)["lightning_nvme"]["records"]
        assert list(records) == ["optimizer-0.safetensors"]
        (record,) = records.values()
        assert record.dtype == torch.uint8 and record.numel() % 4096 == 0
        keys = {k.split(".", 2)[2] for k in SafetensorsReader("record", record).entries}  # read in place
        assert keys == {"exp_avg", "exp_avg_sq"}


def test_the_file_copied_alone_resumes_bitwise(saved, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(saved["path"], elsewhere / "moved.ckpt")
    model = MLP()
    trainer(tmp_path, offload(tmp_path), 2).fit(model, ckpt_path=str(elsewhere / "moved.ckpt"))
    assert params_equal(model, saved["reference"])


def test_version2_checkpoint_still_resumes_bitwise(saved, tmp_path):
    from ckpt_helpers import write_beside

    write_beside(saved["path"], tmp_path / "v2.ckpt")
    assert (tmp_path / "v2.ckpt.optim").is_dir()
    model = MLP()
    trainer(tmp_path, offload(tmp_path), 2).fit(model, ckpt_path=str(tmp_path / "v2.ckpt"))
    assert params_equal(model, saved["reference"])


def test_plain_trainer_fit_refuses_instead_of_restarting_the_moments(saved, tmp_path):
    with pytest.raises(KeyError, match="optimizer state"):
        trainer(tmp_path, "auto", 2).fit(MLP(), ckpt_path=str(saved["path"]))
    assert "convert to-lightning" in torch.load(saved["path"])["lightning_nvme"]["note"]


def test_resume_from_the_file_is_bitwise(saved, tmp_path):
    model = MLP()
    trainer(tmp_path, offload(tmp_path), 2).fit(model, ckpt_path=str(saved["path"]))
    assert params_equal(model, saved["reference"])


def test_on_load_checkpoint_sees_lightnings_usual_dict(saved, tmp_path):
    seen = {}

    class Spy(MLP):
        def on_load_checkpoint(self, checkpoint):
            seen.update(keys=set(checkpoint), groups=checkpoint["optimizer_states"][0]["param_groups"])

    trainer(tmp_path, offload(tmp_path), 2).fit(Spy(), ckpt_path=str(saved["path"]))
    assert "optimizer_states" in seen["keys"] and not any("nvme" in k for k in seen["keys"]), seen["keys"]
    assert len(seen["groups"]) == 2


def test_version2_mismatched_or_missing_optimizer_state_is_refused(saved, tmp_path):
    """A checkpoint of format version 2 (state beside the file): the file with another save's state, or alone."""
    from ckpt_helpers import write_beside

    t, path = saved["trainer"], saved["path"]
    v2 = tmp_path / "v2"
    v2.mkdir()
    write_beside(path, v2 / "saved.ckpt")
    path = v2 / "saved.ckpt"
    first = tmp_path / "first.ckpt"
    t.save_checkpoint(tmp_path / "second.ckpt")
    write_beside(tmp_path / "second.ckpt", first)  # first.ckpt.optim holds the second save's state only
    stale = tmp_path / "stale.ckpt"
    shutil.copy(path, stale)  # the file of the first save ...
    shutil.copytree(str(first) + ".optim", str(stale) + ".optim")  # ... beside the state of the second
    with pytest.raises(RuntimeError, match="different saves"):
        trainer(tmp_path, offload(tmp_path, "s1"), 2).fit(MLP(), ckpt_path=str(stale))
    lonely = tmp_path / "lonely.ckpt"
    shutil.copy(path, lonely)
    with pytest.raises(RuntimeError, match=r"copy the \.optim directory along with the file"):
        trainer(tmp_path, offload(tmp_path, "s2"), 2).fit(MLP(), ckpt_path=str(lonely))
    assert params_equal(MLP.load_from_checkpoint(lonely), saved["model"])  # the weights still load


# ---- failure 5: CheckpointIO and storage_options, remote URLs ---------------------------------------------------
class RecordingIO(TorchCheckpointIO):
    def __init__(self) -> None:
        self.saved: list[str] = []
        self.removed: list[str] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved.append(os.path.basename(str(path)))
        super().save_checkpoint(checkpoint, path)

    def remove_checkpoint(self, path):
        self.removed.append(os.path.basename(str(path)))
        super().remove_checkpoint(path)


def test_user_checkpoint_io_carries_weights_only_and_the_one_file(tmp_path):
    io = RecordingIO()
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_weights_only=True, save_top_k=1, every_n_train_steps=16)
    model = MLP()
    t = trainer(tmp_path, offload(tmp_path, checkpoint_io=io), 1, callbacks=[cb], enable_checkpointing=True)
    t.fit(model)
    assert io.saved == ["epoch=0-step=16.ckpt", "epoch=0-step=32.ckpt"] and io.removed == ["epoch=0-step=16.ckpt"]
    assert params_equal(MLP.load_from_checkpoint(tmp_path / "ckpts" / "epoch=0-step=32.ckpt"), model)
    t.save_checkpoint(tmp_path / "full.ckpt")  # with the optimizer state: the one file, through the plugin
    assert io.saved[-1] == "full.ckpt" and "handed to RecordingIO" in t.strategy.checkpoint_saves[-1].reason
    assert not [p for p in os.listdir(tmp_path / "store") if p.startswith(".lightning_nvme-ckpt-")]  # staging gone
    resumed = MLP()
    trainer(tmp_path, offload(tmp_path, "s2"), 2).fit(resumed, ckpt_path=str(tmp_path / "full.ckpt"))
    reference = MLP()
    trainer(tmp_path / "ref", "auto", 2).fit(reference)
    assert params_equal(resumed, reference)


def test_async_checkpoint_io_writes_the_one_file_without_cloning_the_state(saved, tmp_path, monkeypatch):
    """AsyncCheckpointIO clones every tensor of the checkpoint before its thread runs: the state records reach it
    as file-mapped storages instead, so the clone holds the weights only; the file resumes bitwise."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, async_plugin

    cloned: list[int] = []
    real = async_plugin._clone_tensor
    monkeypatch.setattr(async_plugin, "_clone_tensor", lambda t: cloned.append(t.numel() * t.element_size()) or real(t))
    t = saved["trainer"]
    plugin = AsyncCheckpointIO()
    t.strategy.checkpoint_io = plugin
    try:
        t.save_checkpoint(tmp_path / "async.ckpt")
        plugin.teardown()  # waits for the thread
    finally:
        t.strategy.checkpoint_io = None
    state = torch.load(tmp_path / "async.ckpt", mmap=True)["lightning_nvme"]["records"]["optimizer-0.safetensors"]
    weights = sum(p.numel() * p.element_size() for p in saved["model"].parameters())
    assert sum(cloned) <= weights + 4096 < state.nbytes()
    model = MLP()
    trainer(tmp_path, offload(tmp_path), 2).fit(model, ckpt_path=str(tmp_path / "async.ckpt"))
    assert params_equal(model, saved["reference"])


def test_storage_options_go_to_the_plugin(saved, tmp_path):
    seen = {}

    class OptionsIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            seen["options"] = storage_options
            super().save_checkpoint(checkpoint, path)

    t = saved["trainer"]
    t.strategy.checkpoint_io = OptionsIO()
    try:
        t.save_checkpoint(tmp_path / "x.ckpt", storage_options={"k": 1})
    finally:
        t.strategy.checkpoint_io = None
    assert seen["options"] == {"k": 1} and (tmp_path / "x.ckpt").is_file()
    with pytest.raises(TypeError, match="storage_options"):  # Lightning's own refusal for its default plugin
        t.save_checkpoint(tmp_path / "y.ckpt", storage_options={"k": 1})


def test_remote_url_streams_the_one_file_through_fsspec(saved, tmp_path, monkeypatch):
    import fsspec

    monkeypatch.chdir(tmp_path)
    t = saved["trainer"]
    t.save_checkpoint("memory://run/full.ckpt")
    assert "streamed through fsspec" in t.strategy.checkpoint_saves[-1].reason
    assert t.strategy.checkpoint_saves[-1].checkpoint == "memory://run/full.ckpt"
    t.save_checkpoint("memory://run/weights.ckpt", weights_only=True)
    fs = fsspec.filesystem("memory")
    assert fs.exists("/run/weights.ckpt") and fs.exists("/run/full.ckpt")
    assert os.listdir(tmp_path) == []  # nothing written to a local path named after the URL
    with fs.open("/run/weights.ckpt", "rb") as f:
        assert torch.load(f)["global_step"] == t.global_step
    model = MLP()
    trainer(tmp_path, offload(tmp_path, "s3"), 2).fit(model, ckpt_path="memory://run/full.ckpt")
    assert params_equal(model, saved["reference"])
    fs.rm("/run", recursive=True)


# ---- failure 6: saving over what is there ------------------------------------------------------------------------
def test_resume_from_a_default_strategy_last_ckpt_saves_over_it(tmp_path):
    """The default strategy wrote a plain last.ckpt; nvme_offload resumes from it with save_last=True: the plain
    file is replaced by this format's file (no NotADirectoryError, no hidden leftover), and the result equals
    an uninterrupted default-strategy run."""
    ckpts = tmp_path / "ckpts"
    trainer(tmp_path, "auto", 1, callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True)],
            enable_checkpointing=True).fit(MLP())
    model = MLP()
    resumed = trainer(tmp_path, offload(tmp_path), 2, callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True)],
                      enable_checkpointing=True)
    resumed.fit(model, ckpt_path=str(ckpts / "last.ckpt"))
    reference = MLP()
    trainer(tmp_path / "ref", "auto", 2).fit(reference)
    assert params_equal(model, reference)
    assert not [n for n in os.listdir(ckpts) if n.endswith(".optim")]  # one file, its optimizer state inside
    assert torch.load(ckpts / "last.ckpt")["global_step"] == resumed.global_step
    assert hidden(ckpts) == []


def test_save_over_each_format_replaces_it_completely(saved, tmp_path):
    from lightning_nvme.checkpoint import convert

    t = saved["trainer"]
    plain, sharded_dir, ours = tmp_path / "plain.ckpt", tmp_path / "sharded.ckpt", tmp_path / "ours.ckpt"
    convert.to_lightning(str(saved["path"]), str(plain))
    # a directory at the path, as Lightning's FSDP/DeepSpeed strategies save a sharded checkpoint
    os.makedirs(sharded_dir / "checkpoint")
    torch.save({"global_step": 0}, sharded_dir / "checkpoint" / "meta.pt")
    from ckpt_helpers import write_beside

    v2 = tmp_path / "v2.ckpt"
    t.save_checkpoint(ours)
    write_beside(ours, v2)  # format version 2: the state beside the file
    first_id = torch.load(ours, mmap=True)["lightning_nvme"]["save_id"]
    for target in (plain, sharded_dir, v2, ours):
        t.save_checkpoint(target)
        assert target.is_file(), target
        assert not os.path.exists(str(target) + ".optim")  # one file: a replaced version 2's state is gone too
        assert torch.load(target)["global_step"] == t.global_step
    assert torch.load(ours, mmap=True)["lightning_nvme"]["save_id"] != first_id
    t.save_checkpoint(ours, weights_only=True)  # a weights-only save drops the optimizer state it replaces
    assert "lightning_nvme" not in torch.load(ours) and "optimizer_states" not in torch.load(ours)
    assert hidden(tmp_path) == []


def test_save_last_link_resumes_through_the_link(saved, tmp_path):
    """ModelCheckpoint(save_last="link"): last.ckpt is a symlink to the newest top-k file; its optimizer state is
    found beside the link's target, and the resume is bitwise."""
    ckpts = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=ckpts, save_last="link", every_n_epochs=1)
    trainer(tmp_path, offload(tmp_path), 1, callbacks=[cb], enable_checkpointing=True).fit(MLP())
    assert (ckpts / "last.ckpt").is_symlink() and not (ckpts / "last.ckpt.optim").exists()
    model = MLP()
    trainer(tmp_path, offload(tmp_path, "s2"), 2).fit(model, ckpt_path=str(ckpts / "last.ckpt"))
    assert params_equal(model, saved["reference"])


def test_callbacks_are_restored_before_on_fit_start(saved, tmp_path):
    """Lightning's order is kept (unlike restore_checkpoint_after_setup=True, which breaks e.g. BackboneFinetuning's
    resume): a callback's state is loaded before its on_fit_start, and the optimizer after setup."""
    from lightning.pytorch import Callback

    class Counter(Callback):
        def __init__(self) -> None:
            self.count, self.seen_at_fit_start = 0, None

        def on_fit_start(self, trainer, pl_module):
            self.seen_at_fit_start = self.count

        def on_train_epoch_end(self, trainer, pl_module):
            self.count += 1

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state_dict):
            self.count = state_dict["count"]

    first = Counter()
    t = trainer(tmp_path, offload(tmp_path), 1, callbacks=[first])
    t.fit(MLP())
    t.save_checkpoint(tmp_path / "c.ckpt")
    resumed = Counter()
    trainer(tmp_path, offload(tmp_path, "s2"), 2, callbacks=[resumed]).fit(MLP(), ckpt_path=str(tmp_path / "c.ckpt"))
    assert resumed.seen_at_fit_start == 1 and resumed.count == 2


def test_state_of_parameters_frozen_at_resume_is_not_dropped(saved, tmp_path):
    class FrozenBody(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.body[0].requires_grad_(False)

    with pytest.raises(ValueError, match=r"not trainable in this run's optimizer at restore time .* would silently "
                                         "restart"):
        trainer(tmp_path, offload(tmp_path), 2).fit(FrozenBody(), ckpt_path=str(saved["path"]))
