"""NVMeOffloadFSDPStrategy on 1, 2 and 4 processes (Gloo, CPU): AdamW on a tied GPT and a tiny Hugging Face Llama
equal plain DDP (bitwise at 1 and 2 ranks, where the reduce-scatter and DDP's all-reduce add the same numbers in the
same order; within a stated bound at 4), each rank's store holds 1/N of the blocks and of the optimizer state,
checkpoints resume bitwise at the same N and reshard on load 2 -> 1, 1 -> 2 and 2 -> 4, and what is not supported yet is
refused by name.

As ``test_ddp.py``: Lightning's own launcher starts the processes; each job runs this file as a script
(``python tests/strategies/test_fsdp.py SPEC.json``) which trains every run of the spec and saves what each rank saw.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
STEPS = 24  # 3 epochs of 8 steps (64 sequences, global batch 8)
SAVE_EPOCH = 1  # a checkpoint at the end of the second epoch (step 16)


# ---- the launcher side (pytest) ---------------------------------------------------------------------------
def launch(tmp_path, runs: list[dict], world: int, expect_kill: bool = False, expect_failure: bool = False) -> None:
    spec = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"world": world, "runs": runs}))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(spec)], env=env, timeout=1200,
                          capture_output=True, text=True)
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    elif expect_failure:
        assert proc.returncode != 0, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-6000:]


def results(run: dict, world: int) -> list[dict]:
    return [torch.load(f"{run['out']}.rank{r}.pt", weights_only=False) for r in range(world)]


def spec(tmp_path, name: str, strategy: str, **kw) -> dict:
    return {"name": name, "strategy": strategy, "root": str(tmp_path / name), "out": str(tmp_path / name / "result"),
            "store": str(tmp_path / name / "store"), **kw}


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a["params"].keys() == b["params"].keys()
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), f"{what}: parameter {name} differs"


def same_losses(a: list[float], b: list[float], digits: int = 6) -> bool:
    """Equal to ``digits`` significant digits as a relative bound (comparing printed digits fails for two values
    either side of a rounding boundary, e.g. 4.1569948 and 4.1569953 at 7 digits)."""
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=10.0 ** -digits, abs_tol=0.0) for x, y in zip(a, b))


# ---- the tests ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Plain DDP and nvme_offload_fsdp side by side, each saving at the end of the second epoch (step 16) and
    resumed in new processes from its own checkpoint: at 2 ranks (a 2-process job), at 1 rank (the 2-rank
    checkpoints, in a 1-process job that also trains and saves at 1 rank), and the 1-rank checkpoints at 2 ranks.

    Why the resumed runs are compared with plain DDP resumed the same way, not with the uninterrupted run: Lightning
    resumes a checkpoint saved in ``on_train_epoch_end`` with one extra batch of the finished epoch (its loop
    state says the epoch is not over), so no resumed run, plain or not, follows the uninterrupted one."""
    tmp = tmp_path_factory.mktemp("fsdp")
    ck = {name: str(tmp / f"{name}.ckpt") for name in ("ddp2", "fsdp2", "ddp1", "fsdp1", "killed")}
    runs = [spec(tmp, "ddp_gpt", "ddp", save=ck["ddp2"]),
            spec(tmp, "fsdp_gpt", "fsdp", save=ck["fsdp2"]),
            spec(tmp, "fsdp_gpt_backend", "fsdp", collectives="backend"),
            spec(tmp, "ddp_llama", "ddp", model="llama"),
            spec(tmp, "fsdp_llama", "fsdp", model="llama", chunk_bytes=4 << 10),
            spec(tmp, "ddp_frozen", "ddp", frozen_block_param=True, steps=8),
            spec(tmp, "fsdp_frozen", "fsdp", frozen_block_param=True, steps=8),
            spec(tmp, "ddp_lora", "ddp", lora=True, steps=8),
            spec(tmp, "fsdp_lora", "fsdp", lora=True, steps=8),
            spec(tmp, "ddp_peft", "ddp", model="llama", peft=True, steps=8),
            spec(tmp, "fsdp_peft", "fsdp", model="llama", peft=True, chunk_bytes=4 << 10, steps=8),
            spec(tmp, "ddp_groups", "ddp", optimizer="adamw_groups", steps=8),
            spec(tmp, "fsdp_groups", "fsdp", optimizer="adamw_groups", steps=8)]
    launch(tmp, runs, world=2)
    ones = [spec(tmp, "ddp_w1", "ddp", save=ck["ddp1"]),
            spec(tmp, "fsdp_w1", "fsdp", save=ck["fsdp1"]),
            spec(tmp, "ddp_2_to_1", "ddp", resume=ck["ddp2"]),
            spec(tmp, "fsdp_2_to_1", "fsdp", resume=ck["fsdp2"]),
            spec(tmp, "refuse_accumulate", "fsdp", accumulate=2, expect_error=True),
            spec(tmp, "not_restored", "fsdp", steps=1, restore_params=False)]
    launch(tmp, ones, world=1)
    killed = spec(tmp, "fsdp_killed", "fsdp", save=ck["killed"], kill_step=20, timeout_s=120)
    launch(tmp, [killed], world=2, expect_failure=True)
    again = [spec(tmp, "fsdp_after_kill", "fsdp", resume=ck["killed"], store=killed["store"]),
             spec(tmp, "ddp_2_to_2", "ddp", resume=ck["ddp2"]),
             spec(tmp, "fsdp_2_to_2", "fsdp", resume=ck["fsdp2"]),
             spec(tmp, "ddp_1_to_2", "ddp", resume=ck["ddp1"]),
             spec(tmp, "fsdp_1_to_2", "fsdp", resume=ck["fsdp1"])]
    launch(tmp, again, world=2)
    out = {r["name"]: results(r, 2) for r in runs + again}
    out.update({r["name"]: results(r, 1) for r in ones})
    out["checkpoints"] = ck
    return out


def test_tied_gpt_equals_plain_ddp_bitwise_on_two_ranks(two):
    ref, fsdp = two["ddp_gpt"], two["fsdp_gpt"]
    for rank in range(2):
        assert fsdp[rank]["global_step"] == STEPS
        assert_bitwise(ref[rank], fsdp[rank], f"rank {rank}")
        assert fsdp[rank]["losses"] == ref[rank]["losses"]
    assert_bitwise(fsdp[0], fsdp[1], "replicas after the end-of-fit gather")
    assert fsdp[0]["updated_in_backward"] > 0 and fsdp[0]["blocks"] == 4


def test_shared_memory_collectives_are_chosen_on_one_host_and_train_as_the_backends(two):
    """``collectives="auto"`` on one host with CPU tensors moves the gathers and all-to-alls through shared memory;
    ``"backend"`` through Gloo. The same bytes arrive either way: every parameter and loss of the 24 steps is equal,
    bit for bit, on both ranks."""
    shm, gloo = two["fsdp_gpt"], two["fsdp_gpt_backend"]
    for rank in range(2):
        assert shm[rank]["comm"] == "shared_memory" and gloo[rank]["comm"] == "backend"
        assert_bitwise(gloo[rank], shm[rank], f"rank {rank}")
        assert shm[rank]["losses"] == gloo[rank]["losses"]


