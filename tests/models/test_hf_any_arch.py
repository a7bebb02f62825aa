"""Any Hugging Face causal LM streamed into the parameter store (``build_causal_lm`` + ``HubWeights``): for
architectures of different layouts (Llama: untied head + GQA; Qwen2: tied head + attention biases, sharded;
Gemma: scaled embedding, bf16 checkpoint; GPT-NeoX: parallel residual + biases; Mistral: sliding-window
attention shorter than the sequence; Phi-3: fused qkv and gate/up projections, stored fused; Phi: biases,
LayerNorm, partial rotary, parallel attention and MLP), 8 AdamW steps with
``offload_params=True`` from a meta-device build are bitwise equal to ``from_pretrained`` trained in memory by
Lightning's default strategy, with and without transformers' gradient checkpointing; resume in a new process
is bitwise; a missing/extra/mis-shaped tensor is refused by name; the meta build never holds two blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

import lightning_nvme  # noqa: F401  (registers the strategies)
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.models import HFCausalLM
from lightning_nvme.models.hf import HubWeights, build_causal_lm
from lightning_nvme.params import is_placeholder

transformers = pytest.importorskip("transformers")

STEPS = 8
VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=64)
ARCHS = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False), torch.float32, None),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True), torch.float32, "6KB"),
    "gemma": ("GemmaConfig", dict(num_key_value_heads=1, head_dim=8), torch.bfloat16, None),
    "gpt_neox": ("GPTNeoXConfig", dict(use_parallel_residual=True, tie_word_embeddings=False), torch.float32, None),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False),
                torch.float32, None),
    # Phi-3 keeps q/k/v (and gate/up) fused in one tensor, in the module and in its checkpoint alike
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
             torch.float32, None),
    # Phi(-2): biases everywhere, LayerNorm, partial rotary, attention and MLP in parallel off one norm
    "phi": ("PhiConfig", dict(num_key_value_heads=2, partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2),
            torch.float32, None),
}


def make_checkpoint(directory, arch: str, vocab: int = VOCAB) -> str:
    """A tiny random ``arch`` model saved with ``save_pretrained`` (no download)."""
    config_cls, extra, dtype, shard = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**SMALL, "vocab_size": vocab}, **extra)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # biases are initialized to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {a: make_checkpoint(tmp_path_factory.mktemp(a), a) for a in ARCHS}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (32, 17), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)


def trainer(root, strategy, steps: int = STEPS, callbacks=()) -> Trainer:
    return Trainer(default_root_dir=str(root), strategy=strategy, accelerator="cpu", devices=1, max_steps=steps,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=list(callbacks))


def offload(root, **settings) -> NVMeOffloadStrategy:
    return NVMeOffloadStrategy(store_dir=str(root / "store"), chunk_bytes=64 << 10, offload_params=True,
                               overlap="backward", **settings)


def train_with_fp32_masters(module: HFCausalLM) -> None:
    """In memory, what Lightning's loop does with the module's AdamW, stepping fp32 copies of the parameters."""
    from models import fp32_master_step

    trainable = [p for p in module.parameters() if p.requires_grad]
    masters = {p: p.detach().float().clone() for p in trainable}
    opt = module.optimizer_factory([masters[p] for p in trainable])
    for batch in list(data())[:STEPS]:
        module._loss(batch, module.train_ppl).backward()
        fp32_master_step(trainable, masters, opt)


class InitialValues(Callback):
    def on_train_start(self, trainer, pl_module):
        self.values = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def test_sharded_fixture_is_sharded(checkpoints):
    assert os.path.exists(os.path.join(checkpoints["qwen2"], "model.safetensors.index.json"))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad_ckpt"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_streamed_any_architecture_trains_bitwise(arch, checkpointing, checkpoints, tmp_path, monkeypatch):
    from lightning_nvme.params.residency import BlockResidency

    path = checkpoints[arch]
    ref = HFCausalLM(path, block_size=16, backend="transformers", activation_checkpointing=checkpointing)
    ref_start = InitialValues()
    if ARCHS[arch][2] == torch.float32:
        trainer(tmp_path / "ref", "auto", callbacks=[ref_start]).fit(ref, data())
    else:  # half-precision parameters: the strategy keeps fp32 masters (master_format="fp32"); so does the reference
        ref_start.values = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        train_with_fp32_masters(ref)

    in_memory_blocks: list[int] = []
    in_memory_bytes: list[int] = []
    place = BlockResidency.place

    def watch(self, block):
        held = [s for b in self.blocks for s in b.slots if not s.param.is_meta and not is_placeholder(s.param)]
        in_memory_bytes.append(sum(s.param.numel() * s.param.element_size() for s in held))
        in_memory_blocks.append(sum(any(not s.param.is_meta and not is_placeholder(s.param) for s in b.slots)
                                    for b in self.blocks))
        place(self, block)

    monkeypatch.setattr(BlockResidency, "place", watch)
    start = InitialValues()
    t = trainer(tmp_path / "off", offload(tmp_path), callbacks=[start])
    with t.init_module(empty_init=True):
        model = HFCausalLM(path, block_size=16, backend="auto", activation_checkpointing=checkpointing)
    assert model.backend == "transformers" and all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # rotary inv_freq etc. recomputed at build time
    t.fit(model, data())

    blocks = t.strategy.param_offload.blocks
    layer_cls = next(iter(model.param_block_classes()))
    assert len(blocks) == 3 and all(type(b.module) is layer_cls for b in blocks)
    assert len(in_memory_blocks) == 3 and max(in_memory_blocks) == 1  # each block placed as soon as it was read
    assert max(in_memory_bytes) == max(sum(s.nbytes for s in b.slots) for b in blocks)  # bytes of one block
    assert start.values.keys() == ref_start.values.keys()
    for name, value in ref_start.values.items():  # the checkpoint's values, as from_pretrained gives them
        assert value.dtype == start.values[name].dtype and torch.equal(start.values[name], value), name
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert p.dtype == ARCHS[arch][2] and torch.equal(p, q), f"{name} differs after {STEPS} steps"
    for (name, b), c in zip(ref.named_buffers(), model.buffers()):
        assert torch.equal(b, c), name


def test_resume_in_a_new_process_is_bitwise(checkpoints, tmp_path):
    """Save after the first epoch (8 steps; weights gathered from the store), resume in a new process to step 16:
    bitwise equal to in-memory Lightning doing the same save and resume."""
    path = checkpoints["qwen2"]
    ref_trainer = trainer(tmp_path / "ref", "auto")
    ref_trainer.fit(HFCausalLM(path, block_size=16, backend="transformers"), data())
    ref_trainer.save_checkpoint(tmp_path / "ref.ckpt")
    ref = HFCausalLM(path, block_size=16, backend="transformers")
    trainer(tmp_path / "ref2", "auto", steps=2 * STEPS).fit(ref, data(), ckpt_path=str(tmp_path / "ref.ckpt"))

    t = trainer(tmp_path / "a", offload(tmp_path / "a"))
    with t.init_module(empty_init=True):
        model = HFCausalLM(path, block_size=16)
    t.fit(model, data())
    ckpt = tmp_path / "epoch1.ckpt"
    t.save_checkpoint(ckpt)
    script = f"""
