"""``checkpoint_copy="streamed"``: each optimizer's state file written through memory, chunk by chunk from the store
(memory bounded by the optimizer's ring buffers), straight into its record of the one file (``paired.save_direct``:
reserved first, so the state is written once), fdatasynced. The file's format: ``state_files``; data-parallel shards
(one entry per owned range): ``rank_shards``; the other copy modes: ``reflink``, ``background``."""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_nvme.checkpoint import weights
from lightning_nvme.checkpoint.paired import DirectPart
from lightning_nvme.checkpoint.safetensors_stream import SafetensorsWriter, safetensors_size
from lightning_nvme.checkpoint.state_files import file_metadata, format_entry, optimizer_file, tensor_name
from lightning_nvme.optim import OffloadedOptimizer, Piece


class _FileSink:
    def __init__(self, writer: SafetensorsWriter) -> None:
        self.writer = writer

    def put(self, piece: Piece, key: str, values: torch.Tensor, per: int = 1) -> None:
        self.writer.write(tensor_name(piece.index, key), piece.start // per, values)


def _entries(off: OffloadedOptimizer) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(tensor_name(index, c.name), c.dtype, shape if c.per == 1 else (c.count(math.prod(shape)),))
            for index, shape, comps in off.stored_state() for c in comps]


def optimizer_part(off: OffloadedOptimizer, i: int, save_id: str) -> DirectPart:
    """Optimizer ``i``'s state file as a part written straight into its record of the one file
    (``paired.save_direct``): written once, through memory, chunk by chunk from the store."""
    entries, metadata = _entries(off), file_metadata(save_id)

    def write(fd: int, base: int) -> None:
        writer = SafetensorsWriter(optimizer_file(i), entries, metadata, fd=fd, base=base)
        try:
            off.export_state(_FileSink(writer))
        finally:
            writer.close()
    return DirectPart(optimizer_file(i), safetensors_size(entries, metadata), {"file": optimizer_file(i),
                      **format_entry(off)}, write)


def weights_part(state_dict: dict[str, Any], read_source: weights.ReadSource, save_id: str) -> DirectPart:
    """The beside weights file (``offload_params``) as a part written straight into its record (``weights.write``'s
    bytes, one block in memory at a time)."""
    metadata = file_metadata(save_id)

    def write(fd: int, base: int) -> None:
        weights.write(weights.WEIGHTS_FILE, state_dict, read_source, metadata, fd=fd, base=base)
    return DirectPart(weights.WEIGHTS_FILE, weights.written_size(state_dict, metadata), None, write)