def test_the_optimizer_reads_one_block_shards_state_ahead(two):
    """With ``overlap="backward"`` the optimizer reads ahead at least the chunks of one block's shard of state
    (more than ``prefetch_depth`` here), so a block's state is read while the block after it computes."""
    for rank in range(2):
        run = two["fsdp_gpt"][rank]
        assert run["chunks_per_block_shard"] > run["prefetch_depth"]
        assert run["read_ahead"] == run["chunks_per_block_shard"]


def test_block_sized_buffers_are_reused_not_mapped_afresh(two):
    """The shards' host buffers come from a bounded pool (as ``offload_params``' blocks) and the gathered blocks,
    flat gradients and receive buffers from ``SpareBuffers``: reused across blocks and steps, never more pooled
    than in use at once (the training is bitwise DDP's: ``test_tied_gpt_equals_plain_ddp_bitwise_on_two_ranks``)."""
    for rank in range(2):
        run = two["fsdp_gpt"][rank]
        depth = run["param_prefetch"]
        assert 0 < run["pool_buffers"] <= depth + 2 + depth + 1 < run["block_loads"]
        assert run["spare_reused"] > 0
        assert run["spare_after_fit"] == 0  # the pool's buffers are let go with the fit


def test_tiny_llama_equals_plain_ddp_bitwise_on_two_ranks(two):
    ref, fsdp = two["ddp_llama"], two["fsdp_llama"]
    for rank in range(2):
        assert fsdp[rank]["global_step"] == STEPS
        assert_bitwise(ref[rank], fsdp[rank], f"rank {rank}")
        assert fsdp[rank]["losses"] == ref[rank]["losses"]
    assert fsdp[0]["blocks"] == 2


@pytest.mark.parametrize("kind", ["frozen", "lora", "peft"])
def test_frozen_parameters_inside_blocks_are_sharded_and_gathered_never_reduced(two, kind):
    """A block with frozen parameters (one LayerNorm weight frozen; the package's GPT LoRA, every projection's base
    frozen and its adapters trained): the frozen ones are sharded and gathered with the block but get no gradient,
    no reduction slot of their own values and no optimizer state; 8 AdamW steps equal plain DDP bitwise, the frozen
    weights unchanged on every rank."""
    ref, fsdp = two[f"ddp_{kind}"], two[f"fsdp_{kind}"]
    for rank in range(2):
        assert fsdp[rank]["global_step"] == 8
        assert_bitwise(ref[rank], fsdp[rank], f"{kind}, rank {rank}")
        assert fsdp[rank]["losses"] == ref[rank]["losses"]
    frozen = fsdp[0]["frozen"]
    assert frozen and all(torch.equal(fsdp[0]["params"][n], v) for n, v in fsdp[0]["initial_frozen"].items())
    if kind == "lora":
        trained = [n for n in fsdp[0]["params"] if n not in frozen]
        assert trained and all("lora" in n or ".h." not in n for n in trained), trained
        # an update writes back only the shard's trainable tail (from the page where the adapters begin): per rank
        # and step at most 2 pages per block (rank 0's shards hold no adapter: nothing), against every block's
        # whole shard when (nearly) all of it trains
        lora = [fsdp[rank]["block_bytes_written"] for rank in range(2)]
        full = [two["fsdp_frozen"][rank]["block_bytes_written"] for rank in range(2)]
        assert sum(lora) > 0 and max(lora) <= 8 * 4 * 2 * 4096 < min(full), (lora, full)


@pytest.mark.parametrize("name", ["fsdp_gpt", "fsdp_groups", "fsdp_lora"])
def test_a_block_waiting_for_its_update_keeps_only_what_the_update_reads(two, name):
    """Between a block's backward and its update only the owned window of its gathered weights and of its gradient
    stays in memory (this rank's shard, owned parameters whole), not the whole block: measured at every hold and
    release, on each rank. And at most two blocks wait for an update at once, also with Hugging Face's decay /
    no-decay parameter groups, whose state is interleaved across blocks (a chunk spanning blocks held them all until
    the last one's reduction) and with LoRA adapters (one chunk held every block before chunks were cut at
    blocks). Training still equals plain DDP bitwise (the groups run here; the others above)."""
    waits = [rank["waiting"] for rank in two[name]]
    assert all(w["whole"] == 0 for w in waits) and sum(w["checked"] for w in waits) > 0, waits  # never a whole block
    assert all(w["max_fraction"] < 0.9 for w in waits), waits
    # (a LoRA block's adapters all lie in one rank's shard: the other rank owns nothing of it to update)
    assert all(w["max_pending_blocks"] <= 2 for w in waits) and max(w["max_pending_blocks"] for w in waits) > 0, waits
    if name == "fsdp_groups":
        assert_bitwise(two["fsdp_groups"][0], two["ddp_groups"][0], "parameter groups")
        assert two["fsdp_groups"][0]["losses"] == two["ddp_groups"][0]["losses"]


def test_one_rank_equals_plain_ddp_bitwise(two):
    assert_bitwise(two["ddp_w1"][0], two["fsdp_w1"][0], "1 rank")
    assert two["ddp_w1"][0]["losses"] == two["fsdp_w1"][0]["losses"]


def test_each_rank_stores_half_of_every_block_and_of_the_optimizer_state(two):
    one, pair = two["fsdp_w1"][0], two["fsdp_gpt"]
    for rank, r in enumerate(pair):
        assert r["store_path"].endswith(f"store-rank{rank}.bin")
        # shards: ceil(block / 2), aligned; padding < one 256-byte slot per parameter and one per shard
        assert r["shard_bytes"] == pytest.approx(one["shard_bytes"] / 2, rel=0.02)
        assert r["state_bytes"] == pytest.approx(one["state_bytes"] / 2, rel=0.02)
    assert sum(r["state_bytes"] for r in pair) >= one["state_bytes"]


@pytest.mark.parametrize(("fsdp", "ddp", "world"), [("fsdp_2_to_2", "ddp_2_to_2", 2), ("fsdp_2_to_1", "ddp_2_to_1", 1),
                                                    ("fsdp_1_to_2", "ddp_1_to_2", 2),
                                                    ("fsdp_after_kill", "ddp_2_to_2", 2)])
def test_resume_in_new_processes_is_bitwise_at_the_same_and_at_another_world_size(two, fsdp, ddp, world):
    """The checkpoint holds the whole weights and each rank's optimizer shard by parameter and element range, so it
    reshards on load; resumed, it trains bitwise as plain DDP resumed from its own checkpoint of the same run.
    ``fsdp_after_kill``: a run that saved at step 16 had rank 1 SIGKILLed in the middle of step 20's backward (two
    blocks already updated and written back to its store, the others not; rank 0 then fails on the broken group);
    its checkpoint, resumed on the killed run's own store directory, is the step-16 state, not the torn one."""
    for rank in range(world):
        assert two[fsdp][rank]["global_step"] == STEPS
        assert_bitwise(two[ddp][rank], two[fsdp][rank], f"{fsdp}, rank {rank}")
        assert two[fsdp][rank]["losses"] == two[ddp][rank]["losses"]
        assert len(two[fsdp][rank]["losses"]) >= STEPS - 16


