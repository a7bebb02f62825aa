"""``ReadAhead``: the chunk reads an offloaded optimizer keeps in flight ahead of its update; ``WriteBack``:
its write-backs, which with parameters on a device first copy the updated state back on a side stream.

Why: the step is bound by the disk. Reads for the first chunks start on entry to ``step`` (while the
closure still runs forward and backward) and, during the update, up to ``depth`` chunks are read ahead of
the one being updated, each into a buffer of the ring. The store orders a read after the last write to the
same bytes, so a chunk is never updated from stale state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_nvme.optim import chunk_views
from lightning_nvme.optim.buffers import ChunkBuffer, ChunkRing, CudaOps
from lightning_nvme.optim.chunk_views import flat
from lightning_nvme.optim.formats.state_format import StateFormat
from lightning_nvme.optim.plan import Chunk, Piece
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
        if not self.needs_read(chunk):  # the update writes the buffer: its old write-back must be over
            self.inflight[c] = (self.live_ring().acquire(), None)
            return
        buf = self.live_ring().acquire(wait=False)
        after, buf.pending_write = (buf.pending_write,) if buf.pending_write is not None else (), None
        self.inflight[c] = (buf, self.live_store().read(chunk.region, buf.data[:self.capacity[c]], after=after))

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


@dataclass
class _Pending:
    """A chunk whose state is being copied back from the device: written once ``done`` has completed."""

    chunk: int
    buf: ChunkBuffer
    done: Any  # an event on the side stream after the copies
    encodes: list[tuple[Piece, str, torch.Tensor]] = field(default_factory=list)  # compressed keys, on host


class WriteBack:
    """Writes updated chunks back to the store through ``reads`` (its store and ring).

    Why a side stream: with the parameters on a device, the updated state is there. A blocking copy back
    per key per piece stops the host until the device has finished everything queued before it, and with
    ``overlap="backward"`` it runs inside an autograd hook, so backward could not run ahead. Instead the copies
    are queued on a side stream that waits only for the update (an event), non-blocking, into the pinned ring
    buffer itself (a compressed key into a pinned host tensor, encoded on the host once copied); each device
    tensor is ``record_stream``-ed on the side stream so the caching allocator does not hand its memory to a
    later allocation while the copy still reads it. The store write is issued once the copies' event has
    completed: polled at each chunk, waited for before a second chunk would be pending (the ring has one
    buffer for the write-back) and at the end of the step. ``ops``: ``None`` on CPU (nothing to copy)."""

    def __init__(self, reads: ReadAhead, ops: Any, device: torch.device | None, fmt: StateFormat) -> None:
        self.reads = reads
        self.ops = ops
        self.device = device
        self.fmt = fmt
        self.down = ops.stream(device) if ops is not None else None  # made once: a stream per chunk would leak
        self.pending: list[_Pending] = []
        self._copying: _Pending | None = None

    def begin(self, c: int, buf: ChunkBuffer) -> None:
        """Copies of chunk ``c``'s updated state follow (``copy``): after the update queued so far."""
        assert self.ops is not None and self.down is not None
        updated = self.ops.event()
        updated.record(self.ops.current_stream(self.device))
        self.down.wait_event(updated)
        self._copying = _Pending(c, buf, None)

    def copy(self, piece: Piece, key: str, value: torch.Tensor) -> None:
        """Queue the copy of ``value`` (on the device) into ``piece``'s ``key`` in the chunk's buffer."""
        assert self.ops is not None and self.down is not None and self._copying is not None
        src = flat(value)
        with self.ops.on(self.down):
            if self.fmt.compresses(key, value.dtype):
                host = torch.empty(src.numel(), dtype=src.dtype, pin_memory=isinstance(self.ops, CudaOps))
                self.ops.copy(host, src)
                self._copying.encodes.append((piece, key, host))
            else:
                self.ops.copy(chunk_views.raws(self._copying.buf, piece, key)[0], src)
        self.ops.record_stream(value, self.down)

    def issue(self, c: int, buf: ChunkBuffer, changed: bool) -> None:
        """Chunk ``c`` is updated: write it back (after its copies, if it had any) and give its buffer back."""
        pending, self._copying = self._copying, None
        if pending is None or self.ops is None:
            self._write(c, buf, changed)
            return
        pending.done = self.ops.event()
        pending.done.record(self.down)
        self.settle(block=True)  # one chunk's write-back pending at a time: the ring holds one buffer for it
        self.pending.append(pending)

    def settle(self, block: bool = False) -> None:
        """Write back the chunks whose copies have completed (``block``: all of them, waiting)."""
        while self.pending and (block or self.pending[0].done.query()):
            p = self.pending.pop(0)
            p.done.synchronize()
            for piece, key, host in p.encodes:
                chunk_views.store(self.fmt, p.buf, piece, key, host)
            self._write(p.chunk, p.buf, True)

    def abandon(self, buf: ChunkBuffer) -> None:
        """A failed update: ``buf`` goes back to the ring unwritten, the chunks before it are written."""
        self._copying = None
        self.reads.release(buf, None)
        self.settle(block=True)

    def _write(self, c: int, buf: ChunkBuffer, changed: bool) -> None:
        store = self.reads.live_store()
        handle = store.write(self.reads.chunks[c].region, buf.data[:self.reads.capacity[c]]) if changed else None
        self.reads.release(buf, handle)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (deepcopy, pickle) has no streams and nothing pending (it cannot step)."""
        return {**self.__dict__, "ops": None, "down": None, "pending": [], "_copying": None}
