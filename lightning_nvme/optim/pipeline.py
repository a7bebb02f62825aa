"""``ReadAhead``: the chunk reads an offloaded optimizer keeps in flight ahead of its update.

Why: the step is bound by the disk. Reads for the first chunks start on entry to ``step`` (while the
closure still runs forward and backward) and, during the update, up to ``depth`` chunks are read ahead of
the one being updated, each into a buffer of the ring. The store orders a read after the last write to the
same bytes, so a chunk is never updated from stale state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lightning_nvme.optim.buffers import ChunkBuffer, ChunkRing
from lightning_nvme.optim.plan import Chunk
from lightning_nvme.store import FlatStore, IOHandle

MIN_RING_BYTES = 4096  # a ring's buffer size when no chunk is planned yet (one page)


class ReadAhead:
    """Reads of ``chunks`` (a list the plan may extend) into a ring of ``depth + 2`` buffers: ``depth`` read
    ahead, one being updated, one being written back. ``capacity``: chunk index -> its region's bytes;
    ``needs_read(chunk)``: whether it holds state yet (a chunk without any gets a buffer and no read).
    ``pin``: the parameters are on CUDA, whose copies of the state read from the buffers (pinned then)."""

    def __init__(self, store: FlatStore, chunks: list[Chunk], capacity: dict[int, int], depth: int,
                 needs_read: Callable[[Chunk], bool], pin: bool = False) -> None:
        self.store: FlatStore | None = store
        self.chunks = chunks
        self.capacity = capacity
        self.depth = depth
        self.needs_read = needs_read
        self.inflight: dict[int, tuple[ChunkBuffer, IOHandle | None]] = {}
        self.pin = pin
        self.ring: ChunkRing | None = self._new_ring(store)

    def _new_ring(self, store: FlatStore) -> ChunkRing:
        """The one place a ring is built: sized to the largest chunk region."""
        return ChunkRing(store, self.depth + 2, max(self.capacity.values(), default=MIN_RING_BYTES), pin=self.pin)

    def live_ring(self) -> ChunkRing:
        if self.ring is None:
            raise RuntimeError("the read-ahead ring of a copied offloaded optimizer is gone (attach a store first)")
        return self.ring

    def live_store(self) -> FlatStore:
        if self.store is None:
            raise RuntimeError("this offloaded optimizer is a copy without an open store (attach one first)")
        return self.store

    def attach(self, store: FlatStore) -> None:
        """Continue on ``store`` (the same file reopened); a copy gets new buffers (they are not pickled)."""
        self.store = store
        if self.ring is None:
            self.ring = self._new_ring(store)
        self.ring.store = store

    def fence(self, durable: bool = False) -> None:
        """Every write to the chunks' regions has completed (``durable``: and reached the disk)."""
        self.live_store().fence([c.region for c in self.chunks], durable=durable)

    def add(self, chunks: list[Chunk]) -> None:
        """Give chunks of a grown plan store regions (before they join ``chunks``); a chunk larger than the
        buffers rebuilds the ring, after a fence: no write may still read from the old buffers."""
        self.drain()
        store = self.live_store()
        store.add_regions([(c.region, c.nbytes) for c in chunks])
        self.capacity.update({c.index: store.region(c.region).capacity for c in chunks})
        if max(self.capacity.values(), default=MIN_RING_BYTES) > self.live_ring().nbytes:
            self.fence()
            self.ring = self._new_ring(store)

    def issue(self, c: int) -> None:
        chunk = self.chunks[c]
        shelved = self.live_store().shelved(chunk.region)
        if shelved is not None:  # host_memory_budget: updated in place in memory; its "write" is then free
            self.inflight[c] = (ChunkBuffer(shelved[:self.capacity[c]], borrowed=True), None)
            return
        buf = self.live_ring().acquire()
        handle = self.live_store().read(chunk.region, buf.data[:self.capacity[c]]) if self.needs_read(chunk) else None
        self.inflight[c] = (buf, handle)

    def prefetch(self, order: Iterable[int], done: set[int]) -> None:
        """Keep up to ``depth`` reads in flight, in update ``order``, skipping chunks ``done``."""
        for c in order:
            if len(self.inflight) >= self.depth:
                break
            if c not in done and c not in self.inflight:
                self.issue(c)

    def take(self, c: int) -> ChunkBuffer:
        """Chunk ``c``'s buffer with its state read (issuing the read now if it was not ahead)."""
        if c not in self.inflight:
            self.issue(c)
        buf, handle = self.inflight.pop(c)
        if handle is not None:
            self.live_store().wait(handle)
        return buf

    def release(self, buf: ChunkBuffer, write: IOHandle | None = None) -> None:
        """Give ``buf`` back; it is reused once ``write`` (its write-back, if any) completes."""
        self.live_ring().release(buf, write)

    def drain(self) -> None:
        """Wait for every read in flight and give its buffer back."""
        for c in list(self.inflight):
            buf, handle = self.inflight.pop(c)
            if handle is not None:
                handle.wait(self.live_store().io_timeout_s)
            self.live_ring().release(buf)

    def close(self) -> None:
        """End of fit: reads drained, the ring's buffers unregistered now (they stay usable, pageable)."""
        self.drain()
        if self.ring is not None:
            self.ring.unpin()

    def __getstate__(self) -> dict[str, Any]:
        """No open store, buffers or pending reads in a copy (deepcopy, pickle)."""
        return {**self.__dict__, "store": None, "ring": None, "inflight": {}}
