"""Frozen weights read where they lie (``frozen_weights="in_place"``, ``lightning_nvme.params.frozen_files``): a peft
LoRA whose base is read from the user's safetensors files during fit trains bitwise like the same LoRA with the base
copied into the store (tiny Llama and Qwen2 (sharded, tied head), both overlap modes, 8 steps); the store then holds
only the adapters and their optimizer state; a checkpoint references the base file instead of copying it, a base
file changed between runs (or under a run) is refused by name, and a resume in a new process is bitwise. The reader
itself serves tensors at offsets O_DIRECT cannot address directly (a crafted header), both ways it reads."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from lightning.pytorch import Callback
from test_hf_any_arch import data, make_checkpoint, trainer

from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.checkpoint.base_file import FileWeight
from lightning_nvme.checkpoint.load import open_checkpoint
from lightning_nvme.checkpoint.weights import BesideWeight
from lightning_nvme.checks import ConfigError
from lightning_nvme.models import HFCausalLM
from lightning_nvme.params.frozen_files import FrozenFiles
from lightning_nvme.params.layout import BlockLayout, ParamSlot
from lightning_nvme.store import align_up
from lightning_nvme.store.layout import HEADER_BYTES

pytest.importorskip("transformers")
pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]
STEPS = 8


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    return {a: make_checkpoint(tmp_path_factory.mktemp(a), a) for a in ("llama", "qwen2")}


def _strategy(root, frozen: str, overlap: str = "backward", **settings) -> NVMeOffloadStrategy:
    return NVMeOffloadStrategy(store_dir=str(root / "store"), chunk_bytes=64 << 10, offload_params=True,
                               overlap=overlap, frozen_weights=frozen, **settings)


def _lora(path: str) -> HFCausalLM:
    torch.manual_seed(11)  # the adapters' init draws: the same in every build
    return HFCausalLM(path, block_size=16, lora_rank=4, lora_alpha=8, lora_targets=TARGETS)


class Probe(Callback):
    """Per step: the loss; at the first step: the store's regions and the in-place reader's state."""

    def __init__(self, at_step: int | None = None, action=None) -> None:
        self.losses: list[torch.Tensor] = []
        self.regions: dict[str, int] = {}
        self.size_bytes = 0
        self.file_bytes = 0
        self.heads = 0
        self.head_bytes = 0
        self.requests = 0
        self.at_step, self.action = at_step, action

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())
        strategy = trainer.strategy
        store, frozen = strategy.nvme_store, strategy.param_offload.frozen
        if not self.regions:
            self.regions = {name: r.capacity for name, r in store.layout.regions.items()}
            self.size_bytes = store.size_bytes
            self.file_bytes = sum(os.path.getsize(p) for p in store.paths)
        if frozen is not None:
            self.heads, self.head_bytes = len(frozen.heads), frozen.head_bytes
            self.requests = frozen.stats.requests
        if self.action is not None and trainer.global_step == self.at_step:
            self.action()


def _fit(base: str, root, frozen: str, overlap: str = "backward", steps: int = STEPS, probe: Probe | None = None,
         ckpt_path=None, **settings):
    probe = probe or Probe()
    t = trainer(root, _strategy(root, frozen, overlap, **settings), steps=steps, callbacks=[probe])
    with t.init_module(empty_init=True):
        model = _lora(base)
    t.fit(model, data(), ckpt_path=ckpt_path)
    return t, model, probe


@pytest.mark.parametrize("overlap", ["step", "backward"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lora_base_read_in_place_equals_base_in_store_bitwise(bases, tmp_path, arch, overlap):
    t_in, model_in, p_in = _fit(bases[arch], tmp_path / "in_place", "in_place", overlap)
    t_st, model_st, p_st = _fit(bases[arch], tmp_path / "store", "store", overlap)
    blocks: list[BlockLayout] = t_in.strategy.param_offload.blocks
    assert len(blocks) == 3 and p_in.heads == 3 and p_st.heads == 0  # every block's base read in place
    assert p_in.requests > 0
    assert len(p_in.losses) == len(p_st.losses) == STEPS
    for step, (a, b) in enumerate(zip(p_in.losses, p_st.losses)):
        assert torch.equal(a, b), f"loss of step {step}"
    names = [n for n, _ in model_st.named_parameters()]
    assert names == [n for n, _ in model_in.named_parameters()]
    for (name, p), q in zip(model_st.named_parameters(), model_in.parameters()):
        assert torch.equal(p, q), name
    assert any(torch.count_nonzero(p) for n, p in model_in.named_parameters() if "lora_B" in n)  # trained

    # The store holds the adapters (each block's trainable tail) and their optimizer state, nothing of the base.
    frozen = sum(s.nbytes for b in blocks for s in b.slots if not s.trainable)
    tails = {b.region: align_up(b.nbytes - b.writable_offset) for b in blocks}
    assert p_in.head_bytes == frozen
    assert {r: p_in.regions[r] for r in tails} == tails
    state = {r: c for r, c in p_in.regions.items() if r.startswith("opt")}  # optimizer chunks
    owner = {r: c for r, c in p_in.regions.items() if r.startswith("owner/")}  # the store's owner record
    assert state and set(p_in.regions) == set(tails) | set(state) | set(owner) and sum(owner.values()) <= 4096
    assert p_in.size_bytes == HEADER_BYTES + sum(p_in.regions.values()), p_in.regions
    assert p_in.file_bytes <= p_in.size_bytes
    assert p_st.size_bytes - p_in.size_bytes >= frozen  # the copy the in-place read saves
    adapters = sum(s.nbytes for b in blocks for s in b.slots if s.trainable)
    assert sum(state.values()) <= align_up(2 * adapters) + 2 * 4096 * len(state)  # AdamW: two moments per adapter


def _flip_a_byte(path: str) -> None:
    """Change one byte of the first tensor's data (same size, same header: only the content and mtime change)."""
    with open(path, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + hlen + 1)
        b = f.read(1)
        f.seek(8 + hlen + 1)
        f.write(bytes([b[0] ^ 0x40]))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a coarse-mtime filesystem sees it too