def test_restore_params_false_keeps_the_weights_sharded_and_refuses_state_dict(two):
    r = two["not_restored"][0]
    assert r["placeholders"] > 0  # the blocks' matrices are placeholders after fit, not gathered back
    assert "restore_params=False" in r["error"]


def test_what_is_not_supported_yet_is_refused_by_name(two):
    assert "accumulate_grad_batches" in two["refuse_accumulate"][0]["error"]


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The 7 B's compressed formats on 2 ranks: int8 moments (fp32 model) and int8 + ``bf16_sr`` (``bf16-true``,
    fused AdamW: the one-pass kernel), against plain DDP with the formats' in-memory reference
    (``RoundTripOptimizer``), and against ``nvme_offload_ddp`` with the same formats, each saving at step 16 and
    resumed in new processes at 2 ranks and at 1."""
    tmp = tmp_path_factory.mktemp("fsdp_formats")
    int8 = dict(optimizer="adamw_fused", state_format="int8")
    bf16 = dict(optimizer="adamw_fused", state_format="int8", master_format="bf16_sr", precision="bf16-true")
    ck = {name: str(tmp / f"{name}.ckpt") for name in ("nvme_ddp", "fsdp")}
    runs = [spec(tmp, "ddp_int8", "ddp", optimizer="adamw_fused", ref_format=["int8", "fp32"], steps=8),
            spec(tmp, "fsdp_int8", "fsdp", steps=8, **int8),
            spec(tmp, "ddp_bf16", "ddp", optimizer="adamw_fused", ref_format=["int8", "bf16_sr"], precision="bf16-true"),
            spec(tmp, "nvme_ddp_bf16", "nvme_ddp", save=ck["nvme_ddp"], **bf16),
            spec(tmp, "fsdp_bf16", "fsdp", save=ck["fsdp"], **bf16)]
    launch(tmp, runs, world=2)
    again = [spec(tmp, "nvme_ddp_2_to_2", "nvme_ddp", resume=ck["nvme_ddp"], **bf16),
             spec(tmp, "fsdp_2_to_2", "fsdp", resume=ck["fsdp"], **bf16)]
    launch(tmp, again, world=2)
    ones = [spec(tmp, "nvme_ddp_2_to_1", "nvme_ddp", resume=ck["nvme_ddp"], **bf16),
            spec(tmp, "fsdp_2_to_1", "fsdp", resume=ck["fsdp"], **bf16)]
    launch(tmp, ones, world=1)
    out = {r["name"]: results(r, 2) for r in runs + again}
    out.update({r["name"]: results(r, 1) for r in ones})
    return out


@pytest.mark.parametrize(("ref", "fsdp"), [("ddp_int8", "fsdp_int8"), ("ddp_bf16", "fsdp_bf16"),
                                           ("ddp_bf16", "nvme_ddp_bf16")])
def test_compressed_formats_equal_their_in_memory_reference_under_ddp_bitwise(formats, ref, fsdp):
    """Every cut of a block into shards falls on an int8 block boundary (``FlatShards(state_align=256)``), so each
    rank encodes exactly the blocks one process holding the whole parameter would; ``bf16_sr``'s noise is a hash
    of (step, parameter, element), the same whoever owns the element. So the sharded run equals plain DDP whose
    optimizer round-trips its state through the same formats in memory, bit for bit."""
    for rank in range(2):
        assert formats[fsdp][rank]["global_step"] == formats[ref][rank]["global_step"]
        assert_bitwise(formats[ref][rank], formats[fsdp][rank], f"{fsdp}, rank {rank}")
        assert formats[fsdp][rank]["losses"] == formats[ref][rank]["losses"]
    assert next(iter(formats["fsdp_bf16"][0]["params"].values())).dtype == torch.bfloat16
    assert formats["fsdp_bf16"][0]["fused_elements"] > 0  # the one-pass kernel ran on the shards


@pytest.mark.parametrize(("fsdp", "ddp", "world"), [("fsdp_2_to_2", "nvme_ddp_2_to_2", 2),
                                                    ("fsdp_2_to_1", "nvme_ddp_2_to_1", 1)])
def test_compressed_formats_resume_bitwise_at_the_same_and_at_another_world_size(formats, fsdp, ddp, world):
    """The int8 state (codes and one absmax per 256 elements) and the bf16 weights saved by 2 ranks, resumed in new
    processes on 2 and on 1, train as ``nvme_offload_ddp`` resumed from its own checkpoint of the same run."""
    for rank in range(world):
        assert formats[fsdp][rank]["global_step"] == STEPS
        assert len(formats[fsdp][rank]["losses"]) >= STEPS - 16
        assert_bitwise(formats[ddp][rank], formats[fsdp][rank], f"{fsdp}, rank {rank}")
        assert formats[fsdp][rank]["losses"] == formats[ddp][rank]["losses"]


SHARD_REGION = 7 * 4096  # a tied GPT block's shard at 2 ranks: 12 704 fp32 parameters, half of them, page-aligned


@pytest.fixture(scope="module")
def shelf(tmp_path_factory):
    """``host_memory_budget`` on 2 ranks: the host's budget split evenly, each rank's share (2.5 block shards) holding
    two of its four block shards in RAM; saved at step 16 and resumed in new processes with the same budget."""
    tmp = tmp_path_factory.mktemp("fsdp_shelf")
    budget = 2 * (5 * SHARD_REGION // 2)
    ck = {name: str(tmp / f"{name}.ckpt") for name in ("ddp", "fsdp")}
    runs = [spec(tmp, "ddp", "ddp", save=ck["ddp"]),
            spec(tmp, "fsdp", "fsdp", save=ck["fsdp"], host_memory_budget=budget)]
    launch(tmp, runs, world=2)
    again = [spec(tmp, "ddp_resumed", "ddp", resume=ck["ddp"]),
             spec(tmp, "fsdp_resumed", "fsdp", resume=ck["fsdp"], host_memory_budget=budget)]
    launch(tmp, again, world=2)
    out = {r["name"]: results(r, 2) for r in runs + again}
    out["budget"] = budget
    return out


@pytest.mark.parametrize(("ref", "fsdp"), [("ddp", "fsdp"), ("ddp_resumed", "fsdp_resumed")])
def test_host_budget_keeps_block_shards_in_ram_within_each_ranks_share_and_equals_ddp(shelf, ref, fsdp):
    """The shelf holds block shards (gathered from RAM and updated in place, never read from the disk) within
    each rank's share of the host's budget; the rest stream; the results equal plain DDP bitwise, resumed too."""
    share = shelf["budget"] // 2
    for rank in range(2):
        r = shelf[fsdp][rank]
        assert_bitwise(shelf[ref][rank], r, f"{fsdp}, rank {rank}")
        assert r["losses"] == shelf[ref][rank]["losses"]
        plan = r["placement"]
        assert plan["budget_bytes"] == share and 0 < r["shelf_bytes"] == plan["shelf_bytes"] <= share, plan
        assert plan["blocks_on_shelf"] == 2 and plan["blocks_on_ssd"] == 2, plan
        # two blocks read from the disk in forward and again in backward per step; the shelved two never
        assert r["block_reads"] <= 2 * 2 * len(r["losses"]) + 4, r["block_reads"]
    assert sum(r["shelf_bytes"] for r in shelf[fsdp]) <= shelf["budget"]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, two):
    """``inline_weights_bytes=0``: the checkpoint's block weights are not gathered into its state dict; the save
    gathers them one block at a time and rank 0 writes each into the file's weights record. Saved by 2 ranks at step
    16, resumed in new processes at 2 and at 1."""
    tmp = tmp_path_factory.mktemp("fsdp_streamed")
    ckpt = str(tmp / "streamed.ckpt")
    saved = spec(tmp, "saved", "fsdp", save=ckpt, inline_weights_bytes=0, export=str(tmp / "gpt.safetensors"))
    llama = spec(tmp, "llama", "fsdp", model="llama", chunk_bytes=4 << 10, steps=8, export=str(tmp / "llama-hf"),
                 export_layout="hf")
    launch(tmp, [saved, llama], world=2)
    again = spec(tmp, "resumed_2", "fsdp", resume=ckpt, inline_weights_bytes=0)
    meta = [spec(tmp, "meta_streamed", "fsdp", resume=ckpt, inline_weights_bytes=0, meta="init_module"),
            spec(tmp, "meta_inline", "fsdp", resume=two["checkpoints"]["fsdp2"], meta="init_module")]
    launch(tmp, [again, *meta], world=2)
    one = spec(tmp, "resumed_1", "fsdp", resume=ckpt, inline_weights_bytes=0)
    launch(tmp, [one], world=1)
    return {"saved": results(saved, 2), "resumed_2": results(again, 2), "resumed_1": results(one, 1), "ckpt": ckpt,
            "llama": results(llama, 2), "gpt_export": saved["export"], "llama_export": llama["export"],
            "meta_streamed": results(meta[0], 2), "meta_inline": results(meta[1], 2), "fsdp_2_to_2": two["fsdp_2_to_2"],
            "ddp_ckpt": two["checkpoints"]["ddp2"], "ddp_2_to_2": two["ddp_2_to_2"], "ddp_2_to_1": two["ddp_2_to_1"]}


def test_weights_above_inline_bytes_stream_into_the_file_and_open_in_torch_load(streamed):
    """The file holds the block weights as references into its weights record (no block gathered into the state
    dict); ``torch.load`` reads them back: the same tensors as plain DDP's checkpoint of the same step."""
    from lightning_nvme.checkpoint.weights import BesideWeight, deferred

    with deferred():
        raw = torch.load(streamed["ckpt"], weights_only=False)["state_dict"]
    refs = [k for k, v in raw.items() if isinstance(v, BesideWeight)]
    assert refs and all(".h." in k for k in refs), refs  # every block parameter, nothing outside the blocks
    got = torch.load(streamed["ckpt"], weights_only=False)["state_dict"]
    want = torch.load(streamed["ddp_ckpt"], weights_only=False)["state_dict"]
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize(("meta", "ref"), [("meta_streamed", "resumed_2"), ("meta_inline", "fsdp_2_to_2")])
def test_a_model_built_on_meta_resumes_from_the_checkpoints_weights(streamed, meta, ref):
    """``trainer.init_module()`` (every parameter on the meta device) and ``fit(ckpt_path=...)``: Lightning loads the
    weights before setup, when there is nothing to load into; they are kept and the model is built from them module
    by module (weights beside the file read one tensor at a time), not from its initialization (which, before, it
    silently was: the resumed run trained from fresh weights with the checkpoint's optimizer state). Bitwise equal to
    the same checkpoint resumed into a model built in memory."""
    for rank in range(2):
        assert streamed[meta][rank]["global_step"] == STEPS
        assert_bitwise(streamed[ref][rank], streamed[meta][rank], f"{meta}, rank {rank}")
        assert streamed[meta][rank]["losses"] == streamed[ref][rank]["losses"]


