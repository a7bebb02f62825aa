"""Sharded checkpoints: each data-parallel rank streams the optimizer state it owns into the same directory.

Layout of ``<name>.ckpt/`` (beside the single-process layout of ``streamed``)::

    checkpoint.pt                          written by rank 0: Lightning's dict; each optimizer entry holds the
                                           param groups, every param's scalar state (``step``) gathered from
                                           all ranks, and a marker naming the shard files, the world size and
                                           the partition (which element ranges each rank owned)
    optimizer-<i>-rank<r>.safetensors      rank r's per-element state of optimizer i, one tensor per owned
                                           element range: ``state.<param index>.<key>[<start>:<stop>]``

Names carry the param index and element range, so resuming at another world size is reading ranges: each
rank reads the ranges it now owns from whichever shard files hold them (``streamed._FileSource``).

The protocol (run by ``NVMeOffloadDDPStrategy``): rank 0 ``begin``s the temp directory
``.<name>.tmp-sharded`` beside the target and broadcasts its name; every rank ``write_shard``s into
it; the ranks agree that all shards were written; rank 0 ``commit``s (metadata, fsync, one atomic
rename) or ``abort``s.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from lightning_nvme.checkpoint.atomic import begin_dir, commit_dir, fsync_path
from lightning_nvme.checkpoint.safetensors_stream import SafetensorsWriter
from lightning_nvme.checkpoint.streamed import FORMAT_VERSION, MARKER, META_FILE, tensor_name
from lightning_nvme.optim import OffloadedOptimizer, Partition, Piece


def shard_file(i: int, rank: int) -> str:
    return f"optimizer-{i}-rank{rank}.safetensors"


def shard_marker(i: int, partition: Partition, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "files": [shard_file(i, r) for r in range(partition.world_size)],
            "world_size": partition.world_size, "partition": partition.to_dict(), "shapes": shapes}


def temp_dir(path: str) -> str:
    """The one temp name of a sharded save of ``path``. Not per process (ranks on other machines write into
    it, and a pid means nothing there): a leftover of a killed save is removed by the next save of ``path``."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.tmp-sharded")


def begin(path: str) -> str:
    """Rank 0: recover an interrupted commit of ``path`` and create the empty temp directory all ranks write to."""
    return begin_dir(path, temp_dir(path))


def _runs(off: OffloadedOptimizer) -> dict[tuple[int, int], tuple[int, int]]:
    """(param index, piece start) -> the maximal run of adjacent initialized pieces it belongs to, so a
    shard holds one entry per owned range, not one per chunk piece."""
    pieces = sorted((p for c in off.chunks for p in c.pieces if off._initialized(p)), key=lambda p: (p.index, p.start))
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


def write_shard(off: OffloadedOptimizer, directory: str, i: int, rank: int) -> str:
    """Stream this rank's state of optimizer ``i`` into ``directory`` (fsynced); returns the file name."""
    runs = _runs(off)
    stored = {p.index: p.stored() for c in off.chunks for p in c.pieces}
    entries = []
    for (index, start), (run_start, run_stop) in sorted(runs.items()):
        if start == run_start:
            entries += [(tensor_name(index, c.name, run_start // c.per, -(-run_stop // c.per)), c.dtype,
                         (-(-run_stop // c.per) - run_start // c.per,)) for c in stored[index]]
    name = shard_file(i, rank)
    writer = SafetensorsWriter(os.path.join(directory, name), entries,
                               {"format": MARKER, "format_version": str(FORMAT_VERSION), "rank": str(rank)})
    try:
        off.export_state(_RangeSink(writer, runs))
    finally:
        writer.close()
    return name


def commit(checkpoint: dict[str, Any], tmp: str, path: str) -> None:
    """Rank 0, after every shard is written: the metadata, then the atomic swap into ``path``."""
    meta = os.path.join(tmp, META_FILE)
    torch.save(checkpoint, meta)
    fsync_path(meta)
    commit_dir(tmp, os.path.abspath(path))


def abort(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
