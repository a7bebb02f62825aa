"""``lightning-nvme generate`` and ``lightning-nvme eval`` on a tiny Llama saved locally: the blocks streamed from the
directory in place; the generated tokens are transformers' greedy ones, the loss and perplexity those of the same
model validated in memory (bitwise), with the figures (tokens/s, bytes read per token) in the last JSON line."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_nvme.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from test_hf_any_arch import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", vocab=256)


def test_generate(llama, capsys):
    assert main(["generate", llama, "--prompt", "abc", "--prompt", "xyz", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(out[-1])
    assert figures["batch"] == 2 and figures["new_tokens"] == 10 and figures["block_passes"] == 5
    assert figures["bytes_read"] > 0 and figures["bytes_read_per_token"] == figures["bytes_read"] / 10
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama, local_files_only=True).eval()
    for prompt, line in zip(["abc", "xyz"], out[:2]):
        ids = torch.tensor([list(prompt.encode())])
        want = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5,
                                  pad_token_id=0)[0, ids.shape[1]:]
        assert line == f"{prompt!r} -> {bytes(want.tolist()).decode('utf-8', errors='replace')!r}"


def test_eval(llama, tmp_path, capsys):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_nvme.data.corpus import load_corpus
    from lightning_nvme.data.tokenizers import ByteTokenizer
    from lightning_nvme.models import HFCausalLM

    args = ["eval", llama, "data=generated", "--block-size", "16", "--batch-size", "2", "--max-batches", "3",
            "--eval-window", "2", "--max-bytes", "4000", "--store-dir", str(tmp_path / "store")]
    assert main(args) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tokens = ByteTokenizer().encode(load_corpus("generated", 4000))[:6 * 17].view(6, 17)
    ref = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=str(tmp_path)).validate(
        HFCausalLM(llama, block_size=16), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2),
        verbose=False)[0]
    assert figures["loss"] == float(ref["val/loss"]) and figures["perplexity"] == float(ref["val/ppl"])
    assert figures["tokens_scored"] == 6 * 16 and figures["block_reads"] == 3 * 2  # 3 blocks, 2 windows of 2 batches


def test_refusals(llama, tmp_path, capsys):
    assert main(["generate", llama]) == 2
    assert "--prompt" in capsys.readouterr().err
    assert main(["eval", llama, "stdlib"]) == 2
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "a"]) == 2
    assert "neither a model directory" in capsys.readouterr().err