def test_export_during_fit_writes_the_trained_weights_gathered_one_block_at_a_time(streamed):
    """``export_weights`` in ``on_train_end`` (the blocks still sharded in the stores), every rank calling it, rank 0
    writing: Lightning's names in one safetensors file (the tied GPT), and the Hugging Face layout
    (``LlamaForCausalLM.from_pretrained`` opens it): the same tensors as the weights gathered back after fit."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    final = streamed["saved"][0]["params"]
    got = load_file(streamed["gpt_export"])
    for name, p in final.items():
        assert torch.equal(got[name], p), name
    model = LlamaForCausalLM.from_pretrained(streamed["llama_export"])
    final = streamed["llama"][0]["params"]
    assert streamed["llama"][0]["global_step"] == 8
    for name, p in model.named_parameters():
        assert torch.equal(p, final["model." + name]), name


def test_reads_led_by_rank0_serve_its_order_and_report_its_failure(tmp_path):
    """Two processes: rank 0 asks for blocks 2, 0, 1 and rank 1 takes part in exactly those gathers; when rank 0's
    writer fails after one block, rank 1 stops serving and raises naming rank 0's error (never left waiting)."""
    import torch.multiprocessing as mp

    mp.spawn(_led_reads, args=(str(tmp_path),), nprocs=2, join=True)
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert logs[0]["ok"] == logs[1]["ok"] == [2, 0, 1]
    assert logs[0]["failed"] == "OSError: [Errno 28] No space left on device"
    assert logs[1]["failed"].startswith("RuntimeError") and "No space left on device" in logs[1]["failed"]
    assert logs[0]["failed_reads"] == logs[1]["failed_reads"] == [1]


def _led_reads(rank: int, tmp: str) -> None:
    import types

    import torch.distributed as dist

    from lightning_nvme.params.sharded_weights import ShardedWeights

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    log: dict = {}
    try:
        read: list[int] = []
        units = [types.SimpleNamespace(index=i) for i in range(3)]

        def read_block(u):
            read.append(u.index)
            dist.barrier()  # a collective, as a gather is
            return {}

        weights = ShardedWeights(types.SimpleNamespace(world=2, rank=rank, group=dist.group.WORLD, units=units))
        weights.read_block = read_block  # the gather, here a barrier
        weights.reads_led_by_rank0(lambda ask: [ask(units[i]) for i in (2, 0, 1)])
        log["ok"], read[:] = list(read), []

        def failing(ask):
            ask(units[1])
            raise OSError(28, "No space left on device")

        try:
            weights.reads_led_by_rank0(failing)
        except BaseException as e:  # noqa: BLE001
            log["failed"] = f"{type(e).__name__}: {e}"
        log["failed_reads"] = read
    finally:
        dist.destroy_process_group()
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(log, f)


@pytest.mark.parametrize(("fsdp", "ddp", "world"), [("resumed_2", "ddp_2_to_2", 2), ("resumed_1", "ddp_2_to_1", 1)])
def test_weights_streamed_into_the_file_resume_bitwise(streamed, fsdp, ddp, world):
    for rank in range(world):
        assert streamed[fsdp][rank]["global_step"] == STEPS
        assert_bitwise(streamed[ddp][rank], streamed[fsdp][rank], f"{fsdp}, rank {rank}")
        assert streamed[fsdp][rank]["losses"] == streamed[ddp][rank]["losses"]