def test_checkpoint_references_base_and_a_changed_base_is_refused(bases, tmp_path):
    base = str(tmp_path / "base")
    shutil.copytree(bases["llama"], base)
    # restore_params=False: the weights stay where fit keeps them (a save during fit, e.g. ModelCheckpoint, is the
    # same); with the default, fit's end gives the module its values back and a later save holds values
    # inline_weights_bytes=0: the adapters stream beside the file (only each block's tail read), the base referenced
    t, _, _ = _fit(base, tmp_path / "a", "in_place", steps=4, restore_params=False, inline_weights_bytes=0,
                   checkpoint_copy="streamed")
    ckpt = tmp_path / "a.ckpt"
    t.save_checkpoint(ckpt)
    checkpoint, _ = open_checkpoint(ckpt)
    refs = {k: v for k, v in checkpoint["state_dict"].items() if isinstance(v, FileWeight)}
    frozen_in_blocks = [s.name for b in t.strategy.param_offload.blocks for s in b.slots if not s.trainable]
    assert sorted(refs) == sorted(frozen_in_blocks)  # the base referenced, not copied; adapters are values
    assert {os.path.realpath(r.identity.path) for r in refs.values()} == {os.path.realpath(f"{base}/model.safetensors")}
    others = {k: v for k, v in checkpoint["state_dict"].items() if k not in refs}
    assert any(isinstance(v, BesideWeight) for v in others.values())  # the adapters, beside the file
    assert all(torch.is_tensor(v) or isinstance(v, BesideWeight) for v in others.values())
    record = t.strategy.checkpoint_saves[-1]  # the save record says so
    assert record.base_files == [os.path.abspath(f"{base}/model.safetensors")]
    assert "referenced in the base file" in record.describe()

    # a plain torch.load (no deferral) reads the referenced tensors from the base file
    plain = torch.load(ckpt, weights_only=True)
    some = next(iter(refs))
    assert torch.is_tensor(plain["state_dict"][some]) and plain["state_dict"][some].shape == refs[some].shape

    _flip_a_byte(f"{base}/model.safetensors")
    with pytest.raises(ConfigError, match=r"frozen_weights.*model\.safetensors.*changed.*modification time"):
        _fit(base, tmp_path / "b", "in_place", steps=8, ckpt_path=str(ckpt))
    with pytest.raises(ConfigError, match="model.safetensors"):
        torch.load(ckpt, weights_only=True)


