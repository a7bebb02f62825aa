"""host_memory_budget under nvme_offload_ddp bounds the host, not each process: the ranks on one host share it
evenly (2 processes, Gloo, CPU). Each rank keeps at most its share in RAM, some of its chunks there and some on
the SSD, and the results are bitwise equal to plain DDP in memory; a budget above the memory available is refused
on every rank alike (no rank left waiting for the others)."""

from __future__ import annotations

from test_ddp import assert_bitwise, launch, results, run_spec

from lightning_nvme.constants import GiB
from lightning_nvme.memory import available_host_memory
from lightning_nvme.optim import plan_chunks

CHUNK = 8 << 10


def _state_bytes() -> int:
    """Optimizer state of the whole model (what one process would store) in the test's MLP."""
    from models import MLP

    optimizer = MLP("adamw").configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    optimizer = optimizer[0][0] if isinstance(optimizer, tuple) else optimizer
    return sum(c.nbytes for c in plan_chunks(optimizer, CHUNK, "probe").chunks)


def test_ranks_share_the_host_budget_and_equal_plain_ddp(tmp_path):
    host_budget = _state_bytes() // 2  # each rank holds about half of the state: its share fits half of it
    common = {"steps": 12, "accumulate": 2, "clip": 0.05, "clip_algo": "norm", "chunk_bytes": CHUNK}
    runs = [run_spec(tmp_path, "ddp", "ddp", **common),
            run_spec(tmp_path, "zero", "offload", **common),
            run_spec(tmp_path, "shared", "offload", offload_kwargs={"host_memory_budget": host_budget}, **common),
            run_spec(tmp_path, "shared_backward", "offload", overlap="backward",
                     offload_kwargs={"host_memory_budget": host_budget}, **{**common, "clip_algo": "value"}),
            run_spec(tmp_path, "ddp_value", "ddp", **{**common, "clip_algo": "value"})]
    launch(tmp_path, runs)
    got = {r["name"]: results(r["out"]) for r in runs}
    for rank in range(2):
        assert_bitwise(got["ddp"][rank], got["zero"][rank], f"budget 0, rank {rank}")
        assert_bitwise(got["ddp"][rank], got["shared"][rank], f"shared budget, rank {rank}")
        assert_bitwise(got["ddp_value"][rank], got["shared_backward"][rank], f"overlap=backward, rank {rank}")
    share = host_budget // 2
    for name in ("shared", "shared_backward"):
        for rank, r in enumerate(got[name]):
            plan = r["placement"]
            assert r["local_ranks"] == 2 and plan["budget_bytes"] == share, (name, rank, plan)
            assert 0 < r["shelf_bytes"] <= share, (name, rank, r["shelf_bytes"], share)  # what RAM really held
            assert r["shelf_bytes"] == plan["shelf_bytes"]
            assert plan["chunks_on_shelf"] > 0 and plan["chunks_on_ssd"] > 0, (name, rank, plan)
        assert sum(r["shelf_bytes"] for r in got[name]) <= host_budget
    for rank, r in enumerate(got["zero"]):
        assert r["shelf_bytes"] == 0 and r["placement"]["budget_bytes"] == 0


def test_a_host_budget_above_available_memory_is_refused_on_every_rank(tmp_path):
    too_much = available_host_memory() + 64 * GiB
    run = run_spec(tmp_path, "refused", "offload", steps=2, expect_error=True,
                   offload_kwargs={"host_memory_budget": too_much})
    launch(tmp_path, [run])
    for rank, r in enumerate(results(run["out"])):
        assert r["error"].startswith("ConfigError") and "host_memory_budget" in r["error"], (rank, r)
        assert str(too_much) in r["error"] and "available" in r["error"], (rank, r)