def test_only_the_trainable_tail_of_a_block_is_reduced():
    """Frozen first, then trainable: a reduction in rank order scatters only ``[trainable_start, total)``, each rank
    its part of it (none for a rank whose shard is all frozen)."""
    from lightning_nvme.params.shards import FlatShards

    frozen = torch.nn.Parameter(torch.zeros(1000), requires_grad=False)
    params = [("base", frozen), ("adapter", torch.nn.Parameter(torch.zeros(100)))]
    for world in (1, 2, 4):
        flat = FlatShards(params, world)
        counts = flat.trainable_counts()
        assert flat.trainable_start == 1024 and sum(counts) == flat.total - 1024, (world, counts)
        for rank in range(world):
            lo, hi = flat.bounds(rank)
            assert counts[rank] == max(0, hi - max(lo, 1024))
    assert FlatShards(params, 2).trainable_counts()[0] == 0


def test_flat_shards_cut_on_the_state_formats_blocks():
    from lightning_nvme.params.shards import FlatShards

    params = [("a", torch.zeros(300)), ("b", torch.zeros(7, 100)), ("c", torch.zeros(5))]
    for world in (1, 2, 3, 4):
        flat = FlatShards(params, world, state_align=256)
        for rank in range(world):
            for _slot, lo, _hi in flat.owned(rank):
                assert lo % 256 == 0, (world, rank, _slot.name, lo)


@pytest.mark.parametrize(("key", "value"), [("overlap", "step"), ("checkpoint_copy", "background"),
                                            ("eval_window", 4)])
def test_single_device_options_not_carried_yet_are_refused_by_name(key, value):
    from lightning_nvme import NVMeOffloadFSDPStrategy
    from lightning_nvme.checks import ConfigError

    with pytest.raises(ConfigError, match=f"{key}.*nvme_offload_fsdp does not support"):
        NVMeOffloadFSDPStrategy(**{key: value})


