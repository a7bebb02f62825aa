"""Sharded checkpoints: each data-parallel rank streams the optimizer state it owns beside the checkpoint file.

``<name>.ckpt.optim/<save id>/optimizer-<i>-rank<r>.safetensors`` holds rank r's per-element state of
optimizer i, one tensor per owned element range: ``state.<param index>.<key>[<start>:<stop>]``. Rank 0's
file ``<name>.ckpt`` (see ``paired``) holds each optimizer's param groups, every param's scalar state
(``step``) gathered from all ranks, and a marker naming the shard files, the world size and the partition.

Names carry the param index and element range, so resuming at another world size is reading ranges: each
rank reads the ranges it now owns from whichever shard files hold them (``state_files._FileSource``).

The protocol (run by ``NVMeOffloadDDPStrategy``): rank 0 ``paired.begin``s and broadcasts the temp
directory and save id; every rank ``write_shard``s into it; the ranks agree that all shards were written;
rank 0 publishes them and switches the file in (``paired``), or aborts.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_nvme.checkpoint.copy import reflink as reflink_copy
from lightning_nvme.checkpoint.safetensors_stream import SafetensorsWriter
from lightning_nvme.checkpoint.state_files import file_metadata, tensor_name
from lightning_nvme.optim import OffloadedOptimizer, Partition, Piece


def shard_file(i: int, rank: int) -> str:
    return f"optimizer-{i}-rank{rank}.safetensors"


def shard_marker(i: int, partition: Partition, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    return {"files": [shard_file(i, r) for r in range(partition.world_size)],
            "world_size": partition.world_size, "partition": partition.to_dict(), "shapes": shapes}


def _runs(off: OffloadedOptimizer) -> dict[tuple[int, int], tuple[int, int]]:
    """(param index, piece start) -> the maximal run of adjacent initialized pieces it belongs to, so a
    shard holds one entry per owned range, not one per chunk piece."""
    pieces = sorted(off.initialized_pieces(), key=lambda p: (p.index, p.start))
    runs: list[list[Piece]] = []
    for p in pieces:
        if runs and runs[-1][-1].index == p.index and runs[-1][-1].stop == p.start:
            runs[-1].append(p)
        else:
            runs.append([p])
    return {(p.index, p.start): (run[0].start, run[-1].stop) for run in runs for p in run}


class _RangeSink:
    def __init__(self, writer: SafetensorsWriter, runs: dict[tuple[int, int], tuple[int, int]]) -> None:
        self.writer = writer
        self.runs = runs

    def put(self, piece: Piece, key: str, values: torch.Tensor, per: int = 1) -> None:
        start, stop = self.runs[(piece.index, piece.start)]
        self.writer.write(tensor_name(piece.index, key, start // per, -(-stop // per)), (piece.start - start) // per,
                          values)


def write_shard(off: OffloadedOptimizer, directory: str, i: int, rank: int, save_id: str) -> str:
    """Stream this rank's state of optimizer ``i`` into ``directory`` (fsynced); returns the file name."""
    runs = _runs(off)
    stored = {p.index: p.stored() for r in off.regions() for p in r.stored}
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for (index, start), (run_start, run_stop) in sorted(runs.items()):
        if start == run_start:
            entries += [(tensor_name(index, c.name, run_start // c.per, -(-run_stop // c.per)), c.dtype,
                         (-(-run_stop // c.per) - run_start // c.per,)) for c in stored[index]]
    name = shard_file(i, rank)
    writer = SafetensorsWriter(os.path.join(directory, name), entries, file_metadata(save_id, rank=str(rank)))
    try:
        off.export_state(_RangeSink(writer, runs))
    finally:
        writer.close()
    return name


def clone_shard(off: OffloadedOptimizer, directory: str, i: int, rank: int, save_id: str, block: int) -> tuple[str, int]:
    """``write_shard`` as clones of this rank's own store regions (``reflink_copy.write_state``; the store fenced and
    fdatasynced): the same values, one entry per chunk piece instead of per owned range, which every reader (resume
    at any world size, ``convert``) assembles alike. Returns the file name and the bytes cloned."""
    name = shard_file(i, rank)
    return name, reflink_copy.write_state(off, os.path.join(directory, name), file_metadata(save_id, rank=str(rank)),
                                      block)
