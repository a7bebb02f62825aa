"""Checkpoints of offloaded training: one file Lightning's loaders open, the optimizer state streamed beside
it and committed atomically with it (``paired``); the old directory format is still read (``legacy``);
opening either format (``load``); conversion to and from plain Lightning checkpoints (``convert``)."""

from lightning_nvme.checkpoint import legacy, paired, sharded
from lightning_nvme.checkpoint.legacy import is_legacy_dir
from lightning_nvme.checkpoint.load import load_checkpoint, open_checkpoint
from lightning_nvme.checkpoint.streamed import OptimizerParts, format_entry, optimizer_placeholder, restore_optimizer

__all__ = ["OptimizerParts", "format_entry", "is_legacy_dir", "legacy", "load_checkpoint", "open_checkpoint",
           "optimizer_placeholder", "paired", "restore_optimizer", "sharded"]
