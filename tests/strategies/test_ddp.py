"""NVMeOffloadDDPStrategy on 2 processes (Gloo, CPU): bitwise equal to plain DDP (norm clipping included,
which is global because every rank holds the all-reduced gradient), identical replicas, and each rank's
store holding only its share of the state.

Lightning's own launcher starts the processes: each test runs this file as a script in a subprocess
(``python tests/strategies/test_ddp.py SPEC.json``), which runs ``Trainer(devices=N)`` for each run of the spec and
saves every rank's parameters; pytest itself is never forked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # models.py


# ---- the launcher side (pytest) ---------------------------------------------------------------------------
def launch(tmp_path, runs: list[dict], world: int = 2, expect_kill: bool = False) -> None:
    """Run ``runs`` one after another in one ``Trainer(devices=world)`` job; results land in each run's ``out``."""
    spec = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"world": world, "runs": runs}))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "test_ddp.py"), str(spec)], env=env, timeout=900,
                          capture_output=True, text=True)
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-5000:]


def results(out: str, world: int = 2) -> list[dict]:
    return [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(world)]


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), f"{what}: parameter {name} differs"


def run_spec(tmp_path, name: str, strategy: str, **kw) -> dict:
    return {"name": name, "strategy": strategy, "root": str(tmp_path / name), "out": str(tmp_path / name / "result"),
            "store": str(tmp_path / name / "store"), **kw}


# ---- the tests ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-process job, each pair a reference and its nvme_offload_ddp twin: AdamW with two param groups,
    LR scheduler, accumulation and norm clipping; overlap='backward' with value clipping; bf16-true with fp32
    master weights; manual optimization with two optimizers; no optimizer (automatic and manual). Plus
    ModelCheckpoint."""
    tmp = tmp_path_factory.mktemp("ddp")
    common = {"steps": 20, "accumulate": 2, "clip": 0.05, "clip_algo": "norm"}
    # small DDP buckets, so several all-reduces finish while backward still runs
    backward = {"steps": 20, "accumulate": 2, "clip": 0.01, "clip_algo": "value", "ddp_kwargs": {"bucket_cap_mb": 0.01}}
    runs = [run_spec(tmp, "ddp", "ddp", **common),
            run_spec(tmp, "offload", "offload", chunk_bytes=16 << 10, **common),
            run_spec(tmp, "ddp_value", "ddp", **backward),
            # tiny broadcast buckets: large ranges cut and sent in place, small ones packed (param_broadcast)
            run_spec(tmp, "offload_backward", "offload", overlap="backward", chunk_bytes=8 << 10,
                     offload_kwargs={"broadcast_bucket_bytes": 4096}, **backward),
            run_spec(tmp, "ddp_master", "ddp", model="master_weights_reference", precision="bf16-true", steps=20),
            run_spec(tmp, "offload_bf16", "offload", precision="bf16-true", steps=20),
            run_spec(tmp, "model_checkpoint", "offload", steps=12, model_checkpoint=str(tmp / "ckpts")),
            run_spec(tmp, "ddp_manual", "ddp", model="two_optimizers", steps=20),
            run_spec(tmp, "offload_manual", "offload", model="two_optimizers", steps=20, chunk_bytes=8 << 10),
            # one epoch (16 steps per rank): manual optimization without an optimizer never advances global_step
            run_spec(tmp, "ddp_no_optimizer", "ddp", model="no_optimizer", epochs=1),
            run_spec(tmp, "offload_no_optimizer", "offload", model="no_optimizer", epochs=1),
            run_spec(tmp, "ddp_manual_no_optimizer", "ddp", model="manual_no_optimizer", epochs=1),
            run_spec(tmp, "offload_manual_no_optimizer", "offload", model="manual_no_optimizer", epochs=1)]
    launch(tmp, runs)
    return {r["name"]: results(r["out"]) for r in runs}


def test_bitwise_equal_to_plain_ddp_with_global_norm_clipping(trained):
    ref, off = trained["ddp"], trained["offload"]
    for rank in range(2):
        assert off[rank]["global_step"] == 20
        assert_bitwise(ref[rank], off[rank], f"rank {rank}")
    assert_bitwise(off[0], off[1], "replicas")
    # Clipping was active (pre-clip norms above the threshold) and saw the same global norm on every rank.
    norms = [r["grad_norms"] for r in off]
    assert norms[0] == norms[1] == ref[0]["grad_norms"]
    assert max(norms[0]) > 0.05


def test_backward_overlap_with_value_clipping_equals_plain_ddp(trained):
    ref, off = trained["ddp_value"], trained["offload_backward"]
    for rank in range(2):
        assert_bitwise(ref[rank], off[rank], f"rank {rank}")
    assert off[0]["updated_in_backward"] > 0, "no chunk was updated during backward"


def test_bf16_master_weights_equal_in_memory_master_weight_reference(trained):
    """bf16 params, fp32 master weights in each rank's store: equal to plain DDP driving an in-memory
    fp32-master AdamW (the same gradients, all-reduced in bf16)."""
    ref, off = trained["ddp_master"], trained["offload_bf16"]
    for rank in range(2):
        assert all(p.dtype == torch.bfloat16 for n, p in off[rank]["params"].items())
        assert_bitwise(ref[rank], off[rank], f"rank {rank}")
    assert off[0]["state_bytes"] + off[1]["state_bytes"] >= 12 * sum(  # exp_avg, exp_avg_sq, master: 3 x fp32
        p.numel() for n, p in off[0]["params"].items() if not n.startswith("frozen"))


@pytest.fixture(scope="module")
def save_failure(tmp_path_factory):
    """A job of its own, so the stress mode (tests/stress.py) can repeat this test without the others' runs."""
    tmp = tmp_path_factory.mktemp("ddp-save-failure")
    run = run_spec(tmp, "save_failure", "offload", steps=4, failing_save=str(tmp / "f.ckpt"))
    launch(tmp, [run])
    return results(run["out"])


