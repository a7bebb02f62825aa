"""Test helpers for lightning_nvme checkpoints: where a checkpoint's streamed optimizer state is, and a writer of
the old directory format (this lightning_nvme only reads it), to check that old checkpoints still load."""

from __future__ import annotations

import os

import torch

from lightning_nvme.checkpoint.convert import pop_state_tensors, write_tensors
from lightning_nvme.checkpoint.legacy import LEGACY_FORMAT_VERSION, META_FILE
from lightning_nvme.checkpoint.streamed import MARKER, optimizer_file


def parts_dir(path) -> str:
    """The directory holding the optimizer files of checkpoint file ``path``."""
    ref = torch.load(path, weights_only=True)["lightning_nvme"]
    return os.path.join(os.path.dirname(os.path.abspath(path)), ref["parts_dir"])


def write_legacy(plain_file, dst_dir) -> None:
    """Write a plain Lightning checkpoint in the old directory format (``checkpoint.pt`` + safetensors), as
    lightning_nvme up to the paired-file format wrote it."""
    checkpoint = torch.load(plain_file, map_location="cpu", weights_only=False)
    os.makedirs(dst_dir)
    for i, state in enumerate(checkpoint.get("optimizer_states", [])):
        write_tensors(os.path.join(dst_dir, optimizer_file(i)), pop_state_tensors(state),
                      {"format": MARKER, "format_version": str(LEGACY_FORMAT_VERSION)})
        state[MARKER] = {"format_version": LEGACY_FORMAT_VERSION, "file": optimizer_file(i)}
    torch.save(checkpoint, os.path.join(dst_dir, META_FILE))
