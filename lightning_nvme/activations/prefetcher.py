"""``Prefetcher``: the reads of a step's backward, issued ahead of need.

Why reverse save order: backward needs the last saved activations first, so a cursor walks the records
from the end; each unpack moves it to just before the record unpacked (recomputation may jump ahead)
and tops the reads up again, at most ``depth`` in flight and ``max_bytes`` of buffers (one read is
always allowed, however large). A record whose write is still running is not read back but kept in
memory (``pinned``). CUDA records are read into pinned host memory and copied to the device on the
stream that asked for them; the host buffer is kept until that copy's event has completed.
"""

from __future__ import annotations

import torch

from lightning_nvme.activations.device import CudaCopies, ReadBufferPool, host_buffer
from lightning_nvme.activations.meter import ResidencyMeter
from lightning_nvme.activations.records import Record
from lightning_nvme.store import FlatStore, IOHandle


class Prefetcher:
    """Read-ahead over one step's records. Not thread-safe: the offloader's lock covers every call.

    Args:
        handles: every request issued is appended here (the offloader waits for them all at the step's end).
    """

    def __init__(self, store: FlatStore, meter: ResidencyMeter, depth: int, max_bytes: int,
                 handles: list[IOHandle]) -> None:
        self.store = store
        self.meter = meter
        self.depth = depth
        self.max_bytes = max_bytes
        self.handles = handles
        self._pool = ReadBufferPool(max_bytes, on_idle_change=meter.add)
        self.reset()

    def reset(self) -> None:
        """Forget the step's reads (after every one of them was waited for)."""
        self._records: list[Record] = []
        self._reads: list[Record] = []  # with a prefetch in flight or ready
        self._h2d: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # CUDA: host buffers until their copy ran
        self._bytes = 0
        self._cursor = -1

    def start(self, records: list[Record]) -> None:
        """Backward begins: read ahead from the last record saved."""
        self._records = records
        self._cursor = len(records) - 1

    def unpacked(self, s: Record) -> None:
        """``s`` was just used: read ahead from the record saved before it."""
        self._cursor = min(self._cursor, s.index - 1)
        self.fill()

    def fill(self) -> None:
        """Issue reads for the records backward needs next (reverse save order), within depth and budget."""
        while self._cursor >= 0 and len(self._reads) < self.depth:
            s = self._records[self._cursor]
            if s.state in ("held", "kept", "released") or s.prefetch is not None:
                self._cursor -= 1
                continue
            if s.data is not None:  # its write is still running: keep it in memory instead of reading it back
                s.pinned = True
                self._cursor -= 1
                continue
            if self._reads and self._bytes + s.nbytes > self.max_bytes:
                return
            buf = self._buffer(s)
            s.prefetch = (self._read(s, buf), buf)
            self._reads.append(s)
            self._bytes += s.nbytes
            self._cursor -= 1

    def _buffer(self, s: Record) -> torch.Tensor:
        """Pinned memory for a CUDA tensor (torch's host allocator recycles it), else a pooled buffer."""
        if s.device.type == "cuda":
            buf = host_buffer(s.nbytes, pinned=True)
        else:
            buf = self._pool.get(s.nbytes)
        self.meter.track(buf.untyped_storage())
        return buf

    def _read(self, s: Record, buf: torch.Tensor) -> IOHandle:
        handle = self.store.read(s.region, buf, s.offset)
        self.handles.append(handle)
        return handle

    def claim(self, s: Record) -> tuple[IOHandle, torch.Tensor, bool]:
        """The read of ``s``'s bytes and its buffer: the one issued ahead (``True``), or one issued now."""
        if s.prefetch is not None:
            handle, buf = s.prefetch
            s.prefetch = None
            self._reads.remove(s)
            self._bytes -= s.nbytes
            return handle, buf, True
        buf = self._buffer(s)
        return self._read(s, buf), buf, False

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A CUDA record's bytes, read into pinned ``host``, copied to ``device`` on the current stream."""
        buf, event = CudaCopies.to_device(host, device)
        self._h2d.append((host, event))
        return buf

    def reap(self) -> None:
        """Drop the host buffers whose copy to the device has run."""
        self._h2d = [(buf, ev) for buf, ev in self._h2d if not ev.query()]

    def sync_copies(self) -> None:
        for _, event in self._h2d:
            event.synchronize()

    def clear(self) -> None:
        """The step is over: the pooled read buffers leave memory too."""
        self._pool.clear()
