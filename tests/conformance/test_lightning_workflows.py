"""Representative Lightning workflows, each run once with the default strategy and once with ``nvme_offload``,
with equal results asserted (issue 11, item 7): BoringModel-style plain SGD, BackboneFinetuning,
load_from_checkpoint -> predict, ModelCheckpoint top-k + last (over plain files and this plugin's files),
a custom CheckpointIO, EarlyStopping and the LR finder. What a user writes, nothing adapted to the plugin.
"""

from __future__ import annotations

import os

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BackboneFinetuning, EarlyStopping, ModelCheckpoint
from models import MLP, dataset
from torch.utils.data import DataLoader

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy

STRATEGIES = ("auto", "nvme_offload")
class Monitored(MLP):
    """``MLP`` that logs a training and a validation loss, as monitored callbacks need."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x).float(), y))

    def val_dataloader(self):
        return DataLoader(dataset(64, seed=99), batch_size=32)


def make_trainer(kind: str, root, **kw) -> Trainer:
    strategy = "auto" if kind == "auto" else NVMeOffloadStrategy(store_dir=str(root / "store"), chunk_bytes=16 << 10)
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("limit_train_batches", 8)
    kw.setdefault("max_epochs", 2)
    return Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", logger=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), f"parameter {name} differs between the strategies"


def both(tmp_path, run) -> dict:
    """``run(kind, root) -> result`` for each strategy, in its own root directory."""
    return {kind: run(kind, tmp_path / kind) for kind in STRATEGIES}


# ---- training ---------------------------------------------------------------------------------------------------
class BoringSGD(Monitored):
    """Lightning's BoringModel habit: plain ``SGD(lr=0.1)``, momentum 0, no per-parameter state."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_boring_model_plain_sgd(tmp_path):
    def run(kind, root):
        model = BoringSGD()
        make_trainer(kind, root).fit(model)
        return model

    out = both(tmp_path, run)
    assert not torch.equal(out["auto"].head.weight, BoringSGD().head.weight)  # it trained
    assert_same_params(out["auto"], out["nvme_offload"])


class Finetuned(Monitored):
    """``BackboneFinetuning``'s contract: a ``backbone`` attribute, the optimizer built on trainable params only."""

    @property
    def backbone(self) -> torch.nn.Module:
        return self.body

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def test_backbone_finetuning(tmp_path):
    def run(kind, root):
        model = Finetuned()
        make_trainer(kind, root, max_epochs=3, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)]).fit(model)
        return model

    out = both(tmp_path, run)
    assert not torch.equal(out["auto"].body[0].weight, Finetuned().body[0].weight)  # the backbone trained
    assert_same_params(out["auto"], out["nvme_offload"])


def test_early_stopping(tmp_path):
    def run(kind, root):
        model = Monitored()
        stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=0.05)
        trainer = make_trainer(kind, root, max_epochs=8, callbacks=[stop])
        trainer.fit(model)
        return model, trainer.current_epoch, stop.stopped_epoch, stop.best_score

    out = both(tmp_path, run)
    (a, epoch_a, stopped_a, best_a), (b, epoch_b, stopped_b, best_b) = out["auto"], out["nvme_offload"]
    assert 0 < stopped_a < 7  # it stopped early
    assert (epoch_a, stopped_a) == (epoch_b, stopped_b) and torch.equal(best_a, best_b)
    assert_same_params(a, b)


def test_lr_finder(tmp_path):
    from lightning.pytorch.tuner import Tuner

    def run(kind, root):
        model = Monitored()
        trainer = make_trainer(kind, root, max_epochs=1, limit_train_batches=16)
        finder = Tuner(trainer).lr_find(model, min_lr=1e-4, max_lr=1.0, num_training=12, update_attr=False)
        leftovers = [n for n in os.listdir(root) if "lr_find" in n]  # its temporary checkpoint is removed
        return model, finder.results, finder.suggestion(), leftovers

    out = both(tmp_path, run)
    (a, results_a, lr_a, left_a), (b, results_b, lr_b, left_b) = out["auto"], out["nvme_offload"]
    assert results_a == results_b and lr_a == lr_b
    assert left_a == left_b == []
    assert_same_params(a, b)  # the model is back at its initial weights in both


