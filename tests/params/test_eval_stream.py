"""Streamed evaluation (``offload_params=True`` outside fit, ``lightning_nvme.params.stream``): ``validate``,
``test`` and ``predict`` read each block's weights for its forward only, from the store after fit
(``restore_params=False``), from a streamed checkpoint's beside weights (``ckpt_path``) and from a safetensors
directory read in place; their outputs (losses, logged metrics, predictions) are bitwise those of the same model
evaluated in memory by Lightning's default strategy, for the project's GPT and two Hugging Face architectures;
nothing is written; at most ``param_prefetch + 1`` blocks are in memory."""

from __future__ import annotations

import os

import pytest
import torch
from _param_offload_model import TinyGPT, tokens
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader

import lightning_nvme  # noqa: F401  (registers the strategies)
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.models import HFCausalLM
from lightning_nvme.models.gpt import GPT, GPTConfig
from lightning_nvme.params import is_placeholder

STEPS = 4


class EvalGPT(TinyGPT):
    """``TinyGPT`` with a validation, test and predict step (its loss logged; predict returns the logits)."""

    def _loss(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])


def loader(n: int = 24, vocab: int = 64, seed: int = 11) -> DataLoader:
    return DataLoader(tokens(n=n, vocab=vocab, seed=seed), batch_size=4)


def trainer(root, strategy, steps: int = STEPS) -> Trainer:
    return Trainer(default_root_dir=str(root), strategy=strategy, accelerator="cpu", devices=1, max_steps=steps,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0)


def offload(root, **kwargs) -> NVMeOffloadStrategy:
    kwargs.setdefault("overlap", "backward")
    return NVMeOffloadStrategy(store_dir=str(root / "store"), chunk_bytes=64 << 10, offload_params=True, **kwargs)


def evaluate(t: Trainer, model, data, **kwargs) -> dict:
    """validate, test and predict: their logged metrics and predictions."""
    return {"validate": t.validate(model, data, verbose=False, **kwargs),
            "test": t.test(model, data, verbose=False, **kwargs),
            "predict": t.predict(model, data, **kwargs)}


def assert_same(got: dict, want: dict) -> None:
    for what in ("validate", "test"):
        assert got[what][0].keys() == want[what][0].keys(), what
        for key, value in want[what][0].items():
            assert torch.equal(torch.as_tensor(got[what][0][key]), torch.as_tensor(value)), (what, key)
    assert len(got["predict"]) == len(want["predict"])
    for a, b in zip(got["predict"], want["predict"]):
        assert torch.equal(a, b)


def streamed(t: Trainer) -> None:
    """The last evaluation streamed every block, one forward at a time."""
    stats = t.strategy.eval_stats
    assert stats is not None and stats.reads > 0 and stats.peak_bound_blocks == 1
    assert stats.peak_blocks_in_memory <= t.strategy.config.param_prefetch + 1


def test_gpt_from_the_store_after_fit(tmp_path):
    ref = EvalGPT()
    ref_trainer = trainer(tmp_path / "ref", "auto")
    ref_trainer.fit(ref, loader())
    want = evaluate(ref_trainer, ref, loader())

    model = EvalGPT()
    t = trainer(tmp_path / "off", offload(tmp_path, restore_params=False))
    t.fit(model, loader())
    store = t.strategy.param_offload.residency.store.path
    before = os.path.getmtime(store) if os.path.isfile(store) else None
    got = evaluate(t, model, loader())
    streamed(t)
    assert_same(got, want)
    assert t.strategy.eval_stats.reads == len(t.strategy.param_offload.blocks) * 6  # once per batch (6 batches)
    assert is_placeholder(model.model.transformer.h[0].mlp.c_fc.weight)  # still in the store only
    if before is not None:
        assert os.path.getmtime(store) == before  # nothing written


@pytest.mark.parametrize("beside", [True, False], ids=["beside", "inline"])
def test_gpt_from_a_checkpoint(tmp_path, beside):
    ref = EvalGPT()
    ref_trainer = trainer(tmp_path / "ref", "auto")
    ref_trainer.fit(ref, loader())
    want = evaluate(ref_trainer, ref, loader())

    t = trainer(tmp_path / "off", offload(tmp_path, restore_params=False, inline_weights_bytes=0 if beside else 1 << 30))
    t.fit(EvalGPT(), loader())
    ckpt = str(tmp_path / "fit.ckpt")
    t.save_checkpoint(ckpt)

    t2 = trainer(tmp_path / "eval", offload(tmp_path / "eval"))
    with t2.init_module(empty_init=True):
        model = EvalGPT(in_configure_model=True)
        model.configure_model()
    assert all(p.is_meta for p in model.parameters())
    got = evaluate(t2, model, loader(), ckpt_path=ckpt)
    streamed(t2)
    assert_same(got, want)
    assert not os.path.exists(tmp_path / "eval" / "store")  # no store made: nothing written


