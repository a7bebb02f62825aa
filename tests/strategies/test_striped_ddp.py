"""nvme_offload_ddp on 2 processes with the store striped over 2 directories (issue #23): each rank keeps its own
file in every directory, training is bitwise equal to plain DDP, and a checkpoint saved from the striped stores
(then kill -9) resumes in a new job bitwise equal to the uninterrupted run, over the same directories (the
killed run's files still there) and over a new set of three.

The processes are started as in ``test_ddp.py`` (Lightning's launcher in a subprocess, timeout 900 s)."""

from __future__ import annotations

import os

import pytest
from ckpt_helpers import parts_dir
from test_ddp import assert_bitwise, launch, results, run_spec

STRIPE = 4 << 10  # a rank's 16 KiB optimizer chunks span both directories
COMMON = {"epochs": 2, "accumulate": 2, "clip": 0.5, "clip_algo": "norm", "chunk_bytes": 16 << 10}
STRIPED = {**COMMON, "offload_kwargs": {"stripe_bytes": STRIPE}}


def _dirs(root, n: int) -> list[str]:
    return [str(root / f"disk{i}") for i in range(n)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("striped_ddp")
    ckpt = str(tmp / "striped.ckpt")
    ddp = run_spec(tmp, "ddp", "ddp", **COMMON)
    striped = run_spec(tmp, "striped", "offload", **{**STRIPED, "store": _dirs(tmp / "striped", 2)})
    killed = run_spec(tmp, "killed", "offload", save=ckpt, save_epoch=0, kill=True,
                      **{**STRIPED, "store": _dirs(tmp / "killed", 2)})
    launch(tmp, [ddp, striped, killed], world=2, expect_kill=True)
    sizes = {d: [os.path.getsize(os.path.join(d, f"store-rank{r}.bin")) for r in range(2)] for d in striped["store"]}
    listing = {d: sorted(os.listdir(d)) for d in striped["store"]}
    shards = sorted(os.listdir(parts_dir(ckpt)))

    same_dirs = run_spec(tmp, "same_dirs", "offload", resume=ckpt, **{**STRIPED, "store": killed["store"]})
    three_dirs = run_spec(tmp, "three_dirs", "offload", resume=ckpt, **{**STRIPED, "store": _dirs(tmp / "three", 3)})
    launch(tmp, [same_dirs, three_dirs], world=2)
    out = {r["name"]: results(r["out"]) for r in (ddp, striped, same_dirs, three_dirs)}
    out.update(sizes=sizes, listing=listing, shards=shards)
    return out


def test_two_rank_training_over_two_directories_equals_plain_ddp(runs):
    for rank in range(2):
        assert runs["striped"][rank]["global_step"] == runs["ddp"][rank]["global_step"] == 16
        assert_bitwise(runs["ddp"][rank], runs["striped"][rank], f"rank {rank}")
    assert_bitwise(runs["striped"][0], runs["striped"][1], "replicas")


def test_each_rank_has_its_own_file_in_every_directory(runs):
    """One store per rank, striped: ``store-rank{r}.bin`` in each directory, the manifest in the first only, and
    every file holds stripe units beyond its header (the rank's state really is spread over both disks)."""
    first, second = list(runs["listing"])
    assert runs["listing"][first] == ["store-rank0.bin", "store-rank0.bin.lock", "store-rank0.json",
                                      "store-rank1.bin", "store-rank1.bin.lock", "store-rank1.json"]
    assert runs["listing"][second] == ["store-rank0.bin", "store-rank0.bin.lock",
                                       "store-rank1.bin", "store-rank1.bin.lock"]
    for d, sizes in runs["sizes"].items():
        assert min(sizes) > 4096 + 4 * STRIPE, (d, sizes)
    for rank in range(2):
        assert runs["striped"][rank]["store_path"] == os.path.join(first, f"store-rank{rank}.bin")


def test_checkpoint_of_striped_ranks_resumes_bitwise_after_kill(runs):
    """Saved at the end of epoch 0 from both ranks' striped stores, the job killed -9, resumed in a new job: over
    the same directories (the killed run's store files still there) and over three new ones."""
    assert runs["shards"] == ["optimizer-0-rank0.safetensors", "optimizer-0-rank1.safetensors"]
    for name in ("same_dirs", "three_dirs"):
        for rank in range(2):
            assert runs[name][rank]["global_step"] == 16, name
            assert_bitwise(runs["striped"][rank], runs[name][rank], f"{name}, rank {rank}")
