"""Sharded checkpoints of nvme_offload_ddp (2 processes, Gloo, CPU): save, kill -9, resume at the same world
size bitwise equal to the uninterrupted run; resume at world size 1 from a 2-rank save and at 2 from a
1-rank save; conversion to a plain Lightning checkpoint that plain DDP resumes, and back.

Across world sizes the global batch is kept (16 = 2 x 8 = 1 x 16; Lightning's DistributedSampler draws one
permutation per epoch whatever the world size and interleaves it over the ranks, so the global batches
hold the same samples), so the runs do the same maths except the order in which the
all-reduce adds gradients: those are compared with ``allclose(rtol=1e-4, atol=1e-6)``, same-world-size
resumes bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch
from ckpt_helpers import parts_dir
from test_ddp import assert_bitwise, launch, results, run_spec

from lightning_nvme.checkpoint import convert

COMMON = {"epochs": 2, "accumulate": 2, "clip": 0.5, "clip_algo": "norm", "chunk_bytes": 16 << 10}


def assert_close(a: dict, b: dict, what: str) -> None:
    for name, p in a["params"].items():
        torch.testing.assert_close(p, b["params"][name], rtol=1e-4, atol=1e-6, msg=f"{what}: parameter {name}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_ckpt")
    ck2, ck1 = str(tmp / "ws2.ckpt"), str(tmp / "ws1.ckpt")
    ref = run_spec(tmp, "ref", "offload", **COMMON)
    killed = run_spec(tmp, "killed", "offload", save=ck2, save_epoch=0, kill=True, **COMMON)
    launch(tmp, [ref, killed], world=2, expect_kill=True)
    layout = {"ck2_files": sorted(os.listdir(parts_dir(ck2))), "ck2_meta": torch.load(ck2),
              "ck2_optim": os.path.exists(ck2 + ".optim"), "siblings": sorted(os.listdir(tmp))}

    ws1_from_ws2 = run_spec(tmp, "ws1_from_ws2", "offload", resume=ck2, **COMMON)
    ws1 = run_spec(tmp, "ws1", "offload", save=ck1, save_epoch=0, **COMMON)
    launch(tmp, [ws1_from_ws2, ws1], world=1)

    plain, back = str(tmp / "plain.ckpt"), str(tmp / "back.ckpt")
    convert.to_lightning(ck2, plain)
    convert.from_lightning(plain, back)
    same_world = run_spec(tmp, "same_world", "offload", resume=ck2, **{**COMMON, "store": killed["store"]})
    ws2_from_ws1 = run_spec(tmp, "ws2_from_ws1", "offload", resume=ck1, **COMMON)
    ddp_from_plain = run_spec(tmp, "ddp_from_plain", "ddp", resume=plain, **COMMON)
    from_back = run_spec(tmp, "from_back", "offload", resume=back, **COMMON)
    offload_from_plain = run_spec(tmp, "offload_from_plain", "offload", resume=plain, **COMMON)
    launch(tmp, [same_world, ws2_from_ws1, ddp_from_plain, from_back, offload_from_plain], world=2)
    out = {r["name"]: results(r["out"], 2)
           for r in (ref, same_world, ws2_from_ws1, ddp_from_plain, from_back, offload_from_plain)}
    out.update({r["name"]: results(r["out"], 1) for r in (ws1_from_ws2, ws1)})
    out.update(layout=layout, plain=torch.load(plain, weights_only=False), ck2=ck2)
    return out


def test_layout_one_shard_per_rank_and_metadata(runs):
    layout = runs["layout"]
    assert layout["ck2_files"] == ["optimizer-0-rank0.safetensors", "optimizer-0-rank1.safetensors"]
    assert "optimizer_states" not in layout["ck2_meta"]  # a plain Trainer must not resume without the moments
    marker = layout["ck2_meta"]["lightning_nvme"]["parts"][0]
    assert marker["world_size"] == 2 and len(marker["partition"]["ranges"]) == 2
    assert layout["ck2_optim"] is False  # one file: every rank's shard is a record of it
    assert sorted(layout["ck2_meta"]["lightning_nvme"]["records"]) == layout["ck2_files"]
    assert [s for s in layout["siblings"] if ".tmp-" in s] == []  # committed: no temp dir left behind
    sizes = [os.path.getsize(os.path.join(parts_dir(runs["ck2"]), f)) for f in layout["ck2_files"]]
    assert max(sizes) / min(sizes) < 1.2, sizes  # each rank wrote about half


def test_save_kill_resume_same_world_size_is_bitwise_equal(runs):
    for rank in range(2):
        assert runs["same_world"][rank]["global_step"] == runs["ref"][rank]["global_step"] == 16
        assert_bitwise(runs["ref"][rank], runs["same_world"][rank], f"rank {rank}")


def test_two_rank_checkpoint_resumes_on_one_rank(runs):
    assert runs["ws1_from_ws2"][0]["global_step"] == 16
    assert_close(runs["ref"][0], runs["ws1_from_ws2"][0], "world size 2 -> 1")


def test_one_rank_checkpoint_resumes_on_two_ranks(runs):
    for rank in range(2):
        assert_close(runs["ws1"][0], runs["ws2_from_ws1"][rank], f"world size 1 -> 2, rank {rank}")
    assert_bitwise(runs["ws2_from_ws1"][0], runs["ws2_from_ws1"][1], "replicas")


def test_plain_conversion_resumes_with_plain_ddp_and_converts_back(runs):
    state = runs["plain"]["optimizer_states"][0]["state"]
    assert all(float(s["step"]) == 8 for s in state.values() if "step" in s)
    names = list(runs["ref"][0]["params"])
    order = [n for n in names if n.endswith("weight")] + [n for n in names if not n.endswith("weight")]
    for index, s in state.items():  # full tensors assembled from both shards, shaped like their parameters
        if "exp_avg" in s:
            assert s["exp_avg"].shape == runs["ref"][0]["params"][order[index]].shape
    for rank in range(2):
        assert_bitwise(runs["ref"][rank], runs["ddp_from_plain"][rank], f"plain ddp, rank {rank}")
        assert_bitwise(runs["ref"][rank], runs["from_back"][rank], f"converted back, rank {rank}")
        assert_bitwise(runs["ref"][rank], runs["offload_from_plain"][rank], f"plain into shards, rank {rank}")


def test_single_device_strategy_resumes_a_sharded_checkpoint(runs, tmp_path):
    """``nvme_offload`` (one process, batch 16 = the global batch) reads both shards of the 2-rank save.
    Lightning shuffles a DDP job's training data with ``DistributedSampler(shuffle=True, seed=0)``, so
    this single-process run uses the same sampler for the same global batches."""
    from lightning.pytorch import Trainer
    from models import MLP, dataset
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_nvme import NVMeOffloadStrategy

    class SameOrderMLP(MLP):
        def train_dataloader(self):
            data = dataset()
            return DataLoader(data, batch_size=16, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))

    model = SameOrderMLP()
    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "s"), chunk_bytes=16 << 10)
    Trainer(default_root_dir=tmp_path, strategy=strategy, accelerator="cpu", max_epochs=2, accumulate_grad_batches=2,
            gradient_clip_val=0.5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False).fit(model, ckpt_path=runs["ck2"])
    assert_close(runs["ref"][0], {"params": dict(model.named_parameters())}, "world size 2 -> single device")


def test_rank0_file_opens_with_lightnings_loaders(runs, tmp_path):
    """The sharded checkpoint's path is rank 0's file: torch.load (weights_only), load_from_checkpoint and a
    plain Trainer's predict open it; a plain Trainer's fit refuses it rather than restart the moments."""
    from lightning.pytorch import Trainer
    from models import MLP
    from torch.utils.data import DataLoader

    loaded = torch.load(runs["ck2"])
    assert loaded["global_step"] == 8 and "optimizer_states" not in loaded
    model = MLP.load_from_checkpoint(runs["ck2"])
    for name, p in model.state_dict().items():
        assert torch.equal(p, loaded["state_dict"][name]), name
    plain = dict(default_root_dir=tmp_path, accelerator="cpu", logger=False, enable_progress_bar=False,
                 enable_model_summary=False, enable_checkpointing=False)
    batches = DataLoader(torch.randn(8, 32, generator=torch.Generator().manual_seed(3)), batch_size=4)
    predicted = torch.cat(Trainer(**plain).predict(MLP(), batches, ckpt_path=runs["ck2"]))
    assert torch.equal(predicted, torch.cat([model(b) for b in batches]).detach())
    with pytest.raises(KeyError, match="optimizer state"):
        Trainer(max_epochs=2, **plain).fit(MLP(), ckpt_path=runs["ck2"])