def test_base_changed_under_a_run_is_refused(bases, tmp_path):
    base = str(tmp_path / "base")
    shutil.copytree(bases["llama"], base)
    probe = Probe(at_step=2, action=lambda: _flip_a_byte(f"{base}/model.safetensors"))
    with pytest.raises(ConfigError, match=r"frozen_weights.*model\.safetensors.*changed"):
        _fit(base, tmp_path / "a", "in_place", probe=probe)
    assert len(probe.losses) == 2  # refused at the end of the step that saw the change, before the next one


def test_resume_in_a_new_process_is_bitwise(bases, tmp_path):
    """Fit 8 steps reading the base in place, save (the base referenced, the adapters beside the file), resume in a
    new process to 16: bitwise equal to the same save and resume with the base copied into the store."""
    path = bases["qwen2"]
    ref, _, _ = _fit(path, tmp_path / "ref", "store")
    ref.save_checkpoint(tmp_path / "ref.ckpt")
    _, ref_model, _ = _fit(path, tmp_path / "ref2", "store", steps=2 * STEPS, ckpt_path=str(tmp_path / "ref.ckpt"))

    t, _, _ = _fit(path, tmp_path / "a", "in_place", restore_params=False, inline_weights_bytes=0)
    ckpt = tmp_path / "epoch1.ckpt"
    t.save_checkpoint(ckpt)
    checkpoint, _ = open_checkpoint(ckpt)
    assert any(isinstance(v, FileWeight) for v in checkpoint["state_dict"].values())  # the base referenced
    here = os.path.dirname(os.path.abspath(__file__))
    script = f"""
import sys, json, torch
sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}, {os.path.join(os.path.dirname(here), 'models')!r}]
from pathlib import Path
from test_frozen_files import _fit, Probe
probe = Probe()
t, model, _ = _fit({path!r}, Path({str(tmp_path / 'b')!r}), "in_place", steps={2 * STEPS}, probe=probe,
                   ckpt_path={str(ckpt)!r})
torch.save(dict(model.named_parameters()), {str(tmp_path / 'resumed.pt')!r})
print(json.dumps({{"step": t.global_step, "heads": probe.heads,
                  "heads_not_reread": sorted(t.strategy.param_offload._head_as_file)}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # the references name the file this run reads: the bound heads are the values, nothing read or compared again
    assert result == {"step": 2 * STEPS, "heads": 3, "heads_not_reread": [0, 1, 2]}
    resumed = torch.load(tmp_path / "resumed.pt")
    for name, p in ref_model.named_parameters():
        assert torch.equal(resumed[name], p), name


# ---- the reader ------------------------------------------------------------------------------------------------
def _crafted(path: str, tensors: dict[str, torch.Tensor], pad: int) -> dict[str, int]:
    """A safetensors file whose header is padded by ``pad`` spaces (so its data starts off any 4 KiB boundary) and
    whose tensors sit at odd offsets (``gap`` bytes between them); returns each tensor's absolute offset."""
    codes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header, pos, gaps = {}, 0, [6, 4090, 2, 8190]
    blobs = []
    for i, (name, t) in enumerate(tensors.items()):
        pos += gaps[i % len(gaps)]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        blobs.append((pos, t.contiguous().view(torch.uint8).numpy().tobytes()))
        pos += n
    blob = json.dumps(header).encode() + b" " * pad
    data = bytearray(pos + 3)  # a few bytes past the last tensor: the aligned superset reads beyond them
    for at, raw in blobs:
        data[at:at + len(raw)] = raw
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + bytes(data))
    return {name: 8 + len(blob) + v["data_offsets"][0] for name, v in header.items()}