def test_failed_save_on_one_rank_fails_every_rank_and_keeps_the_previous_checkpoint(save_failure):
    for rank, r in enumerate(save_failure):
        assert "disk went away" in r["save_error"], (rank, r["save_error"])
        assert r["unchanged"], f"rank {rank}: the previous checkpoint was modified"
        assert r["leftovers"] == []


def test_model_checkpoint_callback_keeps_sharded_last_and_top_k(trained):
    """ModelCheckpoint every 4 steps, save_last, top-1: old checkpoints (file and optimizer state) are removed by
    rank 0, last.ckpt is replaced atomically, every kept checkpoint holds both ranks' shards, no temp is left."""
    checkpoints = trained["model_checkpoint"][0]["checkpoints"]
    assert trained["model_checkpoint"][0]["listing"] == ["epoch=0-step=12.ckpt", "last.ckpt"]  # one file each
    for name, files in checkpoints.items():
        assert files == ["optimizer-0-rank0.safetensors", "optimizer-0-rank1.safetensors"], name
    assert trained["model_checkpoint"][0]["leftovers"] == []


def test_manual_optimization_with_two_optimizers_equals_plain_ddp(trained):
    ref, off = trained["ddp_manual"], trained["offload_manual"]
    for rank in range(2):
        assert_bitwise(ref[rank], off[rank], f"rank {rank}")


@pytest.mark.parametrize("model", ["no_optimizer", "manual_no_optimizer"])
def test_configure_optimizers_returning_none_trains_as_plain_ddp(trained, model):
    """Lightning's ``_MockOptimizer`` (automatic) or hand-made updates (manual): nothing offloaded, same run."""
    ref, off = trained[f"ddp_{model}"], trained[f"offload_{model}"]
    for rank in range(2):
        assert off[rank]["global_step"] == ref[rank]["global_step"] == (16 if model == "no_optimizer" else 0)
        assert off[rank]["offloaded"] == 0
        assert_bitwise(ref[rank], off[rank], f"rank {rank}")
    assert_bitwise(off[0], off[1], "replicas")


def test_each_rank_stores_only_its_share(trained):
    """Each rank's store holds <= total / N + one chunk of state (total = what one process would store)."""
    off = trained["offload"]
    total = off[0]["single_process_state_bytes"]
    chunk = off[0]["chunk_bytes"]
    per_rank = [r["state_bytes"] for r in off]
    assert total <= sum(per_rank) <= total * 1.01  # every element's state is on one rank (+ slot padding of cuts)
    for rank, r in enumerate(off):
        assert r["state_bytes"] <= total / 2 + chunk, (rank, per_rank, total)
        assert r["store_path"].endswith(f"store-rank{rank}.bin")
        assert r["store_regions_bytes"] <= total / 2 + chunk + 4096 * r["store_regions"], (rank, r, total)


