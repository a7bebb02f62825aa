"""``ChunkRing``: the bounded set of page-aligned buffers an offloaded optimizer works in.

Why a ring: one buffer is being updated while the next ``prefetch_depth`` are being read and the
previous ones are being written back. Memory is ``count x chunk`` whatever the model size. No buffer is
overwritten while the disk still reads from it: it is handed out again once its write-back has completed,
or (``acquire(wait=False)``) with that write left for the caller to order its read after.
"""

from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_nvme.constants import SLOT_ALIGN, align_up
from lightning_nvme.store import FlatStore, IOHandle
from lightning_nvme.store.pinned import unpin


@dataclass
class ChunkBuffer:
    data: torch.Tensor  # uint8, page-aligned, capacity bytes
    pending_write: IOHandle | None = None
    borrowed: bool = False  # the store's in-memory copy of a shelved region, not one of the ring's buffers
    uploaded: Any = None  # a CUDA event after the asynchronous copies of its state to the device


class CudaOps:
    """The CUDA calls the optimizer's device copies make, one object so a test substitutes one that records
    them (``tests/fake_cuda.FakeOps``) and ``gpu_check`` one that delays them. ``params.transfer``'s block
    copies use it too (``CudaTransfer``), so one fake sees every device copy."""

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One host <-> device copy on the current stream, never waiting for it."""
        dst.copy_(src, non_blocking=True)


def copy_ops_for(params: list[torch.Tensor]) -> CudaOps | None:
    """The device copies of the state for these parameters: CUDA's when any is on CUDA, else none (the
    update runs on the chunk buffer itself). A test routes this to a fake to run the device path on CPU."""
    return CudaOps() if any(p.device.type == "cuda" for p in params) else None


class ChunkRing:
    """``pin``: the parameters are on a CUDA device, whose copies of the state read from these buffers."""

    def __init__(self, store: FlatStore, count: int, nbytes: int, pin: bool = False) -> None:
        if count < 2:
            raise ValueError(f"the chunk ring needs at least 2 buffers, got {count}")
        self.store = store
        self.nbytes = nbytes
        self._free: deque[ChunkBuffer] = deque(ChunkBuffer(store.aligned_empty(nbytes, pin=pin)) for _ in range(count))
        self.pin = pin
        self.count = count

    @property
    def total_bytes(self) -> int:
        return self.count * self.nbytes

    def acquire(self, wait: bool = True) -> ChunkBuffer:
        """The next free buffer. ``wait=False``: its write-back may still be reading from it (left in
        ``pending_write``) for a caller that orders its own read into the buffer after that write
        (``FlatStore.read(after=...)``) rather than block here: during a burst of chunk updates the read-ahead
        reuses a buffer whose write-back was issued a moment ago, and the backward would wait for the disk."""
        if not self._free:
            raise RuntimeError("chunk ring exhausted: more buffers held than prefetch_depth + 2 (a bug)")
        buf = self._free.popleft()
        if buf.uploaded is not None:
            buf.uploaded.synchronize()
            buf.uploaded = None
        if wait and buf.pending_write is not None:
            self.store.wait(buf.pending_write)
            buf.pending_write = None
        return buf

    def release(self, buf: ChunkBuffer, pending_write: IOHandle | None = None) -> None:
        if buf.borrowed:
            return
        buf.pending_write = pending_write
        self._free.append(buf)

    def unpin(self) -> None:
        """End of fit: unregister the buffers now rather than when they are freed (they stay usable, pageable)."""
        for buf in self._free:
            if buf.uploaded is not None:
                buf.uploaded.synchronize()
                buf.uploaded = None
            unpin(buf.data)


class DecodeArena:
    """Where a chunk's compressed state is decoded for its update: one buffer, reused for every chunk
    and sized to the largest chunk's decoded state (at most 4x its stored bytes: int8 codes -> fp32).

    Why: a fresh tensor per key and chunk is returned to the OS when freed (it is above glibc's mmap
    threshold) and page-faulted in again at the next chunk; that cost more than the decoding itself."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    @classmethod
    def _span(cls, numel: int, dtype: torch.dtype) -> int:
        """Bytes one ``take`` uses: its tensor, rounded up to ``SLOT_ALIGN``."""
        return align_up(numel * dtype.itemsize, SLOT_ALIGN)

    @classmethod
    def need(cls, sizes: list[tuple[int, torch.dtype]]) -> int:
        """Bytes that ``take`` calls for these (numel, dtype) need."""
        return sum(cls._span(numel, dtype) for numel, dtype in sizes)

    def reset(self, nbytes: int) -> None:
        """Start a chunk that will take ``nbytes`` (see ``need``); views handed out before are invalid."""
        if nbytes > self._buf.numel():
            self._buf = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        self._used = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = self._span(numel, dtype)
        if self._used + nbytes > self._buf.numel():
            raise RuntimeError(f"decode arena overrun ({self._used} + {nbytes} > {self._buf.numel()} bytes; a bug)")
        view = self._buf[self._used:self._used + numel * dtype.itemsize].view(dtype)
        self._used += nbytes
        return view
