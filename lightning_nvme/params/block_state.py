"""What ``BlockResidency`` and its parts know of each parameter block: its state record, the counters, its buffers.

Why its own module: the residency is composed of parts with explicit arguments (``WriteBacks``,
``params/writeback.py``; ``DeskCopies``, ``params/desk.py``), FSDP2-style state objects rather than mixins. They
share the per-block record (``BlockState``) and the statistics (``ResidencyStats``), defined here below all of them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_nvme.optim.plan import placeholder
from lightning_nvme.params.frozen_files import FrozenFiles, FrozenHead, SplitRead
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.params.transfer import BlockTransfer, TransferStats
from lightning_nvme.store import FlatStore, IOHandle


@dataclass
class ResidencyStats:
    loads: int = 0  # block reads issued
    sync_loads: int = 0  # reads a forward/backward/update had to wait for from the start (not prefetched)
    tail_loads: int = 0  # reads of a block's trainable tail only, for an update (frozen head not read)
    writebacks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    resident_blocks: int = 0
    resident_bytes: int = 0  # bytes in memory now (whole blocks and trainable tails)
    peak_resident_blocks: int = 0
    peak_resident_bytes: int = 0
    bound_blocks: int = 0  # blocks whose parameters point at their values (on an accelerator: device copies)
    peak_bound_blocks: int = 0
    early_uploads: int = 0  # device copies started once a read ahead completed, before the block was needed
    kept_blocks: int = 0  # blocks whose device copy stays bound between uses (``keep``)
    kept_bytes: int = 0
    transfer: TransferStats = field(default_factory=TransferStats)

    def count_bound(self, sign: int) -> None:
        self.bound_blocks += sign
        self.peak_bound_blocks = max(self.peak_bound_blocks, self.bound_blocks)

    def count_written(self, nbytes: int) -> None:
        self.writebacks += 1
        self.bytes_written += nbytes

    def count_in_memory(self, block: BlockLayout, base: int, sign: int) -> None:
        """Whole blocks in memory (``base`` 0), and bytes in memory (whole blocks and trainable tails)."""
        if not base:
            self.resident_blocks += sign
        self.resident_bytes += sign * (block.nbytes - base)
        self.peak_resident_blocks = max(self.peak_resident_blocks, self.resident_blocks)
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)


@dataclass
class BlockState:
    buffer: torch.Tensor | None = None  # uint8, page-aligned host buffer
    device: torch.Tensor | None = None  # what the parameters are views of while bound (CPU: ``buffer``)
    read: IOHandle | SplitRead | None = None
    bound: bool = False  # parameters point into ``device``
    dirty: bool = False
    dirty_whole: bool = False  # frozen parameters changed too (a state dict was loaded): write the whole block
    placed: bool = False  # its values are in the store
    shelved: bool = False  # ``buffer`` is the store's in-memory copy of the region (``FlatStore.shelved``)
    retained: bool = False  # at its last eviction, something (autograd) still held its device copy
    uploaded: Any = None  # a device copy started before the block is bound (``upload_ready``)
    desk: bool = False  # keep its device copy after use (``keep``)
    kept: torch.Tensor | None = None  # that copy once made: the parameters stay bound to it, ``buffer`` is None
    base: int = 0  # region offset of ``buffer[0]``: ``writable_offset`` when only the trainable tail is in memory
    refs: Counter = field(default_factory=Counter)

    @property
    def copied(self) -> bool:
        """The parameters point at a device copy (not at the host buffer itself)."""
        return self.device is not None and self.device is not self.buffer

    def evicted(self) -> None:
        """Nothing of the block in memory any more (its ``placed``, ``retained`` and ``desk`` stay)."""
        self.buffer, self.device, self.read, self.bound, self.dirty, self.dirty_whole = None, None, None, False, False, False
        self.shelved, self.base = False, 0
        self.uploaded = None  # an early copy never used: the allocator frees it after its stream's copy
        self.refs.clear()


def view(buf: torch.Tensor, slot: Any, base: int = 0) -> torch.Tensor:
    """``slot``'s bytes in ``buf``, which holds the region from byte ``base`` on."""
    start = slot.offset - base
    return buf[start:start + slot.nbytes].view(slot.dtype).view(slot.shape)


def placeholders(block: BlockLayout, device: torch.device | None = None) -> None:
    """The block's parameters point at placeholders (on ``device``, default their own): their values are elsewhere."""
    for slot in block.slots:
        slot.param.data = placeholder(slot.shape, slot.dtype, device or slot.param.device)


class BlockBuffers:
    """Host buffers sized for a block: its region's capacity, plus the head read in place (not in the region)."""

    def __init__(self, store: FlatStore, frozen: FrozenFiles | None, transfer: BlockTransfer) -> None:
        self.store = store
        self.frozen = frozen
        self.transfer = transfer

    def capacity(self, block: BlockLayout) -> int:
        head = self.head(block)
        return self.store.region(block.region).capacity + (head.nbytes if head is not None else 0)

    def head(self, block: BlockLayout) -> FrozenHead | None:
        return self.frozen.heads.get(block.index) if self.frozen is not None else None

    def new(self, block: BlockLayout) -> torch.Tensor:
        """Page-aligned and as long as the region: the store moves it with O_DIRECT, no staging copy."""
        return self.transfer.host_buffer(self.capacity(block))