def test_registered_and_constructed_from_a_string(tmp_path):
    from lightning.pytorch import Trainer

    import lightning_nvme  # noqa: F401
    from lightning_nvme import NVMeOffloadDDPStrategy

    trainer = Trainer(default_root_dir=tmp_path, strategy="nvme_offload_ddp", accelerator="cpu", devices=2,
                      logger=False)
    assert isinstance(trainer.strategy, NVMeOffloadDDPStrategy)
    assert trainer.strategy.num_processes == 2 and trainer.strategy.config.overlap == "step"


@pytest.mark.parametrize("kwargs, key", [
    ({"broadcast_bucket_bytes": 0}, "broadcast_bucket_bytes"),
    ({"chunk_bytes": -1}, "chunk_bytes"),
    ({"overlap": "sometimes"}, "overlap"),
])
def test_invalid_arguments_are_named(kwargs, key):
    from lightning_nvme import NVMeOffloadDDPStrategy

    with pytest.raises(ValueError, match=key):
        NVMeOffloadDDPStrategy(**kwargs)


@pytest.mark.parametrize(("kwargs", "closest"), [
    ({"io_worker": 2}, "io_workers"),  # a setting
    ({"find_unused_parameter": True}, "find_unused_parameters"),  # an argument of DistributedDataParallel
    ({"ddp_comm_hooks": None}, "ddp_comm_hook"),  # an argument of Lightning's DDPStrategy
])
def test_unknown_argument_names_the_closest_one(kwargs, closest):
    """A misspelt argument is refused when the strategy is built, not passed on to DistributedDataParallel."""
    from lightning_nvme import NVMeOffloadDDPStrategy

    (name,) = kwargs
    with pytest.raises(TypeError, match=f"nvme_offload_ddp: unexpected argument '{name}' "
                                        rf"\(did you mean '{closest}'\?\)"):
        NVMeOffloadDDPStrategy(**kwargs)


def test_arguments_of_distributed_data_parallel_are_passed_on():
    from lightning_nvme import NVMeOffloadDDPStrategy

    strategy = NVMeOffloadDDPStrategy(find_unused_parameters=True, bucket_cap_mb=1, chunk_bytes=1 << 20)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 1}
    assert strategy.config.chunk_bytes == 1 << 20


def test_partition_balances_bytes_and_cuts_large_params():
    from lightning_nvme.optim import partition_by_bytes

    big, small = torch.nn.Parameter(torch.zeros(1000)), [torch.nn.Parameter(torch.zeros(10)) for _ in range(7)]
    half = torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([big, *small, half])
    for world in (1, 2, 3, 4):
        part = partition_by_bytes(opt, world)
        balance = max(part.state_bytes) / (sum(part.state_bytes) / world)  # max / mean; 1.0 is perfect
        assert balance <= 1.01, (world, part.state_bytes)
        covered: dict[int, list] = {}
        for r in range(world):
            for i, rs in part.owned(r).items():
                covered.setdefault(i, []).extend(rs)
        for i, p in enumerate([big, *small, half]):
            spans = sorted(covered[i])
            assert spans[0][0] == 0 and spans[-1][1] == p.numel()
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans  # no gap, no overlap
    assert partition_by_bytes(opt, 2).state_bytes[0] == 1000 * 8 // 2 + (70 * 8 + 300 * 12) // 2


