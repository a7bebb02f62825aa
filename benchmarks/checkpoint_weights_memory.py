"""Peak memory of saving an ``offload_params=True`` model: weights streamed beside the file vs gathered inline.

A model of ``--blocks`` Linear(``--width``) blocks is built on the meta device straight into the store
(never whole in memory), trained ``--steps`` steps with ``restore_params=False``, then saved three ways:
``trainer.save_checkpoint`` with the weights streamed beside the file (``inline_weights_bytes=0``), the same
with them gathered into the file (what every save did before), and ``strategy.export_weights``. For each,
the increase of the process's peak RSS over its RSS just before (``VmHWM`` reset through
``/proc/self/clear_refs``). The last line is one JSON object.

    python benchmarks/checkpoint_weights_memory.py [--blocks 40 --width 1536 --dir /path/on/ssd]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import tempfile

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_nvme  # noqa: F401
from lightning_nvme import NVMeOffloadStrategy
from lightning_nvme.constants import MiB
from lightning_nvme.memory import release_freed_memory


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def peak_increase_mib(run) -> float:
    """Peak RSS during ``run()`` minus the RSS just before it."""
    gc.collect()
    release_freed_memory(8 * MiB)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status("VmRSS")
    run()
    return _status("VmHWM") - before


class Stack(LightningModule):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks, self.width = blocks, width

    def configure_model(self) -> None:
        self.layers = nn.ModuleList(nn.Linear(self.width, self.width) for _ in range(self.blocks))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, self.width)), batch_size=4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dir", default=None, help="a directory on the SSD (default: a temp dir)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt_weights_", dir=args.dir)
    strategy = NVMeOffloadStrategy(store_dir=os.path.join(root, "store"), offload_params=True, overlap="backward",
                                   restore_params=False, inline_weights_bytes=0)
    model = Stack(args.blocks, args.width)
    trainer = Trainer(default_root_dir=root, strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(model)
    params = strategy.param_offload
    assert params is not None
    blocks_mib = params.layout.offloaded_bytes / MiB
    out: dict = {"blocks": len(params.blocks), "block_MiB": round(blocks_mib / len(params.blocks), 1),
                 "blocks_MiB": round(blocks_mib, 1)}
    out["beside_save_peak_increase_MiB"] = round(peak_increase_mib(
        lambda: trainer.save_checkpoint(os.path.join(root, "beside.ckpt"))), 1)
    out["export_peak_increase_MiB"] = round(peak_increase_mib(
        lambda: strategy.export_weights(os.path.join(root, "model.safetensors"))), 1)
    strategy.config = dataclasses.replace(strategy.config, inline_weights_bytes=1 << 50)
    out["inline_save_peak_increase_MiB"] = round(peak_increase_mib(
        lambda: trainer.save_checkpoint(os.path.join(root, "inline.ckpt"))), 1)
    out["beside_vs_blocks"] = round(out["beside_save_peak_increase_MiB"] / blocks_mib, 3)
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