@pytest.mark.parametrize("direct", [None, False], ids=["o_direct", "buffered"])
def test_unaligned_tensor_offsets_are_served_exactly(tmp_path, direct):
    g = torch.Generator().manual_seed(5)
    tensors = {
        "a": torch.randn(3, 5, generator=g),  # 60 bytes, inside one page
        "b": torch.randn(1000, 7, generator=g).to(torch.bfloat16),  # spans pages
        "c": torch.randn(5000, generator=g),  # spans several requests of 8 KiB
        "d": torch.randn(17, generator=g).to(torch.float16),
        "conv": torch.randn(33, 9, generator=g).to(torch.bfloat16),  # stored bf16, the parameter fp32
    }
    path = str(tmp_path / "crafted.safetensors")
    offsets = _crafted(path, tensors, pad=13)
    assert all(off % 4096 for off in offsets.values())
    dtypes = {n: (torch.float32 if n == "conv" else t.dtype) for n, t in tensors.items()}
    params = {n: torch.nn.Parameter(torch.empty(t.shape, dtype=dtypes[n]), requires_grad=False)
              for n, t in tensors.items()}
    block = BlockLayout(0, "block", torch.nn.Module(), "params/block0")
    for name, p in params.items():  # the layout's packing: 256-byte slots
        block.slots.append(ParamSlot(name, p, p.shape, p.dtype, block.nbytes, p.numel() * p.element_size()))
        block.nbytes = align_up(block.nbytes + p.numel() * p.element_size(), 256)
    block.writable_offset = block.nbytes

    frozen = FrozenFiles(direct=direct, read_bytes=8192)
    try:
        heads = frozen.plan([block], lambda name: (path, name))
        assert list(heads) == [0]
        buf = torch.zeros(block.nbytes + 4096, dtype=torch.uint8)
        frozen.read_now(heads[0], buf)
        for slot in block.slots:
            got = buf[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
            expected = tensors[slot.name].to(slot.dtype)  # what building the model (copy_) gives
            assert torch.equal(got, expected), slot.name
        base = frozen.files[os.path.abspath(path)]
        if direct is None and base.direct_fd >= 0:
            assert frozen.stats.direct_requests > 0 and frozen.stats.buffered_requests == 0
        if direct is False:
            assert base.direct_fd < 0 and frozen.stats.buffered_requests > 0
        assert frozen.stats.requests >= 3  # "c" alone spans several 8 KiB requests
        assert frozen.same_as_file(heads[0], buf) == []
        buf[block.slots[2].offset] ^= 1
        assert frozen.same_as_file(heads[0], buf) == ["c"]
    finally:
        frozen.close()


def test_a_truncated_base_file_is_refused_at_open(tmp_path):
    path = str(tmp_path / "cut.safetensors")
    _crafted(path, {"a": torch.randn(100)}, pad=0)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 300)
    frozen = FrozenFiles()
    try:
        with pytest.raises(ValueError, match="truncated"):
            frozen.open(path)
    finally:
        frozen.close()


def test_frozen_layers_without_lora_read_in_place_bitwise_and_exported(bases, tmp_path):
    """A model (no adapters) whose first two layers are frozen: those blocks have no trainable tail (an empty store
    region), read wholly from the file; the rest trains in the store. Bitwise equal to the same run with the frozen
    layers in the store; ``lightning-nvme export`` of its checkpoint (the base referenced) writes the full Hub
    layout, equal to the model's weights."""
    from safetensors.torch import load_file

    from lightning_nvme.cli import main

    path = bases["llama"]
    runs = {}
    for frozen in ("in_place", "store"):
        root = tmp_path / frozen
        probe = Probe()
        t = trainer(root, _strategy(root, frozen, restore_params=False), steps=STEPS, callbacks=[probe])
        with t.init_module(empty_init=True):
            model = HFCausalLM(path, block_size=16)
        for layer in model.model.model.layers[:2]:
            layer.requires_grad_(False)
        t.fit(model, data())
        t.save_checkpoint(tmp_path / f"{frozen}.ckpt")
        runs[frozen] = (t, probe)
    (t_in, p_in), (_, p_st) = runs["in_place"], runs["store"]
    assert p_in.heads == 2 and p_st.heads == 0
    blocks = t_in.strategy.param_offload.blocks
    assert all(p_in.regions[b.region] <= 4096 for b in blocks[:2])  # of the frozen layers: an empty page at most
    for a, b in zip(p_in.losses, p_st.losses):
        assert torch.equal(a, b)
    exported = {}
    for frozen in ("in_place", "store"):
        out = tmp_path / f"hub-{frozen}"
        assert main(["export", str(tmp_path / f"{frozen}.ckpt"), str(out)]) == 0
        exported[frozen] = load_file(str(out / "model.safetensors"))
    original = load_file(f"{path}/model.safetensors")
    assert exported["in_place"].keys() == exported["store"].keys() == original.keys()
    for key, value in exported["store"].items():
        assert torch.equal(exported["in_place"][key], value), key
    assert torch.equal(exported["in_place"]["model.layers.0.mlp.up_proj.weight"],
                       original["model.layers.0.mlp.up_proj.weight"])  # frozen: the base file's
    assert not torch.equal(exported["in_place"]["model.layers.2.mlp.up_proj.weight"],
                           original["model.layers.2.mlp.up_proj.weight"])  # trained