def test_broadcast_plan_sends_large_ranges_in_place_and_packs_small_ones_within_the_bucket():
    from lightning_nvme.strategies.param_broadcast import PACK_BELOW, plan_items

    large = PACK_BELOW // 4 * 3  # fp32 elements: 3x the packing threshold
    params = [torch.zeros(large), torch.zeros(10), torch.zeros(20, dtype=torch.bfloat16), torch.zeros(30)]
    pieces = [[(0, 0, large), (1, 0, 10), (2, 0, 20)], [(3, 0, 30)]]  # rank 0 owns 0-2, rank 1 owns 3
    bucket = PACK_BELOW  # cuts the large range into 3 in-place broadcasts
    plan = plan_items(pieces, params, bucket)
    assert [it.ranges for it in plan[0] if it.packed is None] == [
        ((0, i * large // 3, (i + 1) * large // 3),) for i in range(3)]
    packed = [it for per in plan for it in per if it.packed is not None]
    assert [it.ranges for it in packed] == [((1, 0, 10),), ((2, 0, 20),), ((3, 0, 30),)]  # one per (rank, dtype)
    spans = sorted(it.packed for it in packed)
    assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint slices of one staging buffer
    assert spans[-1][0] + spans[-1][1] <= bucket
    assert [it.ranges for it in plan_items(pieces, params, bucket, reverse=True)[0][:3]] == [
        ((0, i * large // 3, (i + 1) * large // 3),) for i in (2, 1, 0)]  # backward mode: update order
    full = plan_items(pieces, params, 32)  # no room to pack: every range in place, none copied
    assert all(it.packed is None for per in full for it in per)


def test_broadcast_groups_are_first_used_in_the_same_order_on_every_rank(monkeypatch):
    """Issue #33, item 9: NCCL creates a group's communicator at its first collective, collectively; ranks that
    first meet the groups in different orders hang. ``ParamBroadcast`` alone first uses each rank's own group
    (rank 0: group 0, rank 1: group 1); the groups from ``broadcast_groups`` are each used once at setup, in
    index order, so every rank creates them in the same order. Recorded with ``dist`` calls replaced."""
    import torch.distributed as dist

    from lightning_nvme.strategies import param_broadcast
    from lightning_nvme.strategies.param_broadcast import ParamBroadcast, broadcast_groups, plan_items

    class Work:
        def wait(self) -> None:
            pass

    world = 2
    first_use: dict[int, list[int]] = {}

    def run(rank: int, warm: bool) -> list[int]:
        made: list[int] = []
        used: list[int] = []
        monkeypatch.setattr(dist, "new_group", lambda ranks: made.append(len(made)) or made[-1])

        def broadcast(t, src, group=None, async_op=False):
            if group not in used:
                used.append(group)
            return Work()

        monkeypatch.setattr(param_broadcast.dist, "broadcast", broadcast)
        groups = broadcast_groups(world, torch.device("cpu")) if warm else list(range(world))
        params = [torch.zeros(8), torch.zeros(8)]
        items = plan_items([[(0, 0, 8)], [(1, 0, 8)]], params, 1 << 20)
        pb = ParamBroadcast(params, items, rank, groups)
        pb.begin()
        pb.finished(params[rank:rank + 1])  # this rank's update is done: its sends go out first
        pb.finish()
        return used

    assert run(0, warm=False) != run(1, warm=False)  # the hazard: each rank meets its own group first
    for rank in range(world):
        first_use[rank] = run(rank, warm=True)
    assert first_use[0] == first_use[1] == [0, 1]


# ---- the worker side (run by Lightning in every rank) -----------------------------------------------------------
def _worker(spec_path: str) -> None:
    sys.path.insert(0, TESTS)
    spec = json.loads(open(spec_path).read())
    for run in spec["runs"]:
        _train(run, spec["world"])
    import torch.distributed as dist

    if dist.is_initialized():  # gloo's threads, left to interpreter exit, can abort it (SIGABRT, "terminate called")
        dist.destroy_process_group()


def _train(run: dict, world: int) -> None:
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from models import MLP, NoOptimizer, TwoOptimizers

    import lightning_nvme  # noqa: F401
    from lightning_nvme import NVMeOffloadDDPStrategy
    from lightning_nvme.optim import plan_chunks

    batch = run.get("global_batch", 16) // world
    if run.get("model") == "two_optimizers":
        model = TwoOptimizers()
    elif run.get("model") in ("no_optimizer", "manual_no_optimizer"):
        model = NoOptimizer(manual=run["model"] == "manual_no_optimizer", batch_size=batch)
    elif run.get("model") == "master_weights_reference":
        model = _MasterWeightsMLP(batch_size=batch)
    else:
        model = MLP(run.get("optimizer", "adamw"), batch_size=batch, ref_state_format=run.get("ref_state_format"),
                    ref_master_format=run.get("ref_master_format", "fp32"))
    if run["strategy"] == "ddp":
        strategy = DDPStrategy(find_unused_parameters=True, **run.get("ddp_kwargs", {}))
    else:
        strategy = NVMeOffloadDDPStrategy(store_dir=run["store"], chunk_bytes=run.get("chunk_bytes", 16 << 10),
                                          overlap=run.get("overlap", "step"), find_unused_parameters=True,
                                          state_format=run.get("state_format", "exact"),
                                          master_format=run.get("master_format", "fp32"),
                                          **run.get("ddp_kwargs", {}), **run.get("offload_kwargs", {}))
    norms: list[float] = []

    class Record(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    class SaveAndKill(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == run["save_epoch"]:
                for path in [run["save"], *run.get("save_also", [])]:
                    trainer.save_checkpoint(path)
                if run.get("kill"):
                    trainer.strategy.barrier()
                    os.kill(os.getpid(), signal.SIGKILL)

    shelf: dict = {}

    class Shelf(Callback):
        """What this rank kept in RAM while training ran (host_memory_budget; the store's close empties the shelf)."""

        def on_train_end(self, trainer, pl_module):
            s = trainer.strategy
            if getattr(s, "nvme_store", None) is not None and s.shelf_plan is not None:
                shelf.update(shelf_bytes=s.nvme_store.shelf.nbytes, placement=s.shelf_plan.as_dict(),
                             local_ranks=s.num_processes)

    callbacks = [Record(), Shelf()] + ([SaveAndKill()] if run.get("save") else [])
    if run.get("model_checkpoint"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=run["model_checkpoint"], every_n_train_steps=4, save_last=True))
    trainer = Trainer(default_root_dir=run["root"], strategy=strategy, accelerator="cpu", devices=world,
                      max_steps=run.get("steps", -1), max_epochs=run.get("epochs"),
                      accumulate_grad_batches=run.get("accumulate", 1), gradient_clip_val=run.get("clip"),
                      gradient_clip_algorithm=run.get("clip_algo", "norm"), precision=run.get("precision", "32-true"),
                      logger=False, enable_checkpointing=bool(run.get("model_checkpoint")), enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks)
    updated_in_backward = 0
    if run["strategy"] != "ddp" and run.get("overlap") == "backward":
        from lightning_nvme.optim.chunk_update import ChunkUpdater

        original = ChunkUpdater.update_chunk

        def counting(self, c, in_backward=False):
            nonlocal updated_in_backward
            updated_in_backward += bool(in_backward)
            return original(self, c, in_backward)

        ChunkUpdater.update_chunk = counting
    try:
        trainer.fit(model, ckpt_path=run.get("resume"))
    except Exception as e:  # noqa: BLE001  (a run that must be refused on every rank records its error)
        if not run.get("expect_error"):
            raise
        os.makedirs(os.path.dirname(run["out"]), exist_ok=True)
        torch.save({"error": f"{type(e).__name__}: {e}"}, f"{run['out']}.rank{trainer.global_rank}.pt")
        return
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "global_step": trainer.global_step,
           "grad_norms": norms, "updated_in_backward": updated_in_backward, **shelf}
    if run["strategy"] != "ddp":
        out["offloaded"] = len(trainer.strategy.offloaded)
        out["saves"] = [{"path": r.path, "reason": r.reason, "bytes_written": r.bytes_written,
                         "bytes_cloned": r.bytes_cloned, "files": r.files} for r in trainer.strategy.checkpoint_saves]
    if run["strategy"] != "ddp" and trainer.strategy.offloaded:
        off = trainer.strategy.offloaded[0]
        store = off.store
        out.update(state_bytes=off.state_bytes, chunk_bytes=run.get("chunk_bytes", 16 << 10), store_path=store.path,
                   store_regions=len(off.chunks),
                   store_regions_bytes=sum(off.capacity.values()),
                   single_process_state_bytes=sum(c.nbytes for c in plan_chunks(
                       off.optimizer, run.get("chunk_bytes", 16 << 10), "probe").chunks))
    if run.get("failing_save"):
        out.update(_save_failure(trainer, run["failing_save"]))
    if run.get("model_checkpoint"):
        d = run["model_checkpoint"]
        from ckpt_helpers import parts_dir

        out.update(checkpoints={n: sorted(os.listdir(parts_dir(os.path.join(d, n)))) for n in os.listdir(d)
                                if n.endswith(".ckpt")},
                   listing=sorted(os.listdir(d)),
                   leftovers=[n for n in os.listdir(d) + [e for n in os.listdir(d) if n.endswith(".optim")
                                                          for e in os.listdir(os.path.join(d, n))]
                              if ".tmp-" in n or n.endswith(".old")])
    os.makedirs(os.path.dirname(run["out"]), exist_ok=True)
    torch.save(out, f"{run['out']}.rank{trainer.global_rank}.pt")


def _save_failure(trainer, path: str) -> dict:
    """Save once, then save again with rank 1's shard writer failing: every rank must raise, and the
    first checkpoint must stay as it was."""
    from lightning_nvme.checkpoint import rank_shards

    trainer.save_checkpoint(path)
    before = _checkpoint_files(path)
    # Every rank has read the checkpoint before rank 0 begins the next save: begin() creates its temp directory
    # inside <path>.optim, which a rank still listing would count as a change (issue #20, seen under load).
    trainer.strategy.barrier("save_failure.before")
    original = rank_shards.SafetensorsWriter.write

    def failing(self, *args, **kwargs):
        raise OSError("disk went away mid-checkpoint")

    if trainer.global_rank == 1:
        rank_shards.SafetensorsWriter.write = failing
    error = ""
    try:
        trainer.save_checkpoint(path)
    except Exception as e:  # noqa: BLE001  (the test inspects the message)
        error = str(e)
    finally:
        rank_shards.SafetensorsWriter.write = original
    after = _checkpoint_files(path)
    parent = os.path.dirname(os.path.abspath(path))
    leftovers = [f for f in os.listdir(parent) + list(after) if ".tmp-" in f]
    return {"save_error": error, "unchanged": before == after, "leftovers": leftovers}


def _checkpoint_files(path: str) -> dict[str, bytes]:
    """A checkpoint's files (relative path -> contents): the file itself and everything in its .optim directory
    (a version-2 checkpoint's; a one-file checkpoint has none, its state is in the file)."""
    def read(file: str) -> bytes:
        with open(file, "rb") as f:
            return f.read()

    out = {os.path.basename(path): read(path)}
    for root, dirs, files in os.walk(path + ".optim"):
        out.update({os.path.relpath(os.path.join(root, d), os.path.dirname(path)): b"" for d in dirs})
        out.update({os.path.relpath(os.path.join(root, f), os.path.dirname(path)): read(os.path.join(root, f))
                    for f in files})
    return out


def _master_weights_reference_optimizer():
    class MasterWeightsAdamW(torch.optim.Optimizer):
        """Reference: fp32 master copies in memory, AdamW on them, cast back to the bf16 params."""

        def __init__(self, groups, **defaults):
            super().__init__(groups, defaults)
            self.masters = {p: p.detach().float().clone() for g in self.param_groups for p in g["params"]}
            self.inner = torch.optim.AdamW([{**{k: v for k, v in g.items() if k != "params"},
                                             "params": [self.masters[p] for p in g["params"]]}
                                            for g in self.param_groups])

        def step(self, closure=None):
            loss = closure() if closure is not None else None
            for g, inner in zip(self.param_groups, self.inner.param_groups):
                inner.update({k: v for k, v in g.items() if k != "params"})  # the LR scheduler's lr
                for p, m in zip(g["params"], inner["params"]):
                    m.grad = p.grad.float() if p.grad is not None else None
            self.inner.step()
            with torch.no_grad():
                for p, m in self.masters.items():
                    p.copy_(m)
            return loss

    return MasterWeightsAdamW


class _MasterWeightsMLPBase:
    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        opt = _master_weights_reference_optimizer()([{"params": decay}, {"params": no_decay, "lr": 5e-3,
                                                                            "weight_decay": 0.0}],
                                                     lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _MasterWeightsMLP(**kwargs):
    from models import MLP

    return type("MasterWeightsMLP", (_MasterWeightsMLPBase, MLP), {})(**kwargs)


if __name__ == "__main__":
    _worker(sys.argv[1])
