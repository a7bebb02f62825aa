"""LoRA through peft under ``offload_params``: ``HFCausalLM(lora_rank=..., lora_targets=...)`` built on the meta
device trains bitwise like the same peft model in memory (from the same adapter init), with and without
gradient checkpointing; the frozen base streams from the store and is never written back (bytes written per
step = the adapters' tails + their AdamW moments); ``export_weights(dir, layout="hf")`` writes the adapters in
peft's format, which ``PeftModel.from_pretrained(base, dir)`` loads to give the trained outputs."""

from __future__ import annotations

import pytest
import torch
from test_gpt_lora import StoreWrites
from test_hf_any_arch import data, make_checkpoint, offload, recipe_overrides, trainer

from lightning_nvme.models import HFCausalLM
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.store import align_up

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _lora(path, **kw) -> HFCausalLM:
    return HFCausalLM(path, block_size=16, lora_rank=4, lora_alpha=8, lora_targets=TARGETS, **kw)


def _offloaded(base, root, steps=8, callbacks=(), checkpointing=False, **settings):
    t = trainer(root, offload(root, **settings), steps=steps, callbacks=callbacks)
    with t.init_module(empty_init=True):
        model = _lora(base, activation_checkpointing=checkpointing)
    adapters = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    t.fit(model, data())
    return t, model, adapters


def _reference(base, root, adapters, steps=8, checkpointing=False) -> HFCausalLM:
    """The same peft model in memory (from_pretrained + get_peft_model), from the same adapter values."""
    ref = _lora(base, backend="transformers", activation_checkpointing=checkpointing)
    missing, unexpected = ref.load_state_dict(adapters, strict=False)
    assert not unexpected
    trainer(root, "auto", steps=steps).fit(ref, data())
    return ref


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad_ckpt"])
def test_peft_lora_streamed_trains_bitwise_and_writes_only_adapters(base, tmp_path, checkpointing):
    watch = StoreWrites()
    # the base copied into the store (frozen_weights="store"): its frozen head is read, never written back
    t, model, adapters = _offloaded(base, tmp_path / "off", callbacks=[watch], checkpointing=checkpointing,
                                    frozen_weights="store")
    assert adapters and all(".lora_A.default." in n or ".lora_B.default." in n for n in adapters)
    assert all(torch.count_nonzero(v) == 0 for n, v in adapters.items() if "lora_B" in n)  # peft's init: B = 0
    ref = _reference(base, tmp_path / "ref", adapters, checkpointing=checkpointing)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    assert any(torch.count_nonzero(p) for n, p in model.named_parameters() if "lora_B" in n)  # trained

    # The frozen base is the checkpoint's, never written: every block write lies in its adapters' tail.
    plain = transformers.AutoModelForCausalLM.from_pretrained(base)
    merged = model.model.get_base_model().state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(merged[name.replace("proj.weight", "proj.base_layer.weight")
                                  if any(name.endswith(f"{t}.weight") for t in TARGETS) else name], value), name
    blocks: dict[str, BlockLayout] = {b.region: b for b in t.strategy.param_offload.blocks}
    assert len(blocks) == 3 and all(b.writable_offset > 0 for b in blocks.values())
    block_writes = [(r, off) for _, r, off, _ in watch.writes if r in blocks]
    assert len(block_writes) >= 8 * len(blocks)
    assert all(off >= blocks[r].writable_offset for r, off in block_writes), block_writes
    adapter_bytes = sum(s.nbytes for b in blocks.values() for s in b.slots if s.trainable)
    frozen_bytes = sum(s.nbytes for b in blocks.values() for s in b.slots if not s.trainable)
    pages = 4096 * 2 * len(t.strategy.offloaded[0].chunks)  # alignment of each chunk's two moments
    bound = sum(align_up(b.nbytes - b.writable_offset) for b in blocks.values()) + 2 * adapter_bytes + pages
    assert 0 < max(watch.bytes_per_step) <= bound, (watch.bytes_per_step, bound)
    assert min(watch.bytes_per_step) >= 3 * adapter_bytes  # adapters + both moments, every step
    assert bound < frozen_bytes


