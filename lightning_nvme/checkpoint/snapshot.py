"""Optimizer state files made of reflinks to the store: a checkpoint that writes its header and nothing else.

Where the store's filesystem shares extents (``lightning_nvme.reflink``), ``optimizer-<i>.safetensors`` is laid
out as the store's chunks themselves: a header padded to a filesystem block, then each chunk region with state,
cloned whole (``FICLONERANGE``) at a block-aligned offset. Each piece's state is one entry inside its chunk's
bytes (``state.<index>.<key>`` for a whole parameter, ``state.<index>.<key>[<start>:<stop>]`` for a range, as
data-parallel shards name them); the bytes between entries (slot alignment, a chunk's unused tail, pieces without
state) are ``pad.<n>`` entries, so the file stays a standard safetensors file and every reader of the streamed
format (resume, ``convert``) reads it unchanged. Training's next writes to the store go to new extents (copy on
write), so the file keeps the state of the instant it was cloned: after the store's fence and fdatasync.

Why whole regions: chunk regions start and end on 4 KiB boundaries, the pieces inside them do not; cloning the
region keeps every clone block-aligned and the written bytes independent of how pieces are packed.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_nvme import fsinfo, reflink
from lightning_nvme.checkpoint import weights
from lightning_nvme.checkpoint.safetensors_stream import DTYPES
from lightning_nvme.checkpoint.streamed import PAD_PREFIX, file_metadata, format_entry, optimizer_file, tensor_name
from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.store import FlatStore
from lightning_nvme.store.buffers import memview

log = logging.getLogger(__name__)

@dataclass
class SaveRecord:
    """How one save wrote its streamed state: ``path`` is ``"reflink"`` or ``"streamed"`` (with ``reason``)."""

    path: str
    checkpoint: str
    reason: str = ""
    seconds: float = 0.0
    bytes_written: int = 0  # bytes this save wrote into its state files (headers for reflink)
    bytes_cloned: int = 0  # bytes shared with the store instead of written
    files: list[str] = field(default_factory=list)

    def describe(self) -> str:
        moved = (f"{self.bytes_cloned} bytes cloned, {self.bytes_written} written" if self.path == "reflink"
                 else f"{self.bytes_written} bytes written" + (f" ({self.reason})" if self.reason else ""))
        return f"checkpoint {self.checkpoint}: {self.path} save in {self.seconds:.3f} s, {moved}"


def choose(store: FlatStore, checkpoint_path: str, regions: list[str]) -> tuple[bool, str]:
    """Whether this save can clone ``regions`` of ``store`` into ``checkpoint_path``'s directory, and if not why."""
    directory = os.path.dirname(os.path.abspath(checkpoint_path))
    os.makedirs(directory, exist_ok=True)
    if len(getattr(store, "paths", [store.path])) > 1:
        return False, "the store is striped over several files (store_dir lists several directories)"
    if not reflink.same_filesystem(store.path, directory):
        return False, (f"the checkpoint directory {directory} is not on the store's filesystem ({store.directory}); "
                       "a reflink cannot cross filesystems")
    support = reflink.probe(directory)
    if not support.supported:
        return False, support.reason
    bs = support.block_size
    bad = [r for r in regions if store.region(r).offset % bs or store.region(r).capacity % bs]
    if bad:
        return False, (f"store regions ({bad[0]}, ...) are not aligned to the filesystem block size {bs}: "
                       "clones need block-aligned ranges")
    return True, ""


@dataclass
class _Entry:
    name: str
    dtype: str
    shape: list[int]
    begin: int  # relative to the data start
    end: int


