"""Lightning's own checkpointing habits (reproduced from ``tests_pytorch/checkpointing/test_model_checkpoint.py``,
``trainer/connectors/test_checkpoint_connector.py`` and ``plugins/test_checkpoint_io_plugin.py``, which the
``lightning`` wheel does not ship) run once with ``strategy="auto"`` and once with ``nvme_offload`` swapped in: what
``ModelCheckpoint`` leaves in its directory, what ``ckpt_path="last"`` finds, the resume, the default-strategy
readers of the file and ``AsyncCheckpointIO`` agree, bitwise where numbers are involved. The refusals that remain
by design are listed in docs/compatibility.md ("Refusals by design")."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import lightning_nvme  # noqa: F401
from conformance._lightning_models import Net, assert_same_params
from lightning_nvme import NVMeOffloadStrategy


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def strategy(kind: str, root, **kw):
    return "auto" if kind == "auto" else NVMeOffloadStrategy(store_dir=str(root / "store"), chunk_bytes=16 << 10, **kw)


def run(kind: str, root, callbacks, epochs: int = 3, ckpt_path: str | None = None, **kw):
    model = Net(adamw)
    trainer = Trainer(default_root_dir=root, strategy=strategy(kind, root, **kw.pop("settings", {})), accelerator="cpu",
                      devices=1, max_epochs=epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kw)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.parametrize("case", ["top_k", "every_n_epochs", "save_last", "versioning"])
def test_model_checkpoint_directory_is_the_default_strategys(tmp_path, case):
    """test_model_checkpoint_save_top_k / _every_n_epochs / _save_last / test_ckpt_version: the same file names."""
    def callbacks(d):
        if case == "top_k":
            return [ModelCheckpoint(dirpath=d, monitor="step", mode="max", save_top_k=2)]
        if case == "every_n_epochs":
            return [ModelCheckpoint(dirpath=d, every_n_epochs=2, save_top_k=-1)]
        if case == "save_last":
            return [ModelCheckpoint(dirpath=d, save_last=True, save_top_k=1, monitor="step", mode="max")]
        return [ModelCheckpoint(dirpath=d, filename="fixed", save_top_k=-1)]

    listings = {}
    for kind in ("auto", "offload"):
        d = tmp_path / kind / "ckpts"
        run(kind, tmp_path / kind, callbacks(d))
        if case == "versioning":  # a second run into the same directory: fixed-v1.ckpt, ...
            run(kind, tmp_path / kind / "again", callbacks(d))
        listings[kind] = sorted(os.listdir(d))
    assert listings["offload"] == listings["auto"] and listings["auto"], listings


def test_resume_from_last_is_bitwise_and_finds_only_last(tmp_path):
    """test_checkpoint_connector: ckpt_path="last" picks last.ckpt (no second candidate beside it), and the resumed
    run equals the default strategy's resumed run bitwise."""
    models = {}
    for kind in ("auto", "offload"):
        d = tmp_path / kind / "ckpts"
        cb = ModelCheckpoint(dirpath=d, save_last=True)
        run(kind, tmp_path / kind, [cb])
        assert ModelCheckpoint(dirpath=d)._find_last_checkpoints(None) == {str(d / "last.ckpt")}
        _, models[kind] = run(kind, tmp_path / kind / "resume", [ModelCheckpoint(dirpath=d, save_last=True)], epochs=5,
                              ckpt_path="last")
    assert_same_params(models["auto"], models["offload"])


def test_default_strategy_reads_the_file(tmp_path):
    """Trainer(strategy="auto").validate(ckpt_path=...) and load_from_checkpoint on the strategy's checkpoint."""
    trainer, model = run("offload", tmp_path, [ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)])
    last = str(tmp_path / "ckpts" / "last.ckpt")
    loaded = Net.load_from_checkpoint(last, make_optimizer=adamw)
    assert_same_params(model, loaded)
    class Validated(Net):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.cross_entropy(self(batch[0]), batch[1]))

    plain = Trainer(default_root_dir=tmp_path, accelerator="cpu", logger=False, enable_progress_bar=False)
    (from_file,) = plain.validate(Validated(adamw), dataloaders=Net().train_dataloader(), ckpt_path=last)
    trained = Validated(adamw)
    trained.load_state_dict(model.state_dict())
    (in_memory,) = plain.validate(trained, dataloaders=Net().train_dataloader())
    assert from_file == in_memory


def test_async_checkpoint_io_through_model_checkpoint(tmp_path):
    """test_async_checkpointing (plugins/test_checkpoint_io_plugin.py): every checkpoint written by the plugin's
    thread, the same names as the default strategy's, and the last one resumes bitwise."""
    listings, models = {}, {}
    for kind in ("auto", "offload"):
        d = tmp_path / kind / "ckpts"
        cb = ModelCheckpoint(dirpath=d, save_top_k=-1, save_last=True)
        plugins = [AsyncCheckpointIO()] if kind == "auto" else []
        settings = {"checkpoint_io": AsyncCheckpointIO()} if kind == "offload" else {}
        run(kind, tmp_path / kind, [cb], plugins=plugins, settings=settings)
        listings[kind] = sorted(os.listdir(d))
        _, models[kind] = run(kind, tmp_path / kind / "resume", [], epochs=4, ckpt_path=str(d / "last.ckpt"),
                              enable_checkpointing=False)
    assert listings["offload"] == listings["auto"], listings
    assert_same_params(models["auto"], models["offload"])
