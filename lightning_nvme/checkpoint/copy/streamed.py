"""``checkpoint_copy="streamed"``: each optimizer's state file written through memory, chunk by chunk from the store
(memory bounded by the optimizer's ring buffers), fsynced. The file's format: ``state_files``; data-parallel shards
(one entry per owned range): ``sharded``; the other copy modes: ``reflink``, ``background``."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from lightning_nvme.checkpoint.safetensors_stream import SafetensorsWriter
from lightning_nvme.checkpoint.state_files import file_metadata, format_entry, optimizer_file, tensor_name
from lightning_nvme.optim import OffloadedOptimizer, Piece


class _FileSink:
    def __init__(self, writer: SafetensorsWriter) -> None:
        self.writer = writer

    def put(self, piece: Piece, key: str, values: torch.Tensor, per: int = 1) -> None:
        self.writer.write(tensor_name(piece.index, key), piece.start // per, values)


def write_optimizer(off: OffloadedOptimizer, directory: str, i: int, save_id: str) -> dict[str, Any]:
    """Stream optimizer ``i``'s state into ``directory`` (fsynced); returns its marker (file and state format)."""
    entries = [(tensor_name(index, c.name), c.dtype, shape if c.per == 1 else (c.count(math.prod(shape)),))
               for index, shape, comps in off.stored_state() for c in comps]
    writer = SafetensorsWriter(os.path.join(directory, optimizer_file(i)), entries, file_metadata(save_id))
    try:
        off.export_state(_FileSink(writer))
    finally:
        writer.close()
    return {"file": optimizer_file(i), **format_entry(off)}
