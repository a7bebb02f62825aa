"""Reflink shards of nvme_offload_ddp on a real XFS (``xfs_dir``; issue #22): 2 processes, each rank's store striped
over two directories of the XFS, the checkpoint on it too. Each rank clones its own shard from its own stripe files
(headers written, nothing else), the shards equal a streamed save of the same instant bit for bit after the next
epoch rewrote the stores, and the checkpoint resumes in a new job bitwise equal to the uninterrupted run and to
plain DDP. A save elsewhere (not on the XFS) streams and says why.

The processes are started as in ``test_ddp.py`` (Lightning's launcher in a subprocess, timeout 900 s)."""

from __future__ import annotations

import os

import pytest
import torch
from ckpt_helpers import parts_dir
from safetensors import safe_open
from test_ddp import assert_bitwise, launch, results, run_spec

from lightning_nvme.checkpoint import convert

COMMON = {"epochs": 2, "accumulate": 2, "clip": 0.5, "clip_algo": "norm", "chunk_bytes": 16 << 10,
          "offload_kwargs": {"stripe_bytes": 4096}}


@pytest.fixture(scope="module")
def runs(xfs_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_reflink")
    on_xfs = xfs_dir / "ddp-reflink"
    cloned, streamed = str(on_xfs / "a.ckpt"), str(tmp / "b.ckpt")
    ddp = run_spec(tmp, "ddp", "ddp", **{k: v for k, v in COMMON.items() if k != "offload_kwargs"})
    saver = run_spec(tmp, "saver", "offload", save=cloned, save_also=[streamed], save_epoch=0,
                     **{**COMMON, "store": [str(on_xfs / "disk0"), str(on_xfs / "disk1")]})
    launch(tmp, [ddp, saver], world=2)
    resumed = run_spec(tmp, "resumed", "offload", resume=cloned, **COMMON)
    launch(tmp, [resumed], world=2)
    out = {r["name"]: results(r["out"]) for r in (ddp, saver, resumed)}
    plain = {}
    for name, path in (("cloned", cloned), ("streamed", streamed)):
        convert.to_lightning(path, str(tmp / f"{name}.plain"))
        plain[name] = torch.load(tmp / f"{name}.plain", weights_only=False)["optimizer_states"]
    names = []
    for f in ("optimizer-0-rank0.safetensors", "optimizer-0-rank1.safetensors"):
        with safe_open(os.path.join(parts_dir(cloned), f), "pt") as shard:  # closed: no mapping keeps the XFS busy
            names.append(list(shard.keys()))
    out.update(plain=plain, names=names)
    return out


def test_each_rank_clones_its_own_shard(runs):
    for rank, r in enumerate(runs["saver"]):
        reflinked, streamed = r["saves"]
        assert (reflinked["path"], reflinked["reason"]) == ("reflink", ""), (rank, reflinked)
        assert reflinked["files"] == [f"optimizer-0-rank{rank}.safetensors"]
        assert reflinked["bytes_written"] <= 4096 and reflinked["bytes_cloned"] >= r["state_bytes"], (rank, reflinked)
        assert streamed["path"] == "streamed" and "not on the filesystem of the store's stripe file" in streamed["reason"]
        assert streamed["bytes_written"] >= r["state_bytes"]
    for names in runs["names"]:  # standard safetensors files: the cloned chunk regions, padding between the entries
        assert any(n.startswith("pad.") for n in names) and any(n.startswith("state.") for n in names)


def test_cloned_shards_hold_the_state_of_the_save_after_training_rewrote_the_stores(runs):
    cloned, streamed = runs["plain"]["cloned"], runs["plain"]["streamed"]
    tensors = [(i, k) for i, s in streamed[0]["state"].items() for k, v in s.items() if torch.is_tensor(v) and v.dim()]
    assert tensors
    for i, k in tensors:
        assert torch.equal(cloned[0]["state"][i][k], streamed[0]["state"][i][k]), (i, k)
    assert runs["saver"][0]["global_step"] == 16  # a whole epoch of updates after the save at step 8


def test_reflink_shards_resume_bitwise(runs):
    for rank in range(2):
        assert runs["resumed"][rank]["global_step"] == 16
        assert_bitwise(runs["saver"][rank], runs["resumed"][rank], f"resumed, rank {rank}")
        assert_bitwise(runs["ddp"][rank], runs["saver"][rank], f"plain DDP, rank {rank}")
