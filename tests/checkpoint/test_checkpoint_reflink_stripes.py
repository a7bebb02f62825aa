"""Reflink checkpoints of a store striped over two directories of one XFS (``xfs_dir``; issue #22): each stripe unit
is cloned from the file that holds it into one state file, so a save writes almost nothing, the snapshot keeps the
state of its instant while training rewrites the stripe files, and it resumes bitwise. Where a stripe cannot be
cloned (a stripe file on another filesystem, ``stripe_bytes`` not a multiple of the block) the save streams, says
why, and is bitwise the same checkpoint."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
from models import MLP
from safetensors import safe_open
from snapshot_checks import assert_snapshot_is_the_saved_state, optimizer_tensors
from test_checkpoint import assert_params_equal, reference, resume_in_new_process, trainer  # noqa: F401
from test_checkpoint_reflink import _parts_file, _SaveTwice, _write_bytes

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.checkpoint.copy import reflink as copy_reflink
from lightning_nvme.fs import reflink
from lightning_nvme.preflight.resources import PreflightWarning
from lightning_nvme.store import FlatStore
from lightning_nvme.store.layout import align_up

STRIPE = 64 << 10


def _dirs(root, n: int = 2) -> list[str]:
    return [str(root / f"disk{i}") for i in range(n)]


def _fit(root, strategy, epochs: int, model=None, **kw):
    t = trainer(root, strategy, epochs, enable_checkpointing=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreflightWarning)  # the two "disks" are one XFS
        t.fit(model or MLP())
    return t


def test_striped_reflink_save_writes_under_one_percent_of_the_state(xfs_dir, tmp_path):
    dirs = _dirs(xfs_dir / "s-big")
    strategy = NVMeOffloadStrategy(store_dir=dirs, chunk_bytes=1 << 20, stripe_bytes=STRIPE)
    t = _fit(tmp_path, strategy, 1, MLP(hidden=1024), limit_train_batches=4)  # 8.8 MB of AdamW state
    state_bytes = sum(off.state_bytes for off in strategy.offloaded)
    sizes = [os.path.getsize(os.path.join(d, "store-rank0.bin")) for d in dirs]
    assert min(sizes) >= state_bytes // 2 - STRIPE, sizes  # the state really is on both stripe files
    path = xfs_dir / "s-big" / "a.ckpt"
    before = _write_bytes()
    t.save_checkpoint(path)
    written = _write_bytes() - before - align_up(os.path.getsize(path))
    record = strategy.checkpoint_saves[-1]
    assert (record.path, record.reason) == ("reflink", "")
    assert record.bytes_cloned >= state_bytes and record.bytes_written <= 4096
    assert written <= 0.01 * state_bytes, (written, state_bytes)
    t.save_checkpoint(tmp_path / "b.ckpt")  # streamed, of the same state
    assert strategy.checkpoint_saves[-1].path == "streamed"
    with safe_open(_parts_file(path), "pt") as f:  # the cloned layout, read by safetensors
        assert any(n.startswith("pad.") for n in f.keys())
    cloned, copied = (optimizer_tensors(str(p), tmp_path) for p in (path, tmp_path / "b.ckpt"))
    tensors = [(i, k) for i, s in copied[0]["state"].items() for k, v in s.items() if torch.is_tensor(v) and v.dim()]
    assert tensors and all(torch.is_tensor(cloned[0]["state"][i].get(k)) for i, k in tensors)
    for i, k in tensors:
        assert torch.equal(cloned[0]["state"][i][k], copied[0]["state"][i][k]), (i, k)


def test_striped_snapshot_keeps_the_saved_state_while_training_rewrites_the_stripes(xfs_dir, tmp_path):
    a, b = str(xfs_dir / "s-snap" / "a.ckpt"), str(tmp_path / "b.ckpt")
    strategy = NVMeOffloadStrategy(store_dir=_dirs(xfs_dir / "s-snap"), chunk_bytes=16 << 10, stripe_bytes=4096)
    t = _fit(tmp_path, strategy, 3, callbacks=[_SaveTwice(a, b)])
    assert [r.path for r in strategy.checkpoint_saves] == ["reflink", "streamed"]
    t.save_checkpoint(str(tmp_path / "final.ckpt"))
    assert_snapshot_is_the_saved_state(a, b, str(tmp_path / "final.ckpt"), tmp_path)


def test_striped_reflink_checkpoint_resumes_bitwise(xfs_dir, tmp_path, reference):  # noqa: F811
    strategy = NVMeOffloadStrategy(store_dir=_dirs(xfs_dir / "s-resume"), chunk_bytes=16 << 10, stripe_bytes=4096)
    t = _fit(tmp_path, strategy, 1)
    ckpt = xfs_dir / "s-resume" / "epoch1.ckpt"
    t.save_checkpoint(ckpt)
    assert strategy.checkpoint_saves[-1].path == "reflink"
    dirs = _dirs(xfs_dir / "s-resume" / "again", 3)
    params = resume_in_new_process(
        tmp_path, ckpt, tmp_path / "p.pt",
        f"NVMeOffloadStrategy(store_dir={dirs!r}, chunk_bytes=16 << 10, stripe_bytes=4096)")
    assert_params_equal(reference, params)


def test_stripe_file_on_another_filesystem_streams_naming_it(xfs_dir, tmp_path, reference):  # noqa: F811
    """One stripe on the XFS, one elsewhere: no clone can reach the other file, so the save streams, naming that
    stripe file, and the checkpoint resumes bitwise (``checkpoint_copy="reflink"`` refuses it instead)."""
    from lightning_nvme.checks import ConfigError

    dirs = [str(xfs_dir / "s-mixed" / "disk0"), str(tmp_path / "disk1")]
    strategy = NVMeOffloadStrategy(store_dir=dirs, chunk_bytes=16 << 10, stripe_bytes=4096)
    t = _fit(tmp_path, strategy, 1)
    ckpt = xfs_dir / "s-mixed" / "epoch1.ckpt"
    t.save_checkpoint(ckpt)
    record = strategy.checkpoint_saves[-1]
    assert record.path == "streamed" and record.bytes_cloned == 0
    assert (f"is not on the filesystem of the store's stripe file {os.path.join(dirs[1], 'store-rank0.bin')}"
            in record.reason), record.reason
    params = resume_in_new_process(tmp_path, ckpt, tmp_path / "p.pt",
                                   f"NVMeOffloadStrategy(store_dir={str(tmp_path / 'one')!r}, chunk_bytes=16 << 10)")
    assert_params_equal(reference, params)
    strategy.config = dataclasses.replace(strategy.config, checkpoint_copy="reflink")
    with pytest.raises(ConfigError, match="checkpoint_copy.*stripe file"):
        t.save_checkpoint(xfs_dir / "s-mixed" / "refused.ckpt")


def test_stripe_unit_not_a_multiple_of_the_block_is_not_cloned(xfs_dir, monkeypatch):
    """``stripe_bytes`` is a multiple of 4 KiB; on a filesystem with larger blocks a unit would start inside a
    block, which a clone cannot: the save must stream, naming ``stripe_bytes`` and the block size."""
    real = reflink.probe(str(xfs_dir))
    assert real.supported, real.reason
    with FlatStore(_dirs(xfs_dir / "s-block"), stripe_bytes=12 << 10) as store:
        store.add_regions([("a", 64 << 10), ("b", 48 << 10)])
        assert copy_reflink.choose(store, str(xfs_dir / "s-block" / "c.ckpt"), ["a", "b"]) == (True, "")
        big = reflink.Support(real.directory, True, 8192, real.device)
        monkeypatch.setattr(reflink, "probe", lambda directory: big)
        clone, reason = copy_reflink.choose(store, str(xfs_dir / "s-block" / "c.ckpt"), ["a", "b"])
        assert not clone
        assert reason == ("the store's stripe_bytes (12288) is not a multiple of the filesystem block size 8192: "
                          "clones need block-aligned ranges")
        store.close(delete=True)


def test_striped_offload_params_weights_are_cloned_unit_by_unit(xfs_dir, tmp_path, monkeypatch):
    """``offload_params`` over two stripe directories: ``weights.safetensors`` is the block regions cloned stripe unit
    by stripe unit; a save mid-fit holds the same weights and optimizer state as a streamed save of that instant."""
    from _param_offload_model import TinyGPT
    from test_checkpoint_reflink import _SaveAtEpochEnd
    from test_param_offload import trainer as param_trainer

    weights_cloned: list[int] = []  # bytes of the weights file cloned, per reflink save
    write_weights = copy_reflink.write_weights

    def counting(*args, **kwargs) -> int:
        weights_cloned.append(write_weights(*args, **kwargs))
        return weights_cloned[-1]

    monkeypatch.setattr(copy_reflink, "write_weights", counting)
    a, b = str(xfs_dir / "s-params" / "a.ckpt"), str(tmp_path / "b.ckpt")
    strategy = NVMeOffloadStrategy(store_dir=_dirs(xfs_dir / "s-params"), chunk_bytes=64 << 10, offload_params=True,
                                   overlap="backward", inline_weights_bytes=0, stripe_bytes=4096)
    t = param_trainer(tmp_path / "run", strategy, steps=-1, max_epochs=1, callbacks=[_SaveAtEpochEnd(a, b)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreflightWarning)
        t.fit(TinyGPT())
    assert [r.path for r in strategy.checkpoint_saves] == ["reflink", "streamed"]
    record = strategy.checkpoint_saves[0]
    assert "weights.safetensors" in record.files and len(weights_cloned) == 1 and weights_cloned[0] > 0
    saved_a, saved_b = (torch.load(p, weights_only=True)["state_dict"] for p in (a, b))
    assert saved_a.keys() == saved_b.keys()
    for name, p in saved_b.items():
        assert torch.equal(saved_a[name], p), name
    cloned, copied = optimizer_tensors(a, tmp_path), optimizer_tensors(b, tmp_path)
    for s, r in zip(cloned, copied):
        for index, entries in r["state"].items():
            for key, v in entries.items():
                assert torch.equal(s["state"][index][key], v) if torch.is_tensor(v) else s["state"][index][key] == v


def test_checkpoint_copy_decides_for_a_striped_store_as_for_one(tmp_path):
    """``copy_reflink.plan``, which both strategies (and each data-parallel rank) ask: ``"streamed"`` never clones,
    ``"auto"`` streams where clones are impossible saying why, ``"reflink"`` refuses there naming the strategy."""
    from lightning_nvme.checks import ConfigError

    if reflink.probe(str(tmp_path)).supported:
        pytest.skip(f"{tmp_path} supports reflinks: this test needs a filesystem without them")
    with FlatStore(_dirs(tmp_path), stripe_bytes=4096) as store:
        store.add_regions([("a", 64 << 10)])
        path = str(tmp_path / "c.ckpt")
        assert copy_reflink.plan(store, path, ["a"], "streamed", "nvme_offload_ddp") == (False, "checkpoint_copy='streamed'")
        clone, reason = copy_reflink.plan(store, path, ["a"], "auto", "nvme_offload_ddp")
        assert not clone and "FICLONE" in reason
        with pytest.raises(ConfigError, match="checkpoint_copy: nvme_offload_ddp: 'reflink' is set but .*FICLONE"):
            copy_reflink.plan(store, path, ["a"], "reflink", "nvme_offload_ddp")
        store.close(delete=True)
