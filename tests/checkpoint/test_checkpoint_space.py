"""Disk space planned before training: the store plus the checkpoints ``ModelCheckpoint`` keeps must fit, or the run
is refused before its first step with the bytes needed and free; a save that cannot fit is refused before it writes
anything; ``lightning-nvme doctor`` reports reflink support and the same plan."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from models import MLP

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.checkpoint.record import CheckpointSpaceError
from lightning_nvme.checks import ConfigError
from lightning_nvme.constants import MiB
from lightning_nvme.doctor import command
from lightning_nvme.preflight.resources import CheckpointPlan, check_checkpoint_space, checkpoint_bytes_on_disk


def _trainer(root, strategy, **kw):
    return Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", max_epochs=1, limit_train_batches=2,
                   logger=False, enable_progress_bar=False, enable_model_summary=False, **kw)


class _Filled:
    """Fill the filesystem of ``directory`` until ``left`` bytes stay free (one preallocated file), undone on exit."""

    def __init__(self, directory, left: int) -> None:
        self.path = os.path.join(directory, "filler.bin")
        self.left = left

    def __enter__(self):
        free = shutil.disk_usage(os.path.dirname(self.path)).free
        with open(self.path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, free - self.left)
        return self

    def __exit__(self, *exc) -> None:
        os.unlink(self.path)


def test_plan_that_does_not_fit_names_the_bytes(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    plan = CheckpointPlan(str(tmp_path / "ckpts"), 3, free // 2)
    with pytest.raises(ConfigError, match=r"needs \d+ bytes .* = the store .* \+ 3 checkpoints of \d+ bytes .* free"):
        check_checkpoint_space(str(tmp_path / "store"), 4096, [plan])
    needed = check_checkpoint_space(str(tmp_path / "store"), 4096, [CheckpointPlan(str(tmp_path), 3, 1000)])
    assert sum(needed.values()) == 4096 + 3000


def test_checkpoints_already_there_count_toward_the_kept_ones(tmp_path):
    (tmp_path / "a.ckpt").write_bytes(b"x" * 10000)
    (tmp_path / "a.ckpt.optim" / "id").mkdir(parents=True)
    (tmp_path / "a.ckpt.optim" / "id" / "optimizer-0.safetensors").write_bytes(b"y" * 20000)
    (tmp_path / "other.bin").write_bytes(b"z" * 50000)
    held = checkpoint_bytes_on_disk(str(tmp_path))
    assert 30000 <= held < 50000
    needed = check_checkpoint_space(str(tmp_path / "store"), 0, [CheckpointPlan(str(tmp_path), 2, 20000)])
    assert sum(needed.values()) == 40000 - held


def test_run_whose_checkpoints_cannot_fit_is_refused_before_training(xfs_dir, tmp_path):
    root = xfs_dir / "space-run"
    root.mkdir()
    model = MLP(hidden=1024)  # 8.8 MB of optimizer state + 4.4 MB of weights per checkpoint
    strategy = NVMeOffloadStrategy(store_dir=str(root / "store"), chunk_bytes=1 << 20, min_free_bytes=0)
    t = _trainer(root, strategy, callbacks=[ModelCheckpoint(dirpath=str(root / "ckpts"), save_top_k=3, monitor="step", mode="max")])
    with _Filled(str(root), 40 * MiB), pytest.raises(ConfigError, match=r"4 checkpoints of \d+ bytes.*are free"):
        t.fit(model)
    assert t.global_step == 0
    # the same run with one checkpoint kept fits: the plan counts what ModelCheckpoint keeps
    strategy = NVMeOffloadStrategy(store_dir=str(root / "store"), chunk_bytes=1 << 20, min_free_bytes=0)
    t = _trainer(root, strategy, callbacks=[ModelCheckpoint(dirpath=str(root / "ckpts"), save_top_k=1)])
    with _Filled(str(root), 40 * MiB):
        t.fit(MLP(hidden=1024))
    assert t.global_step == 2


@pytest.mark.parametrize("copy", ["streamed", "auto"])
def test_save_that_cannot_fit_is_refused_before_writing(xfs_dir, copy):
    root = xfs_dir / f"space-save-{copy}"
    root.mkdir()
    strategy = NVMeOffloadStrategy(store_dir=str(root / "store"), chunk_bytes=1 << 20, min_free_bytes=0,
                                   checkpoint_copy=copy)
    t = _trainer(root, strategy, enable_checkpointing=False)
    t.fit(MLP(hidden=1024))
    ckpt = root / "a.ckpt"
    with _Filled(str(root), 8 * MiB):  # the weights (4.4 MB) fit, weights + a copy of the state (13 MB) do not
        if copy == "streamed":
            with pytest.raises(CheckpointSpaceError, match=r"needs \d+ bytes .* nothing was written"):
                t.save_checkpoint(ckpt)
            assert not ckpt.exists() and not (root / "a.ckpt.optim").exists()
        else:  # a reflink save writes the file and headers only
            t.save_checkpoint(ckpt)
            assert strategy.checkpoint_saves[-1].path == "reflink" and ckpt.exists()


def test_doctor_reports_reflinks_and_the_checkpoint_plan(xfs_dir, tmp_path, capsys):
    rc = command.main([str(xfs_dir / "doctor"), "--no-tune", "--bench-bytes", "0", "--min-free-bytes", "0",
                      "--plan-bytes", "4096", "--checkpoints", "2", "--checkpoint-bytes", str(MiB), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["reflink"] is True
    too_many = str(shutil.disk_usage(tmp_path).free)
    rc = command.main([str(tmp_path), "--no-tune", "--bench-bytes", "0", "--checkpoints", "1", "--checkpoint-bytes",
                      too_many, "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and out["reflink"] is False and any("2 checkpoints" in p for p in out["problems"])
