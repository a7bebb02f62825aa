"""``checkpoint_copy="reflink"``: optimizer state files made of reflinks to the store, a save that writes headers only.

Where the store's filesystem shares extents (``lightning_nvme.fs.reflink``), ``optimizer-<i>.safetensors`` is laid
out as the store's chunks themselves: a header padded to a filesystem block, then each chunk region with state,
cloned whole (``FICLONERANGE``) at a block-aligned offset. Each piece's state is one entry inside its chunk's
bytes (``state.<index>.<key>`` for a whole parameter, ``state.<index>.<key>[<start>:<stop>]`` for a range, as
data-parallel shards name them); the bytes between entries (slot alignment, a chunk's unused tail, pieces without
state) are ``pad.<n>`` entries, so the file stays a standard safetensors file and every reader of the streamed
format (resume, ``convert``) reads it unchanged. Training's next writes to the store go to new extents (copy on
write), so the file keeps the state of the instant it was cloned: after the store's fence and fdatasync.

Why whole regions: chunk regions start and end on 4 KiB boundaries, the pieces inside them do not; cloning the
region keeps every clone block-aligned and the written bytes independent of how pieces are packed. A striped
store's region is cloned one stripe unit at a time, each from the file that holds it (``FlatStore.extents``), into
one state file: the same file as from one directory; ``stripe_bytes`` must then be a multiple of the block.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_nvme.checkpoint import weights
from lightning_nvme.checkpoint.safetensors_stream import DTYPES
from lightning_nvme.checkpoint.state_files import PAD_PREFIX, file_metadata, format_entry, optimizer_file, tensor_name
from lightning_nvme.checks import ConfigError
from lightning_nvme.fs import reflink
from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.store import FlatStore
from lightning_nvme.store.aligned import memview

log = logging.getLogger(__name__)

def choose(store: FlatStore, checkpoint_path: str, regions: list[str]) -> tuple[bool, str]:
    """Whether this save can clone ``regions`` of ``store`` into ``checkpoint_path``'s directory, and if not why.
    A striped store clones each stripe unit from its own file, so every stripe file must be on the checkpoint's
    filesystem and every unit block-aligned."""
    directory = os.path.dirname(os.path.abspath(checkpoint_path))
    os.makedirs(directory, exist_ok=True)
    for path in store.paths:
        if not reflink.same_filesystem(path, directory):
            what = ("the store's filesystem" if len(store.paths) == 1 else
                    f"the filesystem of the store's stripe file {path}")
            return False, (f"the checkpoint directory {directory} is not on {what} ({os.path.dirname(path)}); "
                           "a reflink cannot cross filesystems")
    support = reflink.probe(directory)
    if not support.supported:
        return False, support.reason
    bs = support.block_size
    if len(store.paths) > 1 and store.stripe_map.stripe_bytes % bs:
        return False, (f"the store's stripe_bytes ({store.stripe_map.stripe_bytes}) is not a multiple of the "
                       f"filesystem block size {bs}: clones need block-aligned ranges")
    bad = [r for r in regions if store.region(r).capacity % bs
           or any(file_off % bs or n % bs for _, file_off, _, n in store.extents(r))]
    if bad:
        return False, (f"store regions ({bad[0]}, ...) are not aligned to the filesystem block size {bs}: "
                       "clones need block-aligned ranges")
    return True, ""


def plan(store: FlatStore, path: str, regions: list[str], checkpoint_copy: str, strategy: str) -> tuple[bool, str]:
    """Whether a save to ``path`` clones ``regions`` of ``store`` (the setting ``checkpoint_copy``), and if not why;
    ``"reflink"`` refuses (``ConfigError``) where clones are impossible instead of streaming."""
    if checkpoint_copy == "streamed":
        return False, "checkpoint_copy='streamed'"
    clone, reason = choose(store, path, regions)
    if not clone and checkpoint_copy == "reflink":
        raise ConfigError("checkpoint_copy", f"{strategy}: 'reflink' is set but {path} cannot be a reflink "
                          f"snapshot of the store: {reason}. Put the checkpoints on the store's XFS/btrfs "
                          "filesystem, or set checkpoint_copy='auto' (streamed where clones are impossible).")
    return clone, reason


# One clone: (source file, offset in it, offset in the state file's data, bytes).
Clone = tuple[str, int, int, int]


def _region_clones(store: FlatStore, name: str, pos: int) -> list[Clone]:
    """The clones that place region ``name`` whole at data offset ``pos``: one per stripe unit (one piece unstriped)."""
    return [(path, file_off, pos + a, n) for path, file_off, a, n in store.extents(name)]


@dataclass
class _Entry:
    name: str
    dtype: str
    shape: list[int]
    begin: int  # relative to the data start
    end: int


def layout(off: OffloadedOptimizer) -> tuple[list[_Entry], list[tuple[str, int, int]]]:
    """The file's entries, and the (region name, file data offset, bytes) of each chunk region with state in it,
    placed whole (the reflink path clones them, the background path, ``copy.background``, copies them)."""
    entries: list[_Entry] = []
    regions: list[tuple[str, int, int]] = []
    pos = 0
    store = off.store
    assert store is not None, "the optimizer's store is closed"
    for state_region in off.regions():
        if not state_region.stored:
            continue
        region = store.region(state_region.name)
        items = []
        for piece in state_region.stored:
            for comp in piece.stored():
                count = comp.count(piece.numel)
                name = (tensor_name(piece.index, comp.name) if piece.whole else
                        tensor_name(piece.index, comp.name, piece.start // comp.per, piece.start // comp.per + count))
                shape = list(piece.param.shape) if piece.whole and comp.per == 1 else [count]
                begin = pos + piece.slots[comp.name]
                items.append(_Entry(name, DTYPES[comp.dtype], shape, begin, begin + count * comp.dtype.itemsize))
        _padded(items, pos, pos + region.capacity, entries)
        regions.append((state_region.name, pos, region.capacity))
        pos += region.capacity
    return entries, regions


def _clones(store: FlatStore, regions: list[tuple[str, int, int]]) -> list[Clone]:
    return [c for name, pos, _ in regions for c in _region_clones(store, name, pos)]


def header(entries: list[_Entry], metadata: dict[str, str], block: int) -> bytes:
    """``<u64 length><json>`` padded with spaces so the data starts on a filesystem block."""
    head: dict[str, Any] = {"__metadata__": metadata}
    for e in entries:
        head[e.name] = {"dtype": e.dtype, "shape": e.shape, "data_offsets": [e.begin, e.end]}
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % block)
    return struct.pack("<Q", len(blob)) + blob


def write_optimizer(off: OffloadedOptimizer, directory: str, i: int, save_id: str, block: int) -> tuple[dict, int]:
    """Optimizer ``i``'s state file in ``directory`` as clones of its store regions (fsynced); returns its marker
    (as ``streamed.optimizer_part``'s, plus the param shapes its range entries need) and the bytes cloned.
    The caller has fenced and fdatasynced the store: a clone copies what is on disk."""
    cloned = write_state(off, os.path.join(directory, optimizer_file(i)), file_metadata(save_id), block)
    marker = {"file": optimizer_file(i), **format_entry(off), "shapes": [list(p.shape) for p in off.params]}
    return marker, cloned


def write_state(off: OffloadedOptimizer, path: str, metadata: dict[str, str], block: int) -> int:
    """The state file ``path`` of ``off``'s (initialized) state as clones of its store regions, fsynced; returns the
    bytes cloned. A data-parallel rank's shard is this file of its own store (its pieces are ranges, named so)."""
    store = off.store
    assert store is not None, "the optimizer's store is closed"
    entries, regions = layout(off)
    clones = _clones(store, regions)
    _write_file(path, header(entries, metadata, block), clones, entries[-1].end if entries else 0, block)
    return sum(n for *_, n in clones)


def _write_file(path: str, head: bytes, clones: list[Clone], end: int, block: int,
                writes: Callable[[int], None] = lambda fd: None) -> None:
    """Header, the clones (each from its store file), then ``writes(fd)``; sized and fsynced."""
    sources: dict[str, int] = {}
    try:
        for source in dict.fromkeys(c[0] for c in clones):
            sources[source] = os.open(source, os.O_RDONLY)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, head, 0)
            for source, offset, data_offset, nbytes in clones:
                reflink.clone_range(sources[source], offset, fd, len(head) + data_offset, nbytes, block)
            writes(fd)
            os.ftruncate(fd, len(head) + end)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        for src in sources.values():
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
    clones = _clones(store, regions)
    _write_file(path, head, clones, end, block, lambda fd: write_values(fd, len(head), entries, written, read_source))
    return sum(n for *_, n in clones)
