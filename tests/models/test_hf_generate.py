"""``HFCausalLM.generate`` with the blocks streamed (a model built on the meta device, each block read from its
safetensors directory per decoding step, the KV cache in memory): greedy output token for token that of
transformers' in-memory ``generate``, for a batch of prompts sharing each block read."""

from __future__ import annotations

import pytest
import torch

from lightning_nvme.models import HFCausalLM

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_streamed_greedy_generation_equals_transformers(tmp_path, arch):
    from test_hf_any_arch import make_checkpoint

    path = make_checkpoint(tmp_path / arch, arch)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 64, (3, 5), generator=g)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    want = reference.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                              max_new_tokens=6, pad_token_id=0)

    with torch.device("meta"):
        model = HFCausalLM(path, block_size=16, backend="transformers")
    assert all(p.is_meta for p in model.model.parameters())
    got = model.generate(prompts, max_new_tokens=6, attention_mask=torch.ones_like(prompts), pad_token_id=0)
    assert torch.equal(got.sequences, want)
    n_blocks = 3
    assert got.block_passes == 6 and got.new_tokens == 18  # one pass through the blocks per step, for the batch
    block_bytes = sum(p.numel() * p.element_size() for p in reference.model.layers.parameters())
    assert got.bytes_read == 6 * block_bytes and got.bytes_per_token == 6 * block_bytes / 18
    assert n_blocks == len(reference.model.layers)
    # a model already in memory generates as it is (nothing streamed)
    in_memory = HFCausalLM(path, block_size=16, backend="transformers")
    again = in_memory.generate(prompts, max_new_tokens=6, attention_mask=torch.ones_like(prompts), pad_token_id=0)
    assert torch.equal(again.sequences, want) and again.bytes_read == 0
