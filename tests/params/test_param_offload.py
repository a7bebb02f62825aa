"""offload_params=True: bitwise equality with in-memory training (fp32 AdamW / SGD-momentum, bf16-true
with fp32 masters, bf16-true with int8 state + bf16_sr through the one-pass update, activation checkpointing,
activation offload, tied embeddings, frozen base + adapters, save -> resume in a new process), blocks resident
only while needed, true weights in checkpoints and state_dict, and the settings that are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _param_offload_model import TinyGPT, tokens
from lightning.pytorch import Callback, Trainer

import lightning_nvme  # noqa: F401  (registers the strategies)
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.checkpoint import weights
from lightning_nvme.params import is_placeholder
from lightning_nvme.params.offload import chunks_per_block

STEPS = 32  # two epochs of 16 batches


def trainer(root, strategy, steps=STEPS, callbacks=(), **kwargs):
    return Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", devices=1, max_steps=steps,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=list(callbacks), **kwargs)


def offload(tmp_path, **kwargs):
    kwargs.setdefault("overlap", "backward")
    kwargs.setdefault("chunk_bytes", 64 << 10)
    return NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), offload_params=True, **kwargs)


def fit(root, strategy, model_kwargs=None, callbacks=(), **trainer_kwargs):
    model = TinyGPT(**(model_kwargs or {}))
    t = trainer(root, strategy, callbacks=callbacks, **trainer_kwargs)
    t.fit(model)
    return model, t


class Snapshots(Callback):
    """Parameters after given steps (what a checkpoint saved there must hold)."""

    def __init__(self, steps=(5, 16)) -> None:
        self.steps, self.taken = steps, {}

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step in self.steps and trainer.global_step not in self.taken:
            self.taken[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


_REFERENCES: dict = {}


def reference(tmp_path_factory, optimizer="adamw", accumulate=1, **model_kwargs):
    """In-memory Lightning training (default strategy), run once per configuration for this module."""
    key = (optimizer, accumulate, tuple(sorted(model_kwargs.items())))
    if key not in _REFERENCES:
        snaps = Snapshots()
        model, _ = fit(tmp_path_factory.mktemp("ref"), "auto", {"optimizer": optimizer, **model_kwargs}, [snaps],
                       accumulate_grad_batches=accumulate)
        _REFERENCES[key] = (model, snaps.taken)
    return _REFERENCES[key]


def assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert not is_placeholder(p), f"{name} is still a placeholder after fit"
        assert torch.equal(p, q), f"parameter {name} differs"


class BlocksBetweenSteps(Callback):
    """Between steps every block parameter is a placeholder; records the peak of resident blocks."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, *args):
        offload = trainer.strategy.param_offload
        assert offload.residency.resident_blocks == []
        for block in offload.blocks:
            for slot in block.slots:
                assert is_placeholder(slot.param), slot.name
        self.checked += 1


@pytest.mark.parametrize("optimizer, accumulate", [("adamw", 1), ("sgd", 2)])
def test_bitwise_equal_to_in_memory(tmp_path, tmp_path_factory, optimizer, accumulate):
    overlap = "backward"
    ref, _ = reference(tmp_path_factory, optimizer, accumulate)
    watch = BlocksBetweenSteps()
    strategy = offload(tmp_path, overlap=overlap)
    off, t = fit(tmp_path / "off", strategy, {"optimizer": optimizer}, [watch], accumulate_grad_batches=accumulate)
    assert t.global_step == STEPS and watch.checked == STEPS * accumulate
    assert_same_params(ref, off)
    stats = strategy.param_offload.stats
    blocks = len(strategy.param_offload.blocks)
    assert blocks == 4
    # Memory: a block is resident only around its use: at most param_prefetch + 2 at once (one in use, one
    # read ahead, one waiting for its update/write-back), whatever the number of blocks.
    assert stats.peak_resident_blocks <= 1 + 2
    assert stats.writebacks >= STEPS * blocks  # every block updated and written back each step
    # tied embeddings (wte / lm_head) and the other shared or outside parameters stay in memory
    outside = {name for name, _ in strategy.param_offload.layout.outside_blocks}
    assert "model.transformer.wte.weight" in outside
    assert off.model.lm_head.weight is off.model.transformer.wte.weight


