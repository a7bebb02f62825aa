"""Trained weights back in the Hugging Face Hub layout: ``strategy.export_weights(dir, layout="hf")`` (from the store)
and ``lightning-nvme export CKPT DIR`` (from a checkpoint whose weights stream beside it) write config.json +
sharded safetensors + index that ``AutoModelForCausalLM.from_pretrained`` loads bitwise equal to the trained
weights, with transformers' names (a tied head once, GPT-NeoX's ``embed_out``); peak RSS of an export stays
within one block + a constant."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_hf_any_arch import data, make_checkpoint, offload, trainer

from lightning_nvme.checkpoint import weights
from lightning_nvme.cli import main
from lightning_nvme.models import HFCausalLM

transformers = pytest.importorskip("transformers")


def _trained(path, root, steps=4, **settings):
    t = trainer(root, offload(root, **settings), steps=steps)
    with t.init_module(empty_init=True):
        model = HFCausalLM(str(path), block_size=16)
    t.fit(model, data())
    return t, model


def _reference(path, root, steps: int) -> torch.nn.Module:
    """The same training in memory by Lightning's default strategy (bitwise equal: test_hf_any_arch)."""
    ref = HFCausalLM(str(path), block_size=16, backend="transformers")
    trainer(root, "auto", steps=steps).fit(ref, data())
    return ref.model


def _assert_loads_as(directory, reference: torch.nn.Module) -> None:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    assert loaded.state_dict().keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == value.dtype and torch.equal(got, value), name


@pytest.mark.parametrize("arch", ["qwen2", "gpt_neox"])
def test_export_weights_from_the_store_loads_bitwise(arch, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch)
    t, model = _trained(src, tmp_path / "run", restore_params=False)  # the weights stay in the store after fit
    out = tmp_path / "hub"
    t.strategy.export_weights(str(out), layout="hf", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(os.path.exists(out / f) for f in files)
    from safetensors import safe_open

    src_keys: set[str] = set()
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(src, f), "pt") as h:
                src_keys |= set(h.keys())
    assert set(index["weight_map"]) == src_keys  # save_pretrained's names: tied head once, embed_out for NeoX
    _assert_loads_as(out, _reference(src, tmp_path / "ref", 4))


def test_cli_export_from_a_checkpoint_with_weights_beside_it(tmp_path):
    src = make_checkpoint(tmp_path / "src", "llama")
    t, model = _trained(src, tmp_path / "run", inline_weights_bytes=0, restore_params=False)
    ckpt = tmp_path / "last.ckpt"
    t.save_checkpoint(ckpt)
    with weights.deferred():  # the block weights were streamed beside the file
        assert weights.refs(torch.load(ckpt, weights_only=False)["state_dict"])
    assert main(["export", str(ckpt), str(tmp_path / "hub")]) == 0
    assert (tmp_path / "hub" / "model.safetensors").exists()  # under 5 GB: one file, as save_pretrained
    _assert_loads_as(tmp_path / "hub", _reference(src, tmp_path / "ref", 4))


def test_cli_export_refuses_without_a_config(tmp_path, capsys):
    src = make_checkpoint(tmp_path / "src", "llama")
    t, _ = _trained(src, tmp_path / "run", steps=1)
    ckpt = tmp_path / "last.ckpt"
    t.save_checkpoint(ckpt)
    assert main(["export", str(ckpt), str(tmp_path / "hub"), "--config", str(tmp_path)]) == 2
    assert "--config MODEL_DIR" in capsys.readouterr().err


PEAK = """
import os, sys, json, torch
from lightning_nvme.models.hub_export import export_checkpoint
from lightning_nvme.checkpoint.load import open_checkpoint
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
import transformers  # imported before the baseline
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
before = rss("VmRSS")
export_checkpoint(sys.argv[1], sys.argv[2])
print(json.dumps({"before": before, "peak": rss("VmHWM")}))
"""


def test_export_peak_rss_is_one_block_plus_a_constant(tmp_path):
    """A model of 8 blocks of 13 MiB (fp32): the export's peak RSS above its start is under one block + 32 MiB,
    less than half the model."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
    src = tmp_path / "src"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(src)
    t, model = _trained(src, tmp_path / "run", steps=1, inline_weights_bytes=0, restore_params=False)
    ckpt = tmp_path / "last.ckpt"
    t.save_checkpoint(ckpt)
    block = max(b.nbytes for b in t.strategy.param_offload.blocks)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    out = subprocess.run([sys.executable, "-c", PEAK, str(ckpt), str(tmp_path / "hub")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    grew = got["peak"] - got["before"]
    assert grew <= block + (32 << 20), (grew, block, whole)
    assert block + (32 << 20) < whole / 2
    _assert_loads_as(tmp_path / "hub", _reference(src, tmp_path / "ref", 1))
