"""kill -9 in the middle of a step with ``offload_params=True`` and ``overlap="backward"``: the process dies
while the blocks updated in backward are being written back to the store (some blocks and optimizer
chunks of that step updated, others not; optionally a torn write). The last checkpoint must load and a
resume from it must end bitwise equal to an uninterrupted in-memory run (the default strategy).

Only public behaviour is used (``ModelCheckpoint``, ``fit(ckpt_path="last")``, the model's ``state_dict``),
so the test holds whatever format the checkpoint stores offloaded weights in. See ``param_kill_worker.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from lightning.pytorch import Callback, Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from _param_offload_model import TinyGPT  # noqa: E402

EPOCHS, BATCH = 2, 16  # 64 samples: epochs of 4 steps, checkpointed at their ends
EVERY, STEPS, KILL_STEP = 4, 8, 5  # killed in the second step after the checkpoint of step 4


def _job(root, **spec) -> subprocess.CompletedProcess:
    spec = {"root": str(root), "epochs": EPOCHS, "batch_size": BATCH, "resume": False, **spec}
    return subprocess.run([sys.executable, os.path.join(HERE, "param_kill_worker.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=300)


class _At(Callback):
    def __init__(self, step: int) -> None:
        self.step, self.values = step, None

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step == self.step:
            self.values = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted in-memory training: the values after the checkpointed step and at the end."""
    at = _At(EVERY)
    model = TinyGPT(batch_size=BATCH)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker: another thread count may change float summation order
    try:
        Trainer(default_root_dir=tmp_path_factory.mktemp("ref"), accelerator="cpu", devices=1, max_epochs=EPOCHS,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=[at]).fit(model)
    finally:
        torch.set_num_threads(threads)
    return at.values, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_kill9_mid_writeback_resumes_bitwise(tmp_path, reference):
    """Dies at the third block write-back of the step, after writing half of it (a torn write)."""
    at_checkpoint, final = reference
    killed = _job(tmp_path, kill_step=KILL_STEP, kill_at=3, torn=0.5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    dying = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [e["phase"] for e in dying if e["event"] == "dying"] == ["params"]
    assert not (tmp_path / "final.pt").exists()

    resumed = _job(tmp_path, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = torch.load(tmp_path / "start.pt")
    assert start["global_step"] == EVERY  # the last checkpoint (step 4) loaded, not the killed step's state
    for name, value in at_checkpoint.items():
        assert torch.equal(start["state_dict"][name], value), f"{name} differs in the resumed checkpoint"
    got = torch.load(tmp_path / "final.pt")
    assert got.keys() == final.keys() and json.loads(open(tmp_path / "steps").read()) == STEPS
    for name, value in final.items():
        assert torch.equal(got[name], value), f"{name} differs after resuming to step {STEPS}"


def test_kill9_in_a_partly_resident_run_resumes_bitwise_with_another_budget(tmp_path, reference):
    """``host_memory_budget`` keeps two blocks (and what chunks fit) in RAM, the others on the SSD; the kill
    lands in a write-back of a block on the SSD, and what was in RAM dies with the process. The resume (with
    budget 0: everything from the SSD) starts from the checkpoint and ends bitwise equal."""
    at_checkpoint, final = reference
    killed = _job(tmp_path, kill_step=KILL_STEP, kill_at=3, torn=0.5, host_memory_budget=120_000)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    plan = json.loads(open(tmp_path / "placement.json").read())
    assert plan["blocks_on_shelf"] >= 1 and plan["blocks_on_ssd"] >= 1, plan
    assert [e["phase"] for e in map(json.loads, open(tmp_path / "events.jsonl")) if e["event"] == "dying"] == ["params"]

    resumed = _job(tmp_path, resume=True, host_memory_budget=0)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(open(tmp_path / "placement.json").read())["shelf_bytes"] == 0
    start = torch.load(tmp_path / "start.pt")
    assert start["global_step"] == EVERY
    for name, value in at_checkpoint.items():
        assert torch.equal(start["state_dict"][name], value), f"{name} differs in the resumed checkpoint"
    got = torch.load(tmp_path / "final.pt")
    for name, value in final.items():
        assert torch.equal(got[name], value), f"{name} differs after resuming to step {STEPS}"
