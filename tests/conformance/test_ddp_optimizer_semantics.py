"""``nvme_offload_ddp`` follows the optimizer like the single-device strategy where ranks can agree: plain SGD
(no per-element state) steps on every rank bit for bit as plain DDP does, and a parameter that becomes
trainable after setup is refused clearly (the partition is fixed at setup), never skipped.

Lightning's launcher starts the 2 processes: the test runs this file as a script (``python FILE SPEC.json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ddp_semantics")
    runs = [{"name": n, "strategy": s, "overlap": o, "unfreeze": u, "root": str(tmp / n)}
            for n, s, o, u in [("ddp", "ddp", "step", False), ("offload", "offload", "step", False),
                               ("unfreeze", "offload", "step", True)]]
    spec = tmp / "spec.json"
    spec.write_text(json.dumps(runs))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(spec)], env=env, timeout=900,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {r["name"]: [torch.load(os.path.join(r["root"], f"rank{k}.pt"), weights_only=False) for k in range(2)]
            for r in runs}


def test_plain_sgd_steps_like_ddp_on_every_rank(ranks):
    for rank in range(2):
        ref, off = ranks["ddp"][rank]["params"], ranks["offload"][rank]["params"]
        for key, p in ref.items():
            assert torch.equal(p, off[key]), f"rank {rank}: {key} differs from plain DDP"
    assert not torch.equal(ranks["ddp"][0]["params"]["head.weight"], ranks["ddp"][0]["initial"]["head.weight"])


def test_growing_the_plan_is_refused_under_ddp(ranks):
    for rank in range(2):
        error = ranks["unfreeze"][rank]["error"]
        assert "became trainable after fit started" in error and "nvme_offload" in error, error


# ---- the worker side (run by Lightning in every rank) ------------------------------------------------------------
def _worker(spec_path: str) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy

    from conformance._lightning_models import Net
    from conformance.test_optimizer_semantics import UnfreezeAt
    from lightning_nvme import NVMeOffloadDDPStrategy
    from lightning_nvme.optim import UnsupportedOptimizerError

    for run in json.loads(open(spec_path).read()):
        model = Net(lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01), frozen_backbone=run["unfreeze"])
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        strategy = DDPStrategy() if run["strategy"] == "ddp" else NVMeOffloadDDPStrategy(
            store_dir=os.path.join(run["root"], "store"), chunk_bytes=4096, overlap=run["overlap"])
        trainer = Trainer(default_root_dir=run["root"], strategy=strategy, accelerator="cpu", devices=2, max_steps=6,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=[UnfreezeAt(2)] if run["unfreeze"] else [])
        error = None
        try:
            trainer.fit(model)
        except UnsupportedOptimizerError as e:
            error = str(e)
        os.makedirs(run["root"], exist_ok=True)
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "initial": initial,
                    "error": error}, os.path.join(run["root"], f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    _worker(sys.argv[1])