import sys, json, torch
sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r}]
from pathlib import Path
from test_hf_any_arch import data, offload, trainer
from lightning_nvme.models import HFCausalLM
t = trainer({str(tmp_path / 'b')!r}, offload(Path({str(tmp_path / 'b')!r})), steps={2 * STEPS})
with t.init_module(empty_init=True):
    model = HFCausalLM({path!r}, block_size=16)
t.fit(model, data(), ckpt_path={str(ckpt)!r})
torch.save(dict(model.named_parameters()), {str(tmp_path / 'resumed.pt')!r})
print(json.dumps({{"step": t.global_step}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["step"] == 2 * STEPS
    resumed = torch.load(tmp_path / "resumed.pt")
    for name, p in ref.named_parameters():
        assert torch.equal(resumed[name], p), name


def _edited(src: str, dst, edit) -> str:
    """A copy of checkpoint ``src`` with its state dict changed by ``edit`` (one file)."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    state = {}
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(src, f)))
    edit(state)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        (dst / "config.json").write_text(f.read())
    return str(dst)


def test_missing_extra_and_misshaped_tensors_are_refused_by_name(checkpoints, tmp_path):
    src = checkpoints["llama"]
    key = "model.layers.1.mlp.up_proj.weight"
    missing = _edited(src, tmp_path / "missing", lambda s: s.pop(key))
    extra = _edited(src, tmp_path / "extra", lambda s: s.update({"model.layers.1.mlp.surplus": torch.zeros(2)}))
    shaped = _edited(src, tmp_path / "shape", lambda s: s.update({key: s[key][:, :-1].contiguous()}))
    for bad, pattern in [(missing, f"missing.*{key}"), (extra, "not in the model.*model.layers.1.mlp.surplus"),
                         (shaped, f"{key} has shape")]:
        model = build_causal_lm(bad)
        with pytest.raises(ValueError, match=pattern):
            HubWeights(bad).checked(model)
        t = trainer(tmp_path / "t", offload(tmp_path / "t"))
        with pytest.raises(ValueError, match=pattern), t.init_module(empty_init=True):
            HFCausalLM(bad, block_size=16)


def test_public_api_for_an_own_lightning_module(checkpoints):
    """``build_causal_lm`` + ``HubWeights(dir, prefix)``: the meta model filled by materialize equals from_pretrained."""
    from lightning_nvme.params.materialize import materialize

    path = checkpoints["gpt_neox"]

    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = build_causal_lm(path)

        def initial_weights(self):
            return HubWeights(path, prefix="net.").checked(self.net)

    own = Own()
    assert all(p.is_meta for p in own.parameters())
    materialize(own, torch.device("cpu"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    for (name, p), q in zip(plain.state_dict().items(), own.net.state_dict().values()):
        assert torch.equal(p, q), name
    for (name, b), c in zip(plain.named_buffers(), own.net.buffers()):
        assert torch.equal(b, c), name
    x = torch.randint(0, VOCAB, (2, 8))
    assert torch.equal(plain(x).logits, own.net(x).logits)  # both in train mode? make them comparable


def recipe_overrides(path: str, root, offload_params: bool = True) -> list[str]:
    return [f"model.path={path}", "model.block_size=16", f"strategy.offload_params={str(offload_params).lower()}",
            "strategy.overlap=backward", f"paths.output_dir={root}/out", f"paths.store_dir={root}/store",
            "trainer.accelerator=cpu", "data.source=generated", "data.max_bytes=20000", "data.batch_size=2",
            "data.steps_per_epoch=3", "data.val_batches=1", "trainer.max_steps=3", "++trainer.limit_val_batches=0",
            "trainer.gradient_clip_val=null", "logger=none", "callbacks=none"]


@pytest.mark.parametrize("arch", ["qwen2", "gpt_neox"])
def test_recipe_hf_local_streams_any_architecture(arch, tmp_path):
    """``recipe=hf_local strategy.offload_params=true`` with a non-GPT-2 checkpoint: built on the meta device,
    streamed into the store, the same weights as with offload_params=false."""
    from lightning_nvme.launch import compose_config, train

    path = make_checkpoint(tmp_path / "ckpt", arch, vocab=256)  # byte tokens: the directory has no tokenizer
    off = train(compose_config("hf_local", recipe_overrides(path, tmp_path / "off")))
    assert off.model.backend == "transformers" and off.trainer.strategy.param_offload is not None
    assert off.model.initial_weights() is not None  # streamed, not loaded in memory
    plain = train(compose_config("hf_local", recipe_overrides(path, tmp_path / "plain", offload_params=False)))
    for (name, p), q in zip(plain.model.named_parameters(), off.model.parameters()):
        assert torch.equal(p, q), name


FP32_KEPT = {  # config class, its extra arguments, the checkpoint's dtype, tensors from_pretrained keeps in fp32
    # _keep_in_fp32_modules (fp16 only): the norms, which GptOss builds in the default dtype
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4), torch.float16,
                ["model.norm.weight", "model.layers.1.input_layernorm.weight"]),
    # _keep_in_fp32_modules_strict (bf16 too): the attention sinks (built in fp32 by the module itself)
    "flint": ("FlintConfig", dict(num_experts=4, moe_intermediate_size=16), torch.bfloat16,
              ["model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"]),
}


@pytest.mark.parametrize("arch", list(FP32_KEPT))
def test_fp32_kept_modules_of_a_half_precision_checkpoint_as_from_pretrained(arch, tmp_path):
    """Architectures that keep some tensors in fp32 in a half-precision model (``_keep_in_fp32_modules``), which
    ``from_config`` alone may build in half precision: the meta build gives every tensor the dtype
    ``from_pretrained`` gives it, and the streamed values and the forward equal ``from_pretrained``'s bitwise."""
    from lightning_nvme.params.materialize import materialize

    config_cls, extra, dtype, fp32 = FP32_KEPT[arch]
    config = getattr(transformers, config_cls)(**{**SMALL, "num_hidden_layers": 2}, num_key_value_heads=2, head_dim=8,
                                               num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                               **extra)
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    kept = [n for n, p in plain.named_parameters() if p.dtype == torch.float32]
    assert set(fp32) <= set(kept), kept
    assert plain.model.embed_tokens.weight.dtype == dtype  # the checkpoint's dtype elsewhere

    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = build_causal_lm(tmp_path)  # the config's dtype

        def initial_weights(self):
            return HubWeights(tmp_path, prefix="net.").checked(self.net)

    own = Own()
    assert {n: p.dtype for n, p in own.net.named_parameters()} == {n: p.dtype for n, p in plain.named_parameters()}
    materialize(own, torch.device("cpu"))
    for (name, p), q in zip(plain.state_dict().items(), own.net.state_dict().values()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
    x = torch.randint(0, VOCAB, (2, 8))
    own.net.eval()
    assert torch.equal(plain(x).logits, own.net(x).logits)