# ---- checkpoints ------------------------------------------------------------------------------------------------
def test_load_from_checkpoint_then_predict(tmp_path):
    batches = DataLoader(torch.randn(16, 32, generator=torch.Generator().manual_seed(5)), batch_size=8)

    def run(kind, root):
        cb = ModelCheckpoint(dirpath=root / "ckpts", monitor="val_loss", save_top_k=1)
        make_trainer(kind, root, callbacks=[cb], enable_checkpointing=True).fit(Monitored())
        restored = Monitored.load_from_checkpoint(cb.best_model_path)
        predicted = torch.cat(make_trainer("auto", root).predict(restored, batches))
        return os.path.basename(cb.best_model_path), predicted

    out = both(tmp_path, run)
    assert out["auto"][0] == out["nvme_offload"][0]
    assert torch.equal(out["auto"][1], out["nvme_offload"][1])


def _kept(directory) -> dict[str, dict]:
    """Checkpoint file name -> its weights, for the checkpoints in ``directory`` (not their .optim state)."""
    return {n: torch.load(os.path.join(directory, n))["state_dict"] for n in sorted(os.listdir(directory))
            if n.endswith(".ckpt")}


def test_model_checkpoint_top_k_and_last_over_both_formats(tmp_path):
    """Three epochs with the default strategy write plain top-2 + last checkpoints; each strategy then resumes
    from that plain last.ckpt into the same directory for two more epochs, replacing plain files (last.ckpt,
    top-k ones that drop out) with its own: same files kept, same weights in them, same final model."""
    def run(kind, root):
        ckpts = root / "ckpts"

        def callback():
            return ModelCheckpoint(dirpath=ckpts, monitor="val_loss", save_top_k=2, save_last=True)

        make_trainer("auto", root, max_epochs=3, callbacks=[callback()], enable_checkpointing=True).fit(Monitored())
        model, cb = Monitored(), callback()
        make_trainer(kind, root, max_epochs=5, callbacks=[cb], enable_checkpointing=True).fit(
            model, ckpt_path=str(ckpts / "last.ckpt"))
        scores = {os.path.basename(p): s for p, s in cb.best_k_models.items()}
        return model, _kept(ckpts), scores, sorted(n for n in os.listdir(ckpts) if not n.endswith(".ckpt"))

    out = both(tmp_path, run)
    (a, kept_a, scores_a, extra_a), (b, kept_b, scores_b, extra_b) = out["auto"], out["nvme_offload"]
    assert_same_params(a, b)
    assert kept_a.keys() == kept_b.keys() and scores_a.keys() == scores_b.keys()
    assert all(torch.equal(scores_a[n], scores_b[n]) for n in scores_a)
    for name in kept_a:
        for key, value in kept_a[name].items():
            assert torch.equal(value, kept_b[name][key]), (name, key)
    assert extra_a == []
    # this plugin's checkpoints carry their optimizer state inside the one file: nothing else in the directory
    assert extra_b == [] and torch.load(tmp_path / "nvme_offload" / "ckpts" / "last.ckpt").get("lightning_nvme")


class RecordingIO(TorchCheckpointIO):
    """A user's CheckpointIO (e.g. one that uploads): records what it was given."""

    def __init__(self) -> None:
        self.saved: list[tuple[str, dict]] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved.append((os.path.basename(str(path)), checkpoint["state_dict"]))
        super().save_checkpoint(checkpoint, path, storage_options)


def test_custom_checkpoint_io(tmp_path):
    def run(kind, root):
        io = RecordingIO()
        trainer = make_trainer(kind, root, plugins=[io], enable_checkpointing=True,
                               callbacks=[ModelCheckpoint(dirpath=root / "ckpts", save_weights_only=True,
                                                          every_n_train_steps=4)])
        trainer.fit(Monitored())
        return io.saved

    out = both(tmp_path, run)
    assert [n for n, _ in out["auto"]] == [n for n, _ in out["nvme_offload"]] and len(out["auto"]) >= 2
    for (name, a), (_, b) in zip(out["auto"], out["nvme_offload"]):
        assert all(torch.equal(a[k], b[k]) for k in a), name
