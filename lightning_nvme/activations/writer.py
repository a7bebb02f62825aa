"""``WriteBehind``: records leave memory for their arena space while forward goes on.

Why fenced: a record's memory (the tensor, or for CUDA its pinned host copy) is dropped only once its
write has completed and ``store.wait`` raised the write's error if it had one, so a failed write is
reported before the only copy of the data is gone. Why a byte budget: writes slower than forward would
otherwise keep every activation of the step in memory; above ``max_inflight_bytes`` forward waits for
the oldest write (``OffloadStats.write_wait_s``).

A CUDA record travels in two legs: device -> pinned host on a side stream (``copying``), then host ->
disk (``writing``); ``reap`` advances each record whose current leg has finished.
"""

from __future__ import annotations

import time

import torch

from lightning_nvme.activations.arena import ActivationArena
from lightning_nvme.activations.device import CudaCopies
from lightning_nvme.activations.records import OffloadStats, Record
from lightning_nvme.store import FlatStore, IOHandle


class WriteBehind:
    """The writes of one step, oldest first. Not thread-safe: the offloader's lock covers every call.

    Args:
        handles: every request issued is appended here (the offloader waits for them all at the step's end).
    """

    def __init__(self, store: FlatStore, arena: ActivationArena, max_inflight_bytes: int,
                 handles: list[IOHandle]) -> None:
        self.store = store
        self.arena = arena
        self.max_inflight_bytes = max_inflight_bytes
        self.handles = handles
        self._device_copies: CudaCopies | None = None
        self.pending: list[Record] = []  # copying or writing, oldest first
        self.inflight_bytes = 0

    def reset(self) -> None:
        """Forget the step's writes (after every one of them was waited for)."""
        self.pending = []
        self.inflight_bytes = 0

    def start(self, s: Record, stats: OffloadStats) -> None:
        """Give ``s`` space in the arena and start writing it there, first waiting for older writes
        while the budget is exceeded."""
        t0 = time.perf_counter()
        blocked = False
        while self.pending and self.inflight_bytes + s.nbytes > self.max_inflight_bytes:
            blocked = True
            self.complete(self.pending[0], stats)
        if blocked:
            stats.write_wait_s += time.perf_counter() - t0
        s.region, s.offset = self.arena.alloc(s.nbytes)
        assert s.data is not None
        if s.device.type == "cuda":
            if self._device_copies is None:
                self._device_copies = CudaCopies()
            s.host, s.copy_event = self._device_copies.to_host(s.data)
            s.state = "copying"
        else:
            self._submit(s, s.data)
        self.pending.append(s)
        self.inflight_bytes += s.nbytes

    def _submit(self, s: Record, src: torch.Tensor) -> None:
        s.write = self.store.write(s.region, src, s.offset)
        self.handles.append(s.write)
        s.state = "writing"

    def complete(self, s: Record, stats: OffloadStats) -> None:
        """Block until ``s``'s write is on disk, then release its memory."""
        if s.state == "copying":
            assert s.copy_event is not None
            s.copy_event.synchronize()
        self.reap(stats)
        if s.state == "writing":
            assert s.write is not None
            self.store.wait(s.write)
        self.reap(stats)

    def reap(self, stats: OffloadStats) -> None:
        """Advance writes that finished a leg: copy done -> start the disk write; write done -> release."""
        for s in list(self.pending):
            if s.state == "copying":
                assert s.copy_event is not None and s.host is not None
                if not s.copy_event.query():
                    continue
                s.copy_event = None
                self._submit(s, s.host)
                if not s.pinned:
                    s.data = None  # the device memory is no longer needed
            if s.state == "writing":
                assert s.write is not None
                if not s.write.done():
                    continue
                self.store.wait(s.write)  # raises the write's error, if any, before its source is freed
                s.state = "stored"
                s.host = None
                if not s.pinned:
                    s.data = None
                self.pending.remove(s)
                self.inflight_bytes -= s.nbytes
                stats.bytes_written += s.nbytes

    def sync_copies(self) -> None:
        """Wait for the device -> host copies in flight (a finished copy may then start its disk write)."""
        for s in self.pending:
            if s.copy_event is not None:
                s.copy_event.synchronize()