def test_registered_with_backward_overlap_by_default(tmp_path):
    from lightning.pytorch import Trainer

    import lightning_nvme  # noqa: F401
    from lightning_nvme import NVMeOffloadFSDPStrategy

    trainer = Trainer(default_root_dir=tmp_path, strategy="nvme_offload_fsdp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, NVMeOffloadFSDPStrategy)
    assert trainer.strategy.config.overlap == "backward"


def test_flat_shards_cover_every_element_once():
    from lightning_nvme.params.shards import FlatShards

    params = [("a", torch.zeros(70)), ("b", torch.zeros(3, 5)), ("c", torch.zeros(1))]
    for world in (1, 2, 3, 4):
        flat = FlatShards(params, world)
        assert flat.total == flat.shard * world and flat.shard % flat.align == 0
        seen = {n: torch.zeros(p.numel(), dtype=torch.int32) for n, p in params}
        for rank in range(world):
            for slot, lo, hi in flat.owned(rank):
                seen[slot.name][lo:hi] += 1
        assert all(bool((s == 1).all()) for s in seen.values()), world
        assert all(s.offset % flat.align == 0 for s in flat.slots)


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_meta")
    runs = [spec(tmp, "ddp", "ddp", meta="reference", steps=8), spec(tmp, "fsdp", "fsdp", meta="init_module", steps=8),
            spec(tmp, "ddp_ckpt", "ddp", checkpointing=True, steps=8),
            spec(tmp, "fsdp_ckpt", "fsdp", checkpointing=True, steps=8)]
    launch(tmp, runs, world=2)
    return {r["name"]: results(r, 2) for r in runs}


def test_model_built_on_meta_is_sharded_block_by_block_and_trains_as_ddp(meta):
    """``trainer.init_module()``: the model is created on the meta device, and setup initializes it module by module
    (Lightning's order and ``reset_parameters``), each block sharded into the store as soon as it is complete (the
    whole model is never in memory), rank 0's values broadcast; 8 AdamW steps then equal plain DDP on the same
    model initialized in memory, bitwise, and the wte / lm_head tie holds."""
    ref, fsdp = meta["ddp"], meta["fsdp"]
    for rank in range(2):
        assert fsdp[rank]["global_step"] == 8
        assert_bitwise(ref[rank], fsdp[rank], f"rank {rank}")
        assert fsdp[rank]["losses"] == ref[rank]["losses"]
        assert fsdp[rank]["tied"]


def test_activation_checkpointed_blocks_train_as_ddp(meta):
    """Every block under activation checkpointing (what a model bigger than memory needs: without it autograd keeps
    each block's gathered weights until its backward): the recomputation gathers the block again in backward; 8
    AdamW steps equal plain DDP with the same checkpointing, bitwise."""
    ref, fsdp = meta["ddp_ckpt"], meta["fsdp_ckpt"]
    for rank in range(2):
        assert fsdp[rank]["global_step"] == 8
        assert_bitwise(ref[rank], fsdp[rank], f"rank {rank}")
        assert fsdp[rank]["losses"] == ref[rank]["losses"]


def hub_checkpoint(directory, arch: str) -> str:
    """A tiny Hugging Face model saved with ``save_pretrained``: ``"llama"`` (untied head) in bf16, trained in fp32
    (each value converted as it is read); ``"qwen"`` (tied head, attention biases) in fp32, split into many files."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(5)
    if arch == "llama":
        AutoModelForCausalLM.from_config(LlamaConfig(**small, tie_word_embeddings=False)).to(torch.bfloat16).save_pretrained(directory)
        return str(directory)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**small, tie_word_embeddings=True))
    with torch.no_grad():  # biases start at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    model.save_pretrained(directory, max_shard_size="6KB")
    return str(directory)


def stored_bytes(directory: str) -> dict[str, int]:
    """Bytes of each tensor of a checkpoint directory, by key."""
    from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader
    from lightning_nvme.models.gpt import safetensors_files

    out = {}
    for file in safetensors_files(directory):
        reader = SafetensorsReader(file)
        for key, (dtype, shape, _) in reader.entries.items():
            out[key] = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        reader.close()
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama (bf16 file) and Qwen2 (tied head, several files) from ``save_pretrained``: plain DDP on the model
    ``from_pretrained`` loads in memory, and ``nvme_offload_fsdp`` on the model built on the meta device from the
    files (``HubWeights``), each rank reading its shard of each block tensor; the Llama also through the whole-tensor
    path (every tensor read whole on every rank, rank 0's blocks broadcast). Each rank counts the bytes it reads of
    each tensor (``SafetensorsReader.read``). And, on 1 rank, a source whose tensors are not the model's shape."""
    tmp = tmp_path_factory.mktemp("fsdp_pretrained")
    ck = {arch: hub_checkpoint(tmp / arch, arch) for arch in ("llama", "qwen")}
    hub = dict(model="hub", steps=8)
    runs = [spec(tmp, "ddp_llama", "ddp", hub=ck["llama"], **hub),
            spec(tmp, "fsdp_llama", "fsdp", hub=ck["llama"], meta="hub", chunk_bytes=4 << 10, **hub),
            spec(tmp, "fsdp_llama_whole", "fsdp", hub=ck["llama"], meta="hub", whole_reads=True, chunk_bytes=4 << 10,
                 **hub),
            spec(tmp, "ddp_qwen", "ddp", hub=ck["qwen"], **hub),
            spec(tmp, "fsdp_qwen", "fsdp", hub=ck["qwen"], meta="hub", chunk_bytes=4 << 10, **hub)]
    launch(tmp, runs, world=2)
    mismatch = [spec(tmp, name, "fsdp", hub=ck["llama"], meta="hub", intermediate_size=48, expect_error=True,
                     whole_reads=name == "mismatch_whole", **{**hub, "steps": 1}) for name in ("mismatch", "mismatch_whole")]
    launch(tmp, mismatch, world=1)
    out = {r["name"]: results(r, 2) for r in runs}
    out.update({r["name"]: results(r, 1) for r in mismatch})
    out["stored"] = {arch: stored_bytes(path) for arch, path in ck.items()}
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_a_pretrained_model_built_on_meta_from_each_ranks_shard_trains_as_ddp(pretrained, arch):
    """Each rank fills its shard of every block from the element ranges it owns of each tensor (no broadcast): 8
    AdamW steps equal plain DDP on the model ``from_pretrained`` loads, bitwise, and (Llama) the same build reading
    every tensor whole on every rank."""
    ref, fsdp = pretrained[f"ddp_{arch}"], pretrained[f"fsdp_{arch}"]
    for rank in range(2):
        assert fsdp[rank]["global_step"] == 8
        assert_bitwise(ref[rank], fsdp[rank], f"{arch}, rank {rank}")
        assert fsdp[rank]["losses"] == ref[rank]["losses"]
        if arch == "llama":
            whole = pretrained["fsdp_llama_whole"][rank]
            assert_bitwise(whole, fsdp[rank], f"whole reads, rank {rank}")
            assert whole["losses"] == fsdp[rank]["losses"]
    assert fsdp[0]["blocks"] == 2


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_each_rank_reads_only_its_shard_of_each_block_tensor(pretrained, arch):
    """Of the block tensors in the files, each rank reads about half (its shard: every element read once, by one
    rank); the tensors outside blocks (embeddings, final norm), which every rank holds whole, whole on every rank.
    Through the whole-tensor path, each rank read all of them."""
    stored = pretrained["stored"][arch]
    blocks = {k: n for k, n in stored.items() if ".layers." in k}
    total = sum(blocks.values())
    got = [sum(n for k, n in r["read_bytes"].items() if k in blocks) for r in pretrained[f"fsdp_{arch}"]]
    assert sum(got) == total and max(got) <= 0.6 * total, (got, total)
    for r in pretrained[f"fsdp_{arch}"]:
        assert all(r["read_bytes"].get(k, 0) >= n for k, n in stored.items() if k not in blocks), r["read_bytes"]
    if arch == "llama":
        whole = [sum(n for k, n in r["read_bytes"].items() if k in blocks) for r in pretrained["fsdp_llama_whole"]]
        assert whole == [total, total], (whole, total)


@pytest.mark.parametrize("run", ["mismatch", "mismatch_whole"])
def test_a_block_tensor_of_another_shape_is_refused_by_name(pretrained, run):
    """A source whose tensor has another shape than the model's (here checked against the model its files were
    saved from, given to one with a narrower MLP) is refused naming the tensor and both shapes, before any of it is
    read by range, and so is it by the whole-tensor path; the error is the one the fit raises (the teardown after
    the failed build no longer fails on the tensors left on the meta device, hiding it)."""
    error = pretrained[run][0]["error"]
    assert error.startswith("ValueError: model.model.layers.0.mlp.gate_proj.weight: the checkpoint holds shape "
                            "(64, 32), the model (48, 32)"), error


@pytest.fixture(scope="module")
def four(tmp_path_factory, two):
    """4 processes: the tied GPT and the tiny Llama, 24 AdamW steps, against plain DDP whose all-reduce adds in rank
    order (``ordered_allreduce_hook``); one SGD step with ``reduce_order="backend"`` against plain DDP; and the
    2-rank checkpoints of ``two`` (step 16) resumed on 4 ranks, each by its own kind of run."""
    tmp = tmp_path_factory.mktemp("fsdp4")
    ck = two["checkpoints"]
    runs = [spec(tmp, "ddp_gpt", "ddp", hook="ordered"), spec(tmp, "fsdp_gpt", "fsdp"),
            spec(tmp, "ddp_2_to_4", "ddp", hook="ordered", resume=ck["ddp2"]),
            spec(tmp, "fsdp_2_to_4", "fsdp", resume=ck["fsdp2"]),
            spec(tmp, "ddp_llama", "ddp", model="llama", hook="ordered"),
            spec(tmp, "fsdp_llama", "fsdp", model="llama", chunk_bytes=4 << 10),
            spec(tmp, "ddp_lora", "ddp", lora=True, hook="ordered"), spec(tmp, "fsdp_lora", "fsdp", lora=True),
            spec(tmp, "ddp_sgd", "ddp", optimizer="sgd", steps=1),
            spec(tmp, "fsdp_sgd", "fsdp", optimizer="sgd", steps=1, reduce_order="backend")]
    launch(tmp, runs, world=4)
    return {r["name"]: results(r, 4) for r in runs}


@pytest.mark.parametrize("model", ["gpt", "llama", "lora"])
def test_four_ranks_equal_ddp_summing_in_rank_order_bitwise(four, model):
    """``reduce_order="rank"`` (the default) adds every gradient element's four partial gradients (each already
    multiplied by 1/4, as DDP's reducer does) as ((g0 + g1) + g2) + g3; plain DDP with ``ordered_allreduce_hook``
    adds them in the same order, so 24 AdamW steps give the same parameters and losses, bit for bit, on every rank."""
    ref, fsdp = four[f"ddp_{model}"], four[f"fsdp_{model}"]
    for rank in range(4):
        assert fsdp[rank]["global_step"] == STEPS
        assert fsdp[rank]["comm"] == "shared_memory"  # its 4 x 4 cells of all-to-all
        assert_bitwise(ref[rank], fsdp[rank], f"rank {rank}")
        assert fsdp[rank]["losses"] == ref[rank]["losses"]
        assert_bitwise(fsdp[0], fsdp[rank], "replicas")
    assert fsdp[0]["shard_bytes"] * 4 == pytest.approx(sum(fsdp[0]["block_bytes"]), rel=0.05)


def test_two_rank_checkpoint_resumes_on_four_ranks_bitwise_as_ddp_in_rank_order(four):
    """2 -> 4: the step-16 checkpoint of the 2-rank run, resharded on load into quarters of every block and of the
    optimizer state, trains the last 8 steps on 4 ranks exactly as plain DDP (adding in rank order) resumed on 4 ranks
    from its own 2-rank checkpoint: same parameters and losses on every rank, bit for bit."""
    ref, fsdp = four["ddp_2_to_4"], four["fsdp_2_to_4"]
    for rank in range(4):
        assert fsdp[rank]["global_step"] == STEPS
        assert len(fsdp[rank]["losses"]) >= STEPS - 16
        assert_bitwise(ref[rank], fsdp[rank], f"2 -> 4, rank {rank}")
        assert fsdp[rank]["losses"] == ref[rank]["losses"]
    assert fsdp[0]["shard_bytes"] * 4 == pytest.approx(sum(fsdp[0]["block_bytes"]), rel=0.05)


def test_four_ranks_backend_order_is_within_a_rounding_of_plain_ddp(four):
    """``reduce_order="backend"``: Gloo's reduce-scatter adds the four terms in the order of its ring for the rank
    owning the element, DDP's all-reduce in the order of its own ring over the bucket; one step's parameters then
    differ by at most a rounding of the sum: every tensor within 2 ulp of its largest magnitude."""
    ref, fsdp = four["ddp_sgd"], four["fsdp_sgd"]
    for rank in range(4):
        for name, p in ref[rank]["params"].items():
            q = fsdp[rank]["params"][name]
            ulp = torch.finfo(p.dtype).eps * p.abs().max()
            assert (p - q).abs().max() <= 2 * ulp, f"rank {rank}: {name}"


def test_ordered_sum_adds_left_to_right():
    from lightning_nvme.params.ordered_sum import ordered_sum

    parts = torch.tensor([[1e8], [1.0], [-1e8], [1.0]], dtype=torch.float32)
    assert ordered_sum(parts).item() == 1.0  # ((1e8 + 1) - 1e8) + 1: float32's 1e8 + 1 rounds to 1e8
    assert ordered_sum(parts[[0, 2, 1, 3]]).item() == 2.0  # another order, another sum


# ---- the worker side (run by Lightning in every rank) -----------------------------------------------------------
class _Llama:
    @staticmethod
    def build():
        from _param_offload_model import tokens
        from lightning.pytorch import LightningModule
        from torch.utils.data import DataLoader
        from transformers import LlamaConfig, LlamaForCausalLM

        class TinyLlama(LightningModule):
            def __init__(self, batch_size: int) -> None:
                super().__init__()
                torch.manual_seed(0)
                cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                  tie_word_embeddings=False, attn_implementation="eager")
                self.model = LlamaForCausalLM(cfg)
                self.batch_size = batch_size

            def training_step(self, batch, batch_idx):
                x, y = batch
                logits = self.model(input_ids=x).logits
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

            def train_dataloader(self):
                return DataLoader(tokens(), batch_size=self.batch_size, shuffle=False)

        return TinyLlama