def test_meta_model_without_weights_is_refused_by_name(tmp_path):
    t = trainer(tmp_path, offload(tmp_path))
    with t.init_module(empty_init=True):
        model = EvalGPT(in_configure_model=True)
        model.configure_model()
    with pytest.raises(RuntimeError, match="ckpt_path"):
        t.validate(model, loader(), verbose=False)


def test_grad_enabled_is_refused(tmp_path):
    t = trainer(tmp_path, offload(tmp_path))
    directory = tmp_path / "gpt2"
    GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)).save_pretrained(directory)

    class GradEval(HFCausalLM):
        def validation_step(self, batch, batch_idx):
            with torch.enable_grad():
                return super().validation_step(batch, batch_idx)

    with t.init_module(empty_init=True):
        model = GradEval(str(directory), block_size=16)
    with pytest.raises(RuntimeError, match="forward only"):
        t.validate(model, loader(), verbose=False)


# ---- Hugging Face: the project's GPT-2 (native), Llama and Qwen2 (transformers), read in place ---------------
def hf_checkpoint(directory, arch: str) -> str:
    if arch == "gpt2":
        GPT(GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=4)).save_pretrained(directory)
        return str(directory)
    from test_hf_any_arch import make_checkpoint

    return make_checkpoint(directory, arch)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_safetensors_directory_read_in_place(tmp_path, arch):
    if arch != "gpt2":
        pytest.importorskip("transformers")
    path = hf_checkpoint(tmp_path / arch, arch)
    backend = "native" if arch == "gpt2" else "transformers"  # what a meta-device build streams
    ref = HFCausalLM(path, block_size=16, backend=backend)
    want = evaluate(trainer(tmp_path / "ref", "auto"), ref, loader())

    t = trainer(tmp_path / "off", offload(tmp_path))
    with t.init_module(empty_init=True):
        model = HFCausalLM(path, block_size=16)
    assert all(p.is_meta for p in model.parameters()) and model.backend == backend
    got = evaluate(t, model, loader())
    streamed(t)
    assert_same(got, want)
    assert not os.path.exists(tmp_path / "store")  # read where it lies: no store


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_from_the_store_and_from_a_streamed_checkpoint(tmp_path, arch):
    pytest.importorskip("transformers")
    path = hf_checkpoint(tmp_path / arch, arch)
    ref = HFCausalLM(path, block_size=16)
    ref_trainer = trainer(tmp_path / "ref", "auto")
    ref_trainer.fit(ref, loader())
    want = evaluate(ref_trainer, ref, loader())

    t = trainer(tmp_path / "off", offload(tmp_path, restore_params=False, inline_weights_bytes=0))
    with t.init_module(empty_init=True):
        model = HFCausalLM(path, block_size=16)
    t.fit(model, loader())
    assert_same(evaluate(t, model, loader()), want)  # from the store
    streamed(t)
    ckpt = str(tmp_path / "fit.ckpt")
    t.save_checkpoint(ckpt)

    t2 = trainer(tmp_path / "eval", offload(tmp_path / "eval"))
    with t2.init_module(empty_init=True):
        fresh = HFCausalLM(path, block_size=16)
    assert_same(evaluate(t2, fresh, loader(), ckpt_path=ckpt), want)  # from the checkpoint's beside weights
    streamed(t2)
    # its placeholders now stand for the checkpoint's weights: never served from the base directory again
    with pytest.raises(RuntimeError, match="ckpt_path"):
        t2.validate(fresh, loader(), verbose=False)
    with pytest.raises(ValueError, match="placeholders"):
        fresh.generate(torch.zeros(1, 2, dtype=torch.long), 1)


# ---- peak memory ---------------------------------------------------------------------------------------------
MEMORY_SCRIPT = """
import json, logging, sys
logging.disable(logging.INFO)
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset
import lightning_nvme
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.models import HFCausalLM

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path, root, streamed = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
torch.set_num_threads(1)
g = torch.Generator().manual_seed(5)
x = torch.randint(0, 256, (8, 17), generator=g)
data = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=2)
strategy = NVMeOffloadStrategy(store_dir=root + "/store", offload_params=True) if streamed else "auto"
t = Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", devices=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on: building the model, then validate
base = status("VmRSS")
with t.init_module(empty_init=True):  # streamed: on the meta device; else in memory
    model = HFCausalLM(path, block_size=16, backend="native")
t.validate(model, data, verbose=False)
print(json.dumps({"base": base, "peak": status("VmHWM"),
                  "stats": vars(t.strategy.eval_stats) if streamed else None}))
"""