def layout(off: OffloadedOptimizer) -> tuple[list[_Entry], list[tuple[str, int, int]]]:
    """The file's entries, and the (region name, file data offset, bytes) of each chunk region to clone or copy
    (the background path, ``checkpoint.background``, copies the same layout byte for byte)."""
    entries: list[_Entry] = []
    clones: list[tuple[str, int, int]] = []
    pos = 0
    store = off.store
    assert store is not None, "the optimizer's store is closed"
    for chunk in off.chunks:
        pieces = [p for p in chunk.pieces if off.initialized(p)]
        if not pieces:
            continue
        region = store.region(chunk.region)
        items = []
        for piece in pieces:
            for comp in piece.stored():
                count = comp.count(piece.numel)
                name = (tensor_name(piece.index, comp.name) if piece.whole else
                        tensor_name(piece.index, comp.name, piece.start // comp.per, piece.start // comp.per + count))
                shape = list(piece.param.shape) if piece.whole and comp.per == 1 else [count]
                begin = pos + piece.slots[comp.name]
                items.append(_Entry(name, DTYPES[comp.dtype], shape, begin, begin + count * comp.dtype.itemsize))
        _padded(items, pos, pos + region.capacity, entries)
        clones.append((chunk.region, pos, region.capacity))
        pos += region.capacity
    return entries, clones


def header(entries: list[_Entry], metadata: dict[str, str], block: int) -> bytes:
    """``<u64 length><json>`` padded with spaces so the data starts on a filesystem block."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": e.shape, "data_offsets": [e.begin, e.end]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % block)
    return struct.pack("<Q", len(blob)) + blob


def write_optimizer(off: OffloadedOptimizer, directory: str, i: int, save_id: str, block: int) -> tuple[dict, int]:
    """Optimizer ``i``'s state file in ``directory`` as clones of its store regions (fsynced); returns its marker
    (as ``streamed.write_optimizer``'s, plus the param shapes its range entries need) and the bytes cloned.
    The caller has fenced and fdatasynced the store: a clone copies what is on disk."""
    entries, regions = layout(off)
    head = header(entries, file_metadata(save_id), block)
    store = off.store
    assert store is not None
    clones = [(store.region(name).offset, pos, n) for name, pos, n in regions]
    _write_file(os.path.join(directory, optimizer_file(i)), store.path, head, clones,
                entries[-1].end if entries else 0, block)
    marker = {"file": optimizer_file(i), **format_entry(off), "shapes": [list(p.shape) for p in off.params]}
    return marker, sum(n for _, _, n in clones)


def _write_file(path: str, store_path: str, head: bytes, clones: list[tuple[int, int, int]], end: int, block: int,
                writes: Callable[[int], None] = lambda fd: None) -> None:
    """Header, clones ``(store offset, data offset, bytes)``, then ``writes(fd)``; sized and fsynced."""
    src = os.open(store_path, os.O_RDONLY)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, head, 0)
            for offset, data_offset, nbytes in clones:
                reflink.clone_range(src, offset, fd, len(head) + data_offset, nbytes, block)
            writes(fd)
            os.ftruncate(fd, len(head) + end)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.close(src)


def _padded(items: list[_Entry], start: int, end: int, entries: list[_Entry]) -> None:
    """Append ``items`` (sorted, inside ``[start, end)``) to ``entries`` with padding entries in every gap."""
    pos = start
    for item in sorted(items, key=lambda e: e.begin):
        if item.begin > pos:
            entries.append(_Entry(f"{PAD_PREFIX}{len(entries)}", "U8", [item.begin - pos], pos, item.begin))
        entries.append(item)
        pos = item.end
    if end > pos:
        entries.append(_Entry(f"{PAD_PREFIX}{len(entries)}", "U8", [end - pos], pos, end))


Written = list[tuple[weights.BesideWeight, str]]  # beside weights written from memory: (reference, slot)


def weights_layout(state_dict: dict[str, Any], store: FlatStore, in_store: Callable[[Any], bool]
                   ) -> tuple[list[_Entry], list[tuple[str, int, int]], Written, int]:
    """The beside weights file's entries: those of blocks whose current values are in the store (``in_store(block)``)
    inside their block region, taken whole ((region name, data offset, bytes) each, as ``layout``); the others (a
    block resident and changed, a second name of one parameter) after them, written from memory. Also the data's
    end."""
    entries: list[_Entry] = []
    regions: list[tuple[str, int, int]] = []
    written: Written = []
    by_block: dict[int, list[weights.BesideWeight]] = {}
    for ref in weights.refs(state_dict).values():
        by_block.setdefault(id(ref.source[0]), []).append(ref)
    pos = 0
    for refs in by_block.values():
        source = refs[0].source[0]
        if not in_store(source):
            written += [(ref, ref.source[1]) for ref in refs]
            continue
        region, slots, used = store.region(source.region), {s.name: s for s in source.slots}, set()
        items = []
        for ref in refs:
            slot = slots.get(ref.source[1])
            if slot is None or slot.name in used or slot.dtype != ref.torch_dtype:
                written.append((ref, ref.source[1]))
                continue
            used.add(slot.name)
            items.append(_Entry(ref.key, ref.dtype, list(ref.shape), pos + slot.offset, pos + slot.offset + slot.nbytes))
        if items:
            _padded(items, pos, pos + region.capacity, entries)
            regions.append((source.region, pos, region.capacity))
            pos += region.capacity
    for ref, _ in written:
        nbytes = math.prod(ref.shape) * ref.torch_dtype.itemsize
        entries.append(_Entry(ref.key, ref.dtype, list(ref.shape), pos, pos + nbytes))
        pos += nbytes
    return entries, regions, written, pos


def write_values(fd: int, data_start: int, entries: list[_Entry], written: Written,
                 read_source: weights.ReadSource) -> None:
    """Write the ``written`` weights at their entries' offsets, one block's values in memory at a time."""
    at = {e.name: e.begin for e in entries}
    groups: dict[int, Written] = {}
    for ref, slot in written:
        groups.setdefault(id(ref.source[0]), []).append((ref, slot))
    for group in groups.values():
        values = read_source(group[0][0].source[0])
        for ref, slot in group:
            data = values[slot].contiguous()
            view = memview(data.data_ptr(), data.numel() * data.element_size())
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], data_start + at[ref.key] + done)
        del values


def write_weights(path: str, state_dict: dict[str, Any], store: FlatStore, in_store: Callable[[Any], bool],
                  read_source: weights.ReadSource, metadata: dict[str, str], block: int) -> int:
    """``weights.write`` as clones of the block regions (``weights_layout``); returns the bytes cloned."""
    entries, regions, written, end = weights_layout(state_dict, store, in_store)
    head = header(entries, dict(metadata), block)
    clones = [(store.region(name).offset, pos, n) for name, pos, n in regions]
    _write_file(path, store.path, head, clones, end, block,
                lambda fd: write_values(fd, len(head), entries, written, read_source))
    return sum(n for _, _, n in regions)


class CheckpointSpaceError(OSError):
    """A save refused before it wrote anything: the checkpoint's filesystem cannot hold it."""


def weight_bytes(checkpoint: dict[str, Any]) -> int:
    """Bytes of the weights a save writes: the file's tensors and the weights streamed beside it."""
    state = checkpoint.get("state_dict") or {}
    inline = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return inline + sum(math.prod(r.shape) * r.torch_dtype.itemsize for r in weights.refs(state).values())


def check_space(path: str, needed: int, how: str) -> None:
    """Refuse a save of ``needed`` bytes into ``path``'s directory before it writes anything, naming the bytes."""
    free = shutil.disk_usage(fsinfo.existing_ancestor(os.path.dirname(os.path.abspath(path)))).free
    if needed > free:
        raise CheckpointSpaceError(errno.ENOSPC, f"checkpoint {path} ({how}) needs {needed} bytes "
                                   f"({needed / 2**30:.2f} GiB) but {free} bytes ({free / 2**30:.2f} GiB) are free "
                                   f"there; nothing was written. Free {needed - free} bytes, keep fewer checkpoints "
                                   "(save_top_k), or save to a larger disk.")


def timed(record: SaveRecord, t0: float) -> SaveRecord:
    record.seconds = time.perf_counter() - t0
    log.info(record.describe())
    return record
