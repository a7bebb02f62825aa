"""The recipes' model and data: GPT-2 checkpoints load without transformers (and match it when present),
activation checkpointing keeps gradients, the embedded corpus needs no download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lightning_nvme.data import ByteTokenizer, EmbeddedTextDataModule, load_corpus
from lightning_nvme.models import GPT, GPTConfig, GPTLightningModule, HFCausalLM

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()


def test_save_and_load_pretrained_round_trip_without_transformers(tmp_path: Path) -> None:
    model = _tiny()
    model.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}
    loaded = HFCausalLM(str(tmp_path), block_size=32, backend="native").model.eval()
    x = torch.randint(0, 300, (2, 16))
    assert torch.equal(model(x), loaded(x))


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers (the optional 'hf' extra) is not installed")
def test_native_loader_matches_transformers_both_ways(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                    bos_token_id=0, eos_token_id=0)).eval()
    hf.save_pretrained(tmp_path / "from_hf")
    ours = GPT.from_pretrained(tmp_path / "from_hf").eval()
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-5, atol=1e-5)
        ours.save_pretrained(tmp_path / "from_ours")
        back = GPT2LMHeadModel.from_pretrained(tmp_path / "from_ours").eval()
        torch.testing.assert_close(back(x).logits, ours(x), rtol=1e-5, atol=1e-5)
    auto = HFCausalLM(str(tmp_path / "from_hf"), block_size=32, backend="transformers")
    assert auto.vocab_size == 300 and auto.model.training


def test_hf_loader_refuses_a_block_size_beyond_the_checkpoint(tmp_path: Path) -> None:
    _tiny().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model.block_size=64 exceeds .* 32"):
        HFCausalLM(str(tmp_path), block_size=64, backend="native")


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = GPTLightningModule(n_layer=2, n_embd=32, n_head=2, block_size=16)
    ckpt = GPTLightningModule(n_layer=2, n_embd=32, n_head=2, block_size=16, activation_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, 256, (2, 16))
    for m in (plain, ckpt):
        m.train()
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


@pytest.mark.parametrize("source", ["stdlib", "docstrings", "generated"])
def test_embedded_corpora_need_no_download(source: str) -> None:
    text = load_corpus(source, max_bytes=50_000)
    assert len(text.encode()) >= 20_000
    assert load_corpus(source, max_bytes=50_000) == text  # deterministic


def test_datamodule_yields_shifted_windows_and_fixed_validation() -> None:
    dm = EmbeddedTextDataModule(source="generated", max_bytes=20_000, block_size=16, batch_size=4,
                                steps_per_epoch=3, val_batches=2)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert len(dm.train_dataloader()) == 3
    first = [b[0] for b in dm.val_dataloader()]
    again = [b[0] for b in dm.val_dataloader()]
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, again))
    assert ByteTokenizer().decode(ByteTokenizer().encode("def f(): ...")) == "def f(): ..."