def test_adapters_exported_in_peft_format_load_with_peft(base, tmp_path):
    t, model, adapters = _offloaded(base, tmp_path / "off", restore_params=False)  # weights stay in the store
    out = tmp_path / "adapters"
    t.strategy.export_weights(str(out), layout="hf")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    ref = _reference(base, tmp_path / "ref", adapters)
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), str(out))
    loaded.eval()
    ref.model.eval()
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, ref.model(input_ids=x).logits)
    for name, p in ref.model.named_parameters():
        if "lora_" in name:
            assert torch.equal(loaded.state_dict()[name], p), name


def test_recipe_lora_takes_any_architecture(tmp_path):
    """``recipe=lora`` with a Llama checkpoint: peft adapters (the architecture's default targets), the base
    streamed from the store, only the adapters train."""
    from lightning_nvme.launch import compose_config, train

    path = make_checkpoint(tmp_path / "ckpt", "llama", vocab=256)
    run = train(compose_config("lora", [*recipe_overrides(path, tmp_path / "run"), "model.lora_rank=2"]))
    assert run.trainer.global_step == 3 and run.trainer.strategy.param_offload is not None
    trainable = [n for n, p in run.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}  # peft's default for Llama


def test_merged_export_equals_peft_merge_and_unload(base, tmp_path):
    """``export_weights(dir, layout="hf", merge_adapters=True)``: the base with the trained adapters merged, read by
    ``from_pretrained``, equals peft's ``merge_and_unload()`` of the same model trained in memory, bitwise."""
    t, model, adapters = _offloaded(base, tmp_path / "off", restore_params=False)
    out = tmp_path / "merged"
    t.strategy.export_weights(str(out), layout="hf", merge_adapters=True)
    ref = _reference(base, tmp_path / "ref", adapters).model.merge_and_unload()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.state_dict().keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    plain = transformers.AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(loaded.model.layers[0].self_attn.q_proj.weight, plain.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("merge", [False, True], ids=["adapters", "merged"])
def test_cli_export_of_a_lora_checkpoint(base, tmp_path, merge):
    from lightning_nvme.cli import main

    t, model, adapters = _offloaded(base, tmp_path / "off", restore_params=False, inline_weights_bytes=0)
    t.save_checkpoint(tmp_path / "last.ckpt")
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "last.ckpt"), str(out), *(["--merge-adapters"] if merge else [])]) == 0
    ref = _reference(base, tmp_path / "ref", adapters).model
    if merge:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
        expected = ref.merge_and_unload().state_dict()
    else:
        loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), str(out))
        expected = ref.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_same_seed_gives_the_same_adapters_in_memory_and_offloaded(base, tmp_path):
    """``seed_everything`` then the same ``HFCausalLM(lora_rank=...)``: built plainly, under the default strategy's
    ``init_module(empty_init=True)`` (``nn.init`` skipped) and on the meta device under ``offload_params``, the
    initial adapters are bitwise peft's in-memory ones (same random stream), and so are the trained ones."""
    from lightning import seed_everything

    def adapters(m: HFCausalLM) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in m.named_parameters() if v.requires_grad}

    seed_everything(7)
    plain = adapters(_lora(base, backend="transformers"))
    seed_everything(7)
    t_ref = trainer(tmp_path / "ref", "auto")
    with t_ref.init_module(empty_init=True):
        ref = _lora(base, backend="transformers")
    seed_everything(7)
    t_off = trainer(tmp_path / "off", offload(tmp_path / "off"))
    with t_off.init_module(empty_init=True):
        off = _lora(base)
    assert plain and any(torch.count_nonzero(v) for k, v in plain.items() if "lora_A" in k)
    for name, value in plain.items():
        assert torch.equal(adapters(ref)[name], value), name
        assert torch.equal(adapters(off)[name], value), name

    t_ref.fit(ref, data())
    t_off.fit(off, data())
    trained = adapters(off)
    for name, value in adapters(ref).items():
        assert not torch.equal(value, plain[name]) or "lora_B" not in name
        assert torch.equal(trained[name], value), name