@pytest.mark.parametrize("overlap", ["backward", "step"])
def test_parameter_groups_across_blocks_keep_the_block_bound(tmp_path, tmp_path_factory, overlap):
    """Hugging Face's two groups (decay for matrices, none for biases and norms): each group lists every block's
    parameters, so a chunk packed in optimizer order held state of several blocks, and every block waited in
    memory for the one chunk of biases to be updated after the last backward (all 4 here; on a GPU, all on the
    device). Chunks are cut at block boundaries now: bitwise the same training, at most param_prefetch + 2
    blocks at once, and no chunk holds state of two blocks."""
    ref, _ = reference(tmp_path_factory, "adamw_groups")
    strategy = offload(tmp_path, overlap=overlap)
    off, _ = fit(tmp_path / "off", strategy, {"optimizer": "adamw_groups"})
    assert_same_params(ref, off)
    assert strategy.param_offload.stats.peak_resident_blocks <= 1 + 2
    block_of = strategy.param_offload.layout.block_of()
    chunks = [c for o in strategy.offloaded for c in o.chunk_plan.chunks]
    assert chunks and all(len({block_of[id(piece.param)].index if id(piece.param) in block_of else -1
                                for piece in c.pieces}) == 1 for c in chunks)


def test_overlap_step_loads_each_block_for_its_update(tmp_path, tmp_path_factory):
    """overlap='step': the chunks are updated after backward, each block read back for its update."""
    _, snapshots = reference(tmp_path_factory)
    off, _ = fit(tmp_path / "off", offload(tmp_path, overlap="step"), steps=5)
    for name, p in off.state_dict().items():
        assert torch.equal(snapshots[5][name], p), name