def test_peak_memory_of_a_streamed_validate_is_a_few_blocks(tmp_path):
    """A 16-block GPT (~450 MiB of weights) validated from its safetensors directory: the resident set grows by at
    most 3 blocks + activations + a constant (measured in a fresh process, peak RSS ``VmHWM`` reset before validate),
    while the same validate in memory grows by the whole model (the measure sees the difference)."""
    import json
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    cfg = GPTConfig(vocab_size=256, n_positions=16, n_embd=768, n_layer=16, n_head=12)
    model = GPT(cfg)
    block_bytes = sum(p.numel() * p.element_size() for p in model.transformer.h[0].parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path / "gpt")
    del model

    def run(streamed: bool) -> dict:
        out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "gpt"), str(tmp_path),
                              "1" if streamed else "0"], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    streamed_run, in_memory = run(True), run(False)
    activations = 8 << 20  # batch 2 x 16 tokens x 768: a few hundred KiB per tensor; logits 2 x 16 x 256
    constant = 64 << 20  # allocator and kernel workspaces, the safetensors header, Lightning's loop
    grew = streamed_run["peak"] - streamed_run["base"]
    assert streamed_run["stats"]["reads"] == 16 * 4 and streamed_run["stats"]["peak_bound_blocks"] == 1
    assert grew <= 3 * block_bytes + activations + constant, (grew, block_bytes)
    assert in_memory["peak"] - in_memory["base"] >= model_bytes  # the in-memory build does hold the model


# ---- the layer-major window ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_layer_major_window_reads_each_block_once_per_window(tmp_path, arch):
    """``eval_window=4`` over 6 batches (7 with the predict's odd one): the same outputs as batch by batch, bitwise,
    and each block read once per window (2 windows per pass), counted by the stream."""
    if arch != "gpt2":
        pytest.importorskip("transformers")
    path = hf_checkpoint(tmp_path / arch, arch)
    backend = "native" if arch == "gpt2" else "transformers"
    want = evaluate(trainer(tmp_path / "ref", "auto"), HFCausalLM(path, block_size=16, backend=backend), loader())

    t = trainer(tmp_path / "off", offload(tmp_path, eval_window=4))
    with t.init_module(empty_init=True):
        model = HFCausalLM(path, block_size=16)
    reads = []
    for what in ("validate", "test", "predict"):
        got = getattr(t, what)(model, loader(), **({} if what == "predict" else {"verbose": False}))
        want_what = want[what]
        if what == "predict":
            assert all(torch.equal(a, b) for a, b in zip(got, want_what)) and len(got) == len(want_what)
        else:
            assert got[0].keys() == want_what[0].keys()
            assert all(torch.equal(torch.as_tensor(got[0][k]), torch.as_tensor(v)) for k, v in want_what[0].items())
        stats = t.strategy.eval_stats
        reads.append(stats.reads_per_block)
    n_blocks = 3
    assert reads == [{i: 2 for i in range(n_blocks)}] * 3  # 6 batches in windows of 4: two reads of each block


def test_window_over_its_activation_budget_is_refused_by_name(tmp_path):
    path = hf_checkpoint(tmp_path / "gpt2", "gpt2")
    t = trainer(tmp_path / "off", offload(tmp_path, eval_window=4, eval_activation_bytes=1024))
    with t.init_module(empty_init=True):
        model = HFCausalLM(path, block_size=16)
    with pytest.raises(lightning_nvme.checks.ConfigError, match="eval_activation_bytes"):
        t.validate(model, loader(), verbose=False)


def test_a_model_that_is_not_sequential_over_its_blocks_is_refused_by_name(tmp_path):
    """Block 1 fed something else than block 0's output: the window refuses rather than serve other numbers."""
    path = hf_checkpoint(tmp_path / "gpt2", "gpt2")

    class Skips(HFCausalLM):
        def logits(self, input_ids):
            m = self.model
            x = m.transformer["wte"](input_ids) + m.transformer["wpe"](torch.arange(input_ids.shape[1]))
            for block in m.transformer["h"]:
                x = block(x) * 1.0  # a computation between blocks
            return m.lm_head(m.transformer["ln_f"](x))

    t = trainer(tmp_path / "off", offload(tmp_path, eval_window=2))
    with t.init_module(empty_init=True):
        model = Skips(path, block_size=16)
    with pytest.raises(lightning_nvme.checks.ConfigError, match="eval_window=2"):
        t.validate(model, loader(), verbose=False)


def test_refusals_before_anything_is_read(tmp_path):
    """A block holding a buffer still on the meta device, and fit on a model whose blocks a streamed evaluation left
    as placeholders: each refused by name."""
    path = hf_checkpoint(tmp_path / "gpt2", "gpt2")
    t = trainer(tmp_path / "a", offload(tmp_path / "a"))
    with t.init_module(empty_init=True):
        model = HFCausalLM(path, block_size=16)
        model.model.transformer["h"][1].register_buffer("scale", torch.empty(3))
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.scale.*meta device"):
        t.validate(model, loader(), verbose=False)

    t = trainer(tmp_path / "b", offload(tmp_path / "b"))
    with t.init_module(empty_init=True):
        model = HFCausalLM(path, block_size=16)
    t.validate(model, loader(), verbose=False)
    with pytest.raises(ValueError, match="placeholders left by a streamed evaluation"):
        trainer(tmp_path / "c", offload(tmp_path / "c")).fit(model, loader())
