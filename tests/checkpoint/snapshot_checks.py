"""Checks shared by the snapshot tests (reflink, background, striped reflink): what a copied checkpoint must equal.

Why one home: the reflink and background paths promise the same thing (the checkpoint is the state of the save's
instant, in the streamed layout, and resumes bitwise), so they are checked by the same code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from lightning_nvme.checkpoint import convert

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers; test_param_offload in params/


def optimizer_tensors(path, tmp) -> list[dict]:
    """The optimizer states of checkpoint ``path``, through the converter (every tensor read)."""
    plain = os.path.join(tmp, os.path.basename(str(path)) + ".plain")
    convert.to_lightning(str(path), plain)
    return torch.load(plain, weights_only=False)["optimizer_states"]


def state_tensors(states: list[dict]) -> list[tuple[int, str]]:
    """(param index, key) of every non-scalar state tensor of the first optimizer."""
    return [(i, k) for i, st in states[0]["state"].items() for k, v in st.items() if torch.is_tensor(v) and v.dim()]


def assert_snapshot_is_the_saved_state(snap, copy, final, tmp) -> None:
    """``snap`` (a reflink or background checkpoint) holds bit for bit the optimizer state of ``copy`` (a streamed
    save of the same instant), which training has changed since (``final``, saved later)."""
    saved, copied, last = (optimizer_tensors(p, tmp) for p in (snap, copy, final))
    tensors = state_tensors(copied)
    assert tensors
    for i, k in tensors:
        assert torch.equal(saved[0]["state"][i][k], copied[0]["state"][i][k]), (i, k)
    assert any(not torch.equal(saved[0]["state"][i][k], last[0]["state"][i][k]) for i, k in tensors)
    assert saved[0]["state"][tensors[0][0]]["step"] == copied[0]["state"][tensors[0][0]]["step"]


def assert_saves_equal_the_instant(a, b, params: dict[str, torch.Tensor], tmp) -> None:
    """Checkpoints ``a`` and ``b`` hold the weights ``params`` of the saved instant and the same optimizer state."""
    saved_a, saved_b = (torch.load(p, weights_only=True)["state_dict"] for p in (a, b))
    for name, p in params.items():
        assert torch.equal(saved_a[name], p) and torch.equal(saved_b[name], p), name
    for s, r in zip(optimizer_tensors(a, tmp), optimizer_tensors(b, tmp)):
        for index, entries in r["state"].items():
            for key, v in entries.items():
                assert torch.equal(s["state"][index][key], v) if torch.is_tensor(v) else s["state"][index][key] == v


def assert_tiny_gpt_resumes_bitwise(ckpt, store_dir, tmp_path, ref: torch.nn.Module, after_step: int) -> None:
    """``TinyGPT`` resumed from ``ckpt`` in a new process with its parameter store in ``store_dir`` ends with the
    parameters of ``ref`` (the same save and resume in memory), past ``after_step``."""
    script = f"""
import sys, json, torch
sys.path[:0] = [{os.path.join(TESTS, 'params')!r}, {TESTS!r}]
from test_param_offload import offload, trainer
from _param_offload_model import TinyGPT
from pathlib import Path
model = TinyGPT()
t = trainer({str(tmp_path / 'c')!r}, offload(Path({str(store_dir)!r})))
t.fit(model, ckpt_path={str(ckpt)!r})
torch.save(dict(model.named_parameters()), {str(tmp_path / 'resumed.pt')!r})
print(json.dumps({{"step": t.global_step}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = torch.load(tmp_path / "resumed.pt")
    assert json.loads(out.stdout.strip().splitlines()[-1])["step"] > after_step
    for name, p in ref.named_parameters():
        assert torch.equal(resumed[name], p), name