class _Hub:
    @staticmethod
    def build():
        tiny_llama = _Llama.build()

        class HubLM(tiny_llama):
            """A Hugging Face checkpoint directory: loaded in memory (``from_pretrained``), or (``on_meta``) built on
            the meta device and filled from its files at setup (``initial_weights``); trained as the tiny Llama."""

            def __init__(self, path: str, batch_size: int, on_meta: bool, intermediate_size: int | None = None):
                super(tiny_llama, self).__init__()  # LightningModule's: the model comes from ``path``, not a config
                from lightning_nvme.models.hf import HubWeights, build_causal_lm, load_config

                self.batch_size = batch_size
                self._hub = None
                if on_meta:
                    self.model = build_causal_lm(path, dtype=torch.float32)
                    self._hub = HubWeights(path, prefix="model.").checked(self.model)
                    if intermediate_size:  # the source stays checked against the files' model: not this one's shapes
                        config = load_config(path)
                        config.intermediate_size = intermediate_size
                        self.model = build_causal_lm(config, dtype=torch.float32)
                else:
                    from transformers import AutoModelForCausalLM

                    self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
                    self.model.train()

            def initial_weights(self):
                return self._hub

        return HubLM


@contextmanager
def _counted_reads(run: dict, read_bytes: dict):
    """Bytes each ``SafetensorsReader.read`` returns, by tensor key, into ``read_bytes``; with ``whole_reads``,
    ``nvme_offload_fsdp`` is not told that the source reads ranges (every tensor read whole, as before)."""
    from lightning_nvme.checkpoint.safetensors_stream import SafetensorsReader
    from lightning_nvme.params import sharded as sharded_mod

    read, ranged = SafetensorsReader.read, sharded_mod.ranged

    def counting(self, name, *args, **kwargs):
        out = read(self, name, *args, **kwargs)
        read_bytes[name] = read_bytes.get(name, 0) + out.numel() * out.element_size()
        return out

    SafetensorsReader.read = counting
    if run.get("whole_reads"):
        sharded_mod.ranged = lambda source: None
    try:
        yield
    finally:
        SafetensorsReader.read, sharded_mod.ranged = read, ranged


def _ordered_ddp():
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_nvme.params.ordered_sum import ordered_allreduce_hook

    class OrderedDDP(DDPStrategy):
        """Plain DDP whose all-reduce adds in rank order. Registered here because Lightning's
        ``DDPStrategy(ddp_comm_hook=...)`` registers a hook on CUDA only (silently ignored on CPU), while torch's
        ``register_comm_hook`` works on Gloo too."""

        def _register_ddp_hooks(self) -> None:
            self.model.register_comm_hook(None, ordered_allreduce_hook)

    return OrderedDDP


