"""A parameter-offload training run (``offload_params=True``, ``overlap="backward"``) that SIGKILLs itself in
the middle of a step, or resumes from the last checkpoint. ``python param_kill_worker.py SPEC_JSON``.

The kill point is deterministic: when step ``kill_step`` starts, the run arms ``crash_worker``'s injector
to die at the ``kill_at``-th ``pwrite`` to a ``params/*`` region after that instant, i.e. while blocks
updated in backward are being written back (earlier blocks' write-backs and optimizer updates of that
step already in the store, later ones not), optionally writing only part of it first (``torn``).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [HERE, TESTS]

import crash_worker as cw  # noqa: E402


def run(spec: dict) -> None:
    import torch
    from _param_offload_model import TinyGPT
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_nvme import NVMeOffloadStrategy

    torch.set_num_threads(1)
    root = spec["root"]
    inj = cw._Injector(None)
    inj.store_path = os.path.join(root, "store", cw.STORE_FILE)
    inj.root = root
    inj.install()

    class Arm(Callback):
        def on_train_start(self, trainer, pl_module):
            inj.store = trainer.strategy.nvme_store
            with open(os.path.join(root, "placement.json"), "w") as f:  # host_memory_budget's plan of this run
                json.dump(trainer.strategy.shelf_plan.as_dict(), f)
            start = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            torch.save({"global_step": trainer.global_step, "state_dict": start}, os.path.join(root, "start.pt"))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if spec.get("kill_step") == trainer.global_step:
                inj.kill = {"phase": "params", "at": inj.total["params"] + spec["kill_at"], "torn": spec.get("torn")}

    strategy = NVMeOffloadStrategy(store_dir=os.path.join(root, "store"), chunk_bytes=64 << 10, io_chunk_bytes=8 << 10,
                                   io_workers=2, min_free_bytes=0, offload_params=True, overlap="backward",
                                   host_memory_budget=spec.get("host_memory_budget", 0))
    # Checkpoints at epoch ends and max_epochs (not max_steps, nor limit_train_batches): only then does
    # Lightning resume a plain dataloader exactly where the uninterrupted run would be.
    checkpoints = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), save_last=True, save_top_k=-1, every_n_epochs=1)
    trainer = Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", devices=1,
                      max_epochs=spec["epochs"], logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Arm(), checkpoints], num_sanity_val_steps=0)
    model = TinyGPT(batch_size=spec["batch_size"])
    trainer.fit(model, ckpt_path="last" if spec["resume"] else None)
    final = {n: t.detach().clone() for n, t in model.named_parameters()}
    torch.save(final, os.path.join(root, "final.pt"))
    with open(os.path.join(root, "steps"), "w") as f:
        json.dump(trainer.global_step, f)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