def test_bf16_true_matches_fp32_master_reference(tmp_path):
    """bf16 params in the store, fp32 masters + moments in the optimizer store: equal to an in-memory loop
    that keeps fp32 masters, steps AdamW on them and casts back."""
    from lightning.pytorch.plugins.precision import HalfPrecision
    from models import fp32_master_step

    strategy = offload(tmp_path)
    off, _ = fit(tmp_path / "off", strategy, precision="bf16-true")

    ref = TinyGPT().bfloat16()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    masters = {p: p.detach().float().clone() for p in trainable}
    opt = torch.optim.AdamW([masters[p] for p in trainable], lr=1e-2, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(tokens(), batch_size=4, shuffle=False)
    context = HalfPrecision("bf16-true").forward_context  # what Lightning runs training_step under
    batches = [batch for _ in range(STEPS // len(loader) + 1) for batch in loader]  # epochs, as Lightning runs
    for batch in batches[:STEPS]:
        with context():
            loss = ref.training_step(batch, 0)
        loss.backward()
        fp32_master_step(trainable, masters, opt)
    for (name, p), q in zip(off.named_parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, q), f"parameter {name} differs"


@pytest.mark.parametrize("overlap", ["backward", "step"])
def test_compressed_state_with_the_one_pass_update_equals_its_in_memory_reference(tmp_path, overlap):
    """The 7 B benchmark's settings at small scale (bf16-true, AdamW(fused=True), int8 state, bf16_sr, with
    activation checkpointing): equal to the default strategy with ``RoundTripOptimizer``; the kernel ran."""
    kw = dict(precision="bf16-true", steps=8)
    ref, _ = fit(tmp_path / "ref", "auto", {"optimizer": "adamw_fused", "ref_format": ("int8", "bf16_sr"),
                                            "checkpointing": True}, **kw)
    strategy = offload(tmp_path, overlap=overlap, state_format="int8", master_format="bf16_sr")
    off, t = fit(tmp_path / "off", strategy, {"optimizer": "adamw_fused", "checkpointing": True},
                 [BlocksBetweenSteps()], **kw)
    assert_same_params(ref, off)
    assert t.strategy.offloaded[0].fused_elements > 0


def test_activation_checkpointing(tmp_path, tmp_path_factory):
    """Recomputation in backward runs the block's forward again: it must see the resident block."""
    ref, _ = reference(tmp_path_factory, checkpointing=True)
    off, _ = fit(tmp_path / "off", offload(tmp_path), {"checkpointing": True}, [BlocksBetweenSteps()])
    assert_same_params(ref, off)


def test_with_activation_offload(tmp_path, tmp_path_factory):
    from lightning_nvme.callbacks import NVMeActivationOffload

    ref, _ = reference(tmp_path_factory, checkpointing=True)
    act = NVMeActivationOffload(min_bytes=0)
    off, _ = fit(tmp_path / "off", offload(tmp_path), {"checkpointing": True}, [act, BlocksBetweenSteps()])
    assert act.total_stats.offloaded_tensors > 0
    assert_same_params(ref, off)


def test_frozen_base_with_adapters(tmp_path, tmp_path_factory):
    """LoRA-like: the frozen base weights are read, never written back; only adapters train."""
    ref, _ = reference(tmp_path_factory, lora=True)
    strategy = offload(tmp_path)
    off, _ = fit(tmp_path / "off", strategy, {"lora": True}, [BlocksBetweenSteps()])
    assert_same_params(ref, off)
    layout = strategy.param_offload.layout
    frozen = sum(s.nbytes for b in layout.blocks for s in b.slots if not s.trainable)
    trainable = sum(s.nbytes for b in layout.blocks for s in b.slots if s.trainable)
    assert frozen > 4 * trainable
    # Write-backs cover the adapters' page-aligned tail only (the first placement wrote everything once).
    first_placement = sum(b.nbytes for b in layout.blocks)
    per_step = max(b.nbytes - b.writable_offset for b in layout.blocks) * len(layout.blocks)
    assert strategy.param_offload.stats.bytes_written <= first_placement + STEPS * (per_step + 4096 * len(layout.blocks))


@pytest.mark.parametrize("overlap", ["backward", "step"])
def test_frozen_weights_leave_memory_while_adapters_wait_for_their_update(tmp_path, tmp_path_factory, monkeypatch,
                                                                          overlap):
    """One optimizer chunk holds the adapters of all 8 blocks, so it is updated once, after the last block's
    backward. The frozen weights of a block must still leave memory after its use, as a trainable block's do:
    measured at every residency acquire/release, the frozen bytes bound in memory never exceed two blocks' (one
    in use, one handing over), where holding every block for the update kept all 8; updates read the trainable
    tails alone. Bitwise equal to in-memory training."""
    from lightning_nvme.params import residency

    peak = {"frozen": 0, "events": 0}
    blocks: list = []

    def frozen_bound() -> int:
        return sum(s.nbytes for b in blocks for s in b.slots if not s.trainable and not is_placeholder(s.param))

    def measured(method):
        def wrapper(self, block, *args, **kwargs):
            if not blocks:
                blocks.extend(self.blocks)
            out = method(self, block, *args, **kwargs)
            peak["frozen"] = max(peak["frozen"], frozen_bound())
            peak["events"] += 1
            return out
        return wrapper

    for name in ("acquire", "release"):
        monkeypatch.setattr(residency.BlockResidency, name, measured(getattr(residency.BlockResidency, name)))
    ref, _ = reference(tmp_path_factory, lora=True, n_layer=8)
    strategy = offload(tmp_path, overlap=overlap, chunk_bytes=1 << 20)
    off, _ = fit(tmp_path / "off", strategy, {"lora": True, "n_layer": 8}, [BlocksBetweenSteps()])
    assert_same_params(ref, off)
    assert len(strategy.offloaded[0].chunks) == 1  # every block's adapters in one chunk: the case that held them all
    layout = strategy.param_offload.layout
    frozen_per_block = max(sum(s.nbytes for s in b.slots if not s.trainable) for b in layout.blocks)
    assert len(layout.blocks) == 8 and frozen_per_block > 4 * max(b.nbytes - b.writable_offset for b in layout.blocks)
    assert peak["events"] > STEPS * 8 * 2
    assert 0 < peak["frozen"] <= 2 * frozen_per_block, (peak, frozen_per_block)
    stats = strategy.param_offload.stats
    assert stats.peak_resident_bytes <= 3 * max(b.nbytes for b in layout.blocks) + 8 * 4096
    assert stats.tail_loads >= STEPS * 7  # each update read its adapters only (block 0 may still be in its backward)

@pytest.mark.parametrize("offload_params", [False, True], ids=["state-offload", "params-offload"])
def test_gradients_are_consumed_in_backward(tmp_path, offload_params):
    """overlap='backward': a gradient lives only until its chunk is updated. At every gradient hook the live
    ``.grad`` tensors belong to chunks still waiting for a gradient, never to an updated chunk; and the
    chunks holding live gradients never exceed the chunks in flight (the ring: prefetch_depth + 2), however
    many chunks the model has: gradient memory is bounded by the chunks in flight, not the model size."""
    seen = {"max_live": 0, "checks": 0, "max_chunks": 0, "chunks": 0, "in_flight": 0}

    class Watch(Callback):
        def on_train_start(self, trainer, pl_module):
            off = trainer.strategy.offloaded[0]
            chunk_params = [{id(p.param) for p in c.pieces} for c in off.chunks]
            seen["chunks"] = len(chunk_params)
            seen["in_flight"] = trainer.strategy.config.prefetch_depth + 2
            params = [p for p in pl_module.parameters() if p.requires_grad]
            fired: set[int] = set()

            def hook(p):
                fired.add(id(p))
                if len(fired) == len(params):
                    fired.clear()  # last gradient of this backward
                open_chunks = [c for c in chunk_params if not c <= fired]
                allowed = set().union(*open_chunks) if open_chunks else set()
                live = [q for q in params if q.grad is not None]
                assert all(id(q) in allowed or id(q) == id(p) for q in live)
                live_ids = {id(q) for q in live}
                holding = sum(1 for c in chunk_params if c & live_ids)
                seen["max_live"] = max(seen["max_live"], len(live))
                seen["max_chunks"] = max(seen["max_chunks"], holding)
                seen["checks"] += 1

            for p in params:  # registered after the optimizer's hooks: they run after each update
                p.register_post_accumulate_grad_hook(hook)

    strategy = NVMeOffloadStrategy(store_dir=str(tmp_path / "store"), chunk_bytes=16 << 10, overlap="backward",
                                   offload_params=offload_params)
    model = TinyGPT()
    trainer(tmp_path, strategy, steps=3, callbacks=[Watch()]).fit(model)
    trainable = sum(p.requires_grad for p in model.parameters())
    assert seen["checks"] >= 3 * trainable
    assert seen["max_live"] <= trainable // 4, seen
    assert seen["chunks"] >= 3 * seen["in_flight"], seen  # a model of many chunks: the bound is not trivial
    assert seen["max_chunks"] <= seen["in_flight"], seen


def resumed_in_memory(tmp_path) -> TinyGPT:
    """In-memory Lightning saving after the first epoch and resuming from that checkpoint to STEPS: what a resume of
    an offloaded checkpoint of that instant must reproduce bit for bit."""
    ref_trainer = trainer(tmp_path / "ref", "auto", steps=-1, max_epochs=1)
    ref_trainer.fit(TinyGPT())
    ref_trainer.save_checkpoint(tmp_path / "ref.ckpt")
    ref = TinyGPT()
    trainer(tmp_path / "ref2", "auto").fit(ref, ckpt_path=str(tmp_path / "ref.ckpt"))
    return ref


@pytest.mark.parametrize("beside", [False, True], ids=["inline", "beside"])
def test_checkpoint_holds_true_weights_and_resumes_in_a_new_process(tmp_path, tmp_path_factory, beside):
    """save after the first epoch (16 steps; the weights gathered from the store, not placeholders — or, with
    ``beside``, streamed from the store into ``<file>.optim/<id>/weights.safetensors``, saved after fit with the
    weights still in the store), resume in a new process to step 32 (streaming them back into the store):
    bitwise equal to in-memory Lightning doing the same save and resume."""
    _, snapshots = reference(tmp_path_factory)
    ref = resumed_in_memory(tmp_path)

    ckpt = tmp_path / "epoch1.ckpt"
    extra = {"restore_params": False, "inline_weights_bytes": 0} if beside else {}
    t = trainer(tmp_path / "b", offload(tmp_path / "b", **extra), steps=-1, max_epochs=1)
    t.fit(TinyGPT())
    t.save_checkpoint(ckpt)
    with weights.deferred():
        refs = weights.refs(torch.load(ckpt, weights_only=False)["state_dict"])
    blocks = {n for b in t.strategy.param_offload.blocks for n in (s.name for s in b.slots)}
    assert set(refs) == (blocks if beside else set())  # exactly the block weights are beside the file
    saved = torch.load(ckpt, weights_only=True)["state_dict"]  # the checkpoint file Lightning's loaders open
    for name, p in snapshots[16].items():
        assert torch.equal(saved[name], p), name
    script = f"""
import sys, json, torch
sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r}]
from test_param_offload import offload, trainer
from _param_offload_model import TinyGPT
from pathlib import Path
model = TinyGPT()
t = trainer({str(tmp_path / 'c')!r}, offload(Path({str(tmp_path / 'c')!r})))
t.fit(model, ckpt_path={str(ckpt)!r})
torch.save(dict(model.named_parameters()), {str(tmp_path / 'resumed.pt')!r})
print(json.dumps({{"step": t.global_step}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["step"] == STEPS
    resumed = torch.load(tmp_path / "resumed.pt")
    for name, p in ref.named_parameters():
        assert torch.equal(resumed[name], p), name


def test_state_dict_during_fit_is_true_weights(tmp_path, tmp_path_factory):
    """``state_dict()`` mid-fit (what a checkpoint or a user reads) gathers the blocks from the store."""
    _, snapshots = reference(tmp_path_factory)
    grab = Snapshots(steps=(5,))
    fit(tmp_path / "off", offload(tmp_path), callbacks=[grab], steps=5)
    assert grab.taken[5].keys() == snapshots[5].keys()
    for name, p in snapshots[5].items():
        assert torch.equal(grab.taken[5][name], p), name


def test_keep_params_in_store_after_fit_refuses_silent_placeholders(tmp_path):
    model, _ = fit(tmp_path, offload(tmp_path, restore_params=False), steps=2)
    assert is_placeholder(model.model.transformer.h[0].mlp.c_fc.weight)
    with pytest.raises(RuntimeError, match="restore_params"):
        model.state_dict()


def test_refusals(tmp_path):
    class GradNorm(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass

    with pytest.raises(ValueError, match="GradNorm.on_before_optimizer_step"):
        fit(tmp_path / "a", offload(tmp_path / "a"), callbacks=[GradNorm()], steps=1)
    with pytest.raises(ValueError, match="param_block_classes"):
        fit(tmp_path / "b", offload(tmp_path / "b", param_block_classes=["torch.nn.Conv3d"]), steps=1)
    with pytest.raises(ValueError, match="param_prefetch"):
        NVMeOffloadStrategy(offload_params=True, param_prefetch=-1)
    from lightning_nvme import NVMeOffloadDDPStrategy

    with pytest.raises(ValueError, match="offload_params"):
        NVMeOffloadDDPStrategy(offload_params=True)
    # plain SGD keeps no state: its params would be stepped in memory while their values live in the store
    with pytest.raises(ValueError, match="needs per-parameter optimizer state"):
        fit(tmp_path / "c", offload(tmp_path / "c"), model_kwargs={"optimizer": "sgd_plain"}, steps=1)


def test_params_made_trainable_mid_run_are_refused(tmp_path):
    """The blocks written back are fixed at setup: a parameter unfrozen mid-run is refused, never left stale."""
    from lightning_nvme.optim import UnsupportedOptimizerError

    class Unfreeze(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                frozen = [p for p in pl_module.parameters() if not p.requires_grad]
                for p in frozen:
                    p.requires_grad_(True)
                trainer.optimizers[0].add_param_group({"params": frozen})

    with pytest.raises(UnsupportedOptimizerError, match="offload_params=True"):
        fit(tmp_path, offload(tmp_path), model_kwargs={"lora": True}, callbacks=[Unfreeze()], steps=3)


def test_block_classes_by_dotted_path(tmp_path, tmp_path_factory):
    _, snapshots = reference(tmp_path_factory)
    strategy = offload(tmp_path, param_block_classes=["lightning_nvme.models.gpt.MLP"])
    off, _ = fit(tmp_path / "off", strategy, steps=5)
    assert [b.name for b in strategy.param_offload.blocks] == [f"model.transformer.h.{i}.mlp" for i in range(4)]
    for name, p in off.state_dict().items():
        assert torch.equal(snapshots[5][name], p), name


def _in_memory_from_meta(seed: int, **kwargs) -> TinyGPT:
    """The reference for meta-device construction: Lightning's own materialization (module order,
    ``reset_parameters``), done in memory, with tensors swapped in place so the wte/lm_head tie holds."""
    from lightning.fabric.utilities.init import _materialize_meta_tensors

    with torch.device("meta"):
        model = TinyGPT(**kwargs)
    torch.manual_seed(seed)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        _materialize_meta_tensors(model, "cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    return model


@pytest.mark.parametrize("how", ["init_module", "configure_model"])
def test_model_built_on_meta_goes_block_by_block_into_the_store(tmp_path, monkeypatch, how):
    """``trainer.init_module(empty_init=True)`` / ``configure_model``: parameters are created on the meta
    device and initialized at setup one module at a time, each block written to the store as soon as it is
    complete (never two blocks in memory); training from there equals in-memory training from the same init."""
    from lightning_nvme.params.residency import BlockResidency

    steps = STEPS if how == "init_module" else 5
    ref = _in_memory_from_meta(3)
    trainer(tmp_path / "ref", "auto", steps=steps).fit(ref)

    in_memory_blocks = []
    place = BlockResidency.place

    def watch(self, block):
        in_memory_blocks.append(sum(any(not s.param.is_meta and not is_placeholder(s.param) for s in b.slots)
                                    for b in self.blocks))
        place(self, block)

    monkeypatch.setattr(BlockResidency, "place", watch)
    strategy = offload(tmp_path)
    t = trainer(tmp_path / "off", strategy, steps=steps)
    if how == "init_module":
        with t.init_module(empty_init=True):
            model = TinyGPT(init_seed=3)
        assert all(p.is_meta for p in model.parameters())
    else:
        model = TinyGPT(init_seed=3, in_configure_model=True)
    t.fit(model)
    assert len(in_memory_blocks) == 4 and max(in_memory_blocks) == 1
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    assert_same_params(ref, model)


@pytest.mark.parametrize("where", ["module", "submodule"])
def test_torch_compile_is_refused_by_name(tmp_path, where):
    """Issue #33, item 10: a compiled module (``trainer.fit(torch.compile(model))``, or a compiled submodule) with
    offloaded parameters is refused at setup naming torch.compile: each load re-points the parameters (a compiled
    graph recompiles, a CUDA graph would replay freed addresses). Refused before anything is placed."""
    from lightning_nvme.checks import ConfigError
    from lightning_nvme.optim.plan import is_placeholder

    model = TinyGPT()
    if where == "submodule":
        model.model.transformer.h[0] = torch.compile(model.model.transformer.h[0])
    target = torch.compile(model) if where == "module" else model
    with pytest.raises(ConfigError, match="offload_params.*torch.compile"):
        trainer(tmp_path, offload(tmp_path)).fit(target)
    assert not any(is_placeholder(p) for p in model.parameters())


@pytest.mark.parametrize("overlap", ["backward", "step"])
def test_backward_updates_read_one_blocks_chunks_ahead(tmp_path, overlap):
    """With ``overlap="backward"`` the optimizer reads ahead at least the chunks of one block's state (they are read
    while the block after it computes); ``"step"`` keeps ``prefetch_depth``. CPU block buffers come from the pool."""
    strategy = offload(tmp_path, overlap=overlap, chunk_bytes=16 << 10)
    fit(tmp_path, strategy, steps=2)
    off, params = strategy.offloaded[0], strategy.param_offload
    block_of = params.layout.block_of()
    per_block: dict = {}
    for chunk in off.chunks:
        for piece in chunk.pieces:
            if id(piece.param) in block_of:
                per_block.setdefault(block_of[id(piece.param)].index, set()).add(chunk.index)
    most = max(len(c) for c in per_block.values())
    assert chunks_per_block(params.layout, off.chunks) == most > strategy.config.prefetch_depth
    assert off.reads.depth == (most if overlap == "backward" else strategy.config.prefetch_depth)
    stats = params.stats
    assert 0 < stats.transfer.pool_buffers <= strategy.config.param_prefetch + 2 + strategy.config.param_prefetch + 1
    assert stats.loads > stats.transfer.pool_buffers  # block reads reused pooled buffers
