"""Test helpers for lightning_nvme checkpoints: where a checkpoint's streamed optimizer state is, and a writer of
the old directory format (this lightning_nvme only reads it), to check that old checkpoints still load."""

from __future__ import annotations

import os

import torch

from lightning_nvme.checkpoint.legacy import FORMAT_VERSION, META_FILE
from lightning_nvme.checkpoint.safetensors_stream import SafetensorsWriter
from lightning_nvme.checkpoint.streamed import MARKER, optimizer_file, tensor_name


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
        tensors = {}
        for index, entries in state["state"].items():
            for key in [k for k, v in entries.items() if torch.is_tensor(v) and v.dim() > 0]:
                tensors[tensor_name(index, key)] = entries.pop(key)
        writer = SafetensorsWriter(os.path.join(dst_dir, optimizer_file(i)),
                                   [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()],
                                   {"format": MARKER, "format_version": str(FORMAT_VERSION)})
        for name, t in tensors.items():
            writer.write(name, 0, t.reshape(-1))
        writer.close()
        state[MARKER] = {"format_version": FORMAT_VERSION, "file": optimizer_file(i)}
    torch.save(checkpoint, os.path.join(dst_dir, META_FILE))
