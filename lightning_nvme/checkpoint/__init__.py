"""Streamed, atomically committed checkpoints of offloaded training state, and conversion to/from
plain Lightning checkpoints."""

from lightning_nvme.checkpoint import sharded
from lightning_nvme.checkpoint.streamed import (FORMAT_VERSION, format_entry, is_streamed, load_streamed, optimizer_placeholder,
                                                remove_streamed, restore_optimizer, save_streamed)

__all__ = ["FORMAT_VERSION", "format_entry", "is_streamed", "load_streamed", "optimizer_placeholder", "remove_streamed",
           "restore_optimizer", "save_streamed", "sharded"]