def _worker(spec_path: str) -> None:
    sys.path.insert(0, TESTS)
    spec = json.loads(open(spec_path).read())
    for run in spec["runs"]:
        _train(run, spec["world"])
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _train(run: dict, world: int) -> None:
    from _param_offload_model import TinyGPT
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_nvme  # noqa: F401
    from lightning_nvme import NVMeOffloadFSDPStrategy
    from lightning_nvme.optim.chunk_update import ChunkUpdater

    OrderedDDP = _ordered_ddp()
    batch = 8 // world
    if run.get("meta") == "reference":  # built on meta, initialized in memory as Lightning materializes
        from lightning.fabric.utilities.init import _materialize_meta_tensors

        with torch.device("meta"):
            model = TinyGPT(batch_size=batch)
        torch.manual_seed(3)
        torch.__future__.set_swap_module_params_on_conversion(True)  # the wte / lm_head tie holds
        _materialize_meta_tensors(model, "cpu")
        torch.__future__.set_swap_module_params_on_conversion(False)
    elif run.get("model") == "hub":
        model = _Hub.build()(run["hub"], batch, on_meta=run.get("meta") == "hub",
                             intermediate_size=run.get("intermediate_size"))
    elif run.get("model") == "llama":
        model = _Llama.build()(batch_size=batch)
        if run.get("peft"):  # peft's LoRA on q and v (its base frozen); the optimizer is given every parameter
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(1)
            model.model = get_peft_model(model.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 init_lora_weights=False))
    else:
        ref_format = tuple(run["ref_format"]) if run.get("ref_format") else None
        model = TinyGPT(run.get("optimizer", "adamw"), batch_size=batch, checkpointing=run.get("checkpointing", False),
                        ref_format=ref_format, lora=run.get("lora", False))
    if run.get("frozen_block_param"):
        model.model.transformer["h"][0].ln_1.weight.requires_grad_(False)
    initial_frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    formats = {k: run[k] for k in ("state_format", "master_format") if k in run}
    if run["strategy"] == "ddp":
        strategy = OrderedDDP() if run.get("hook") == "ordered" else DDPStrategy()
    elif run["strategy"] == "nvme_ddp":
        from lightning_nvme import NVMeOffloadDDPStrategy

        strategy = NVMeOffloadDDPStrategy(store_dir=run["store"], chunk_bytes=run.get("chunk_bytes", 16 << 10),
                                          **formats)
    else:
        from datetime import timedelta

        strategy = NVMeOffloadFSDPStrategy(store_dir=run["store"], chunk_bytes=run.get("chunk_bytes", 16 << 10),
                                           timeout=timedelta(seconds=run.get("timeout_s", 1800)),
                                           reduce_order=run.get("reduce_order", "rank"),
                                           collectives=run.get("collectives", "auto"),
                                           restore_params=run.get("restore_params", True),
                                           host_memory_budget=run.get("host_memory_budget", 0),
                                           inline_weights_bytes=run.get("inline_weights_bytes", 1 << 30), **formats)
    losses: list[float] = []
    batches: list[tuple[int, int, int]] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            batches.append((trainer.current_epoch, batch_idx, int(batch[0].sum())))

        def on_before_backward(self, trainer, pl_module, loss):
            if trainer.global_step == run.get("kill_step") and trainer.global_rank == 1:
                # mid-step: once the last two blocks are updated and written back, during block 1's backward
                weight = pl_module.model.transformer["h"][1].mlp.c_fc.weight
                weight.register_post_accumulate_grad_hook(lambda p: os.kill(os.getpid(), signal.SIGKILL))

        def on_train_epoch_end(self, trainer, pl_module):
            if run.get("save") and trainer.current_epoch == SAVE_EPOCH:
                trainer.save_checkpoint(run["save"])

        def on_train_end(self, trainer, pl_module):  # what the shelf held (the store's close empties it)
            s = trainer.strategy
            if getattr(s, "sharded", None) is not None and s.sharded.residency is not None:
                shelf.update(pool_buffers=s.sharded.residency.transfer.stats.pool_buffers,
                             block_loads=s.sharded.residency.stats.loads, spare_reused=s.sharded.io.spare.reused,
                             param_prefetch=s.config.param_prefetch)
            if run.get("export"):  # during fit: the blocks are still sharded in the stores
                s.export_weights(run["export"], layout=run.get("export_layout", "lightning"))
            if getattr(s, "sharded", None) is not None and s.shelf_plan is not None and s.nvme_store is not None:
                stats = s.sharded.residency.stats
                shelf.update(shelf_bytes=s.nvme_store.shelf.nbytes, placement=s.shelf_plan.as_dict(),
                             block_reads=stats.loads, block_bytes_written=stats.bytes_written - shelf["written_at_start"])

        def on_train_start(self, trainer, pl_module):
            s = trainer.strategy
            if getattr(s, "sharded", None) is not None:
                shelf["written_at_start"] = s.sharded.residency.stats.bytes_written
                shelf["comm"] = s.sharded.io.comm.name

    shelf: dict = {}

    trainer = Trainer(default_root_dir=run["root"], strategy=strategy, accelerator="cpu", devices=world,
                      max_steps=run.get("steps", STEPS), accumulate_grad_batches=run.get("accumulate", 1),
                      precision=run.get("precision", "32-true"),
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=[Record()])
    if run.get("meta") == "init_module":  # on the meta device, initialized (seed 3) block by block into the shards
        with trainer.init_module(empty_init=True):
            model = TinyGPT(batch_size=batch, init_seed=3)
        assert all(p.is_meta for p in model.parameters())
    updated_in_backward = 0
    original = ChunkUpdater.update_chunk
    waiting = {"checked": 0, "whole": 0, "max_fraction": 0.0, "max_pending_blocks": 0}
    if run["strategy"] == "fsdp":  # what a block waiting only for its reduction and update keeps (gathered weights)
        from lightning_nvme.params import sharded as sharded_mod

        let_go = sharded_mod.ShardedParams._let_go

        def watched(self, u, why):
            let_go(self, u, why)
            for unit in self.units:
                held = set(+unit.refs)
                if held and held <= {sharded_mod.REDUCE, sharded_mod.UPDATE} and unit.full is not None:
                    waiting["checked"] += 1
                    waiting["whole"] += unit.window is None
                    waiting["max_fraction"] = max(waiting["max_fraction"], unit.full.numel() / unit.flat.total)
            waiting["max_pending_blocks"] = max(waiting["max_pending_blocks"], sum(bool(x.pending) for x in self.units))

        sharded_mod.ShardedParams._let_go = watched

    def counting(self, c, in_backward=False):
        nonlocal updated_in_backward
        updated_in_backward += bool(in_backward)
        return original(self, c, in_backward)

    ChunkUpdater.update_chunk = counting
    read_bytes: dict[str, int] = {}
    try:
        with _counted_reads(run, read_bytes):
            trainer.fit(model, ckpt_path=run.get("resume"))
    except Exception as e:  # noqa: BLE001  (a run that must be refused records its error)
        if not run.get("expect_error"):
            raise
        os.makedirs(os.path.dirname(run["out"]), exist_ok=True)
        torch.save({"error": f"{type(e).__name__}: {e}"}, f"{run['out']}.rank{trainer.global_rank}.pt")
        return
    finally:
        ChunkUpdater.update_chunk = original
    if not run.get("restore_params", True):
        try:
            model.state_dict()
            out_error = ""
        except RuntimeError as e:
            out_error = str(e)
        os.makedirs(os.path.dirname(run["out"]), exist_ok=True)
        torch.save({"error": out_error, "placeholders": sum(p.stride() == (0, 0) for p in model.parameters() if p.dim() == 2)},
                   f"{run['out']}.rank{trainer.global_rank}.pt")
        return
    tied = hasattr(model.model, "transformer") and model.model.lm_head.weight is model.model.transformer.wte.weight
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "global_step": trainer.global_step,
           "tied": tied, **shelf, "frozen": sorted(initial_frozen), "initial_frozen": initial_frozen,
           "losses": losses, "batches": batches, "updated_in_backward": updated_in_backward, "waiting": waiting,
           "read_bytes": read_bytes}
    if run["strategy"] == "fsdp":
        s = trainer.strategy
        from lightning_nvme.params.offload import chunks_per_unit

        out.update(spare_after_fit=sum(map(len, s.sharded.io.spare._free.values())))
        out.update(fused_elements=s.offloaded[0].fused_elements, read_ahead=s.offloaded[0].reads.depth,
                   prefetch_depth=s.config.prefetch_depth,
                   chunks_per_block_shard=chunks_per_unit(s._chunk_units(), s.offloaded[0].chunks))
        units = s.sharded.units
        out.update(blocks=len(units), shard_bytes=sum(u.flat.shard_bytes for u in units),
                   block_bytes=[sum(sl.numel for sl in u.flat.slots) * 4 for u in units],
                   state_bytes=s.offloaded[0].state_bytes, store_path=s.offloaded[0].store_ref.path)
    os.makedirs(os.path.dirname(run["out"]), exist_ok=True)
    torch.save(out, f"{run['out']}.rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    _worker(sys.argv[1])
