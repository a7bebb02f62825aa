"""``WriteBacks``: a parameter block's changed bytes on their way back to the store, bounded.

A write-back waits first for its device -> host copy (``Ready``: none on CPU), then is in flight to the store;
copies waiting plus writes in flight stay within ``max_pending`` (the oldest is waited for), so the host buffers
they hold are bounded. Why its own object: ``BlockResidency`` decides *when* a block goes back (its last holder let
go, the end of fit); this queue only orders and bounds the bytes going back, with its arguments explicit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from lightning_nvme.params.frozen_files import FrozenFiles, split_write, wait_io
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.params.transfer import DONE, BlockTransfer, Ready
from lightning_nvme.store import FlatStore, IOHandle


class WriteBacks:
    """Write-backs waiting for their device -> host copy, then in flight to the store (together bounded).

    Args:
        store: where the blocks' regions are.
        frozen: blocks whose frozen head is read in place from base files (their writes start at the tail).
        transfer: the copies' owner; a written buffer goes back to it (``recycle``).
        max_pending: copies waiting plus writes in flight, at most.
        issued: told the bytes of each write-back handed to the store (the owner's statistics).
    """

    def __init__(self, store: FlatStore, frozen: FrozenFiles | None, transfer: BlockTransfer, max_pending: int,
                 issued: Callable[[int], None]) -> None:
        self.store = store
        self.frozen = frozen
        self.transfer = transfer
        self.max_pending = max_pending
        self.issued = issued
        self._copies: deque[tuple[BlockLayout, torch.Tensor, int, Ready, int]] = deque()
        self._writes: deque[tuple[IOHandle | None, torch.Tensor]] = deque()

    def add(self, block: BlockLayout, buf: torch.Tensor, start: int = 0, ready: Ready = DONE, base: int = 0) -> None:
        """Write the region's bytes from ``start`` on (page-aligned), held in ``buf`` from region byte ``base``,
        once ``ready`` (the copy filling ``buf``) has completed."""
        start -= base
        if start >= buf.numel():  # nothing to write (unreachable today: a trainable tail is never empty)
            ready.synchronize()  # the device -> host copy may still write into the buffer
            self.transfer.recycle(buf)
            return
        self._copies.append((block, buf, start, ready, base))
        self.issue()

    def issue(self, force: bool = False, of: BlockLayout | None = None) -> None:
        """Hand write-backs whose copy has completed to the store, in order; with ``force`` (or ``of`` a
        block that has one waiting), all of them, waiting for their copies. Copies waiting plus writes in
        flight stay within ``max_pending`` (the oldest is waited for)."""
        force = force or any(b is of for b, *_ in self._copies)
        while self._copies and (force or self._copies[0][3].query()
                                or len(self._copies) + len(self._writes) > self.max_pending):
            block, buf, start, ready, base = self._copies.popleft()
            ready.synchronize()
            self._writes.append((split_write(self.store, self.frozen, block, buf[start:], base + start), buf))
            self.issued(buf.numel() - start)
            while self._writes and len(self._writes) + len(self._copies) > self.max_pending:
                self._wait_oldest()

    def drain(self) -> None:
        """Wait for every write-back in flight (their buffers are then freed)."""
        self.issue(force=True)
        while self._writes:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        handle, buf = self._writes.popleft()
        wait_io(self.store, handle)
        self.transfer.recycle(buf)
