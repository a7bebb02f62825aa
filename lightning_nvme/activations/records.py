"""What the offloader remembers about a step's saved tensors, and what it counts.

Why a record per *storage*, keyed by the record object: views, non-contiguous tensors and several views
of one buffer (q, k, v of one projection) share a storage, which is written once and rebuilt per view
(``Packed`` keeps the view's size/stride/offset); addresses are reused once a storage dies, so the graph
holds the record itself, never an address.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from lightning_nvme.store import IOHandle


@dataclass
class OffloadStats:
    """What one step (or the sum of steps) did. ``*_wait_s``: time compute was blocked on the disk."""

    saved_tensors: int = 0  # pack calls seen
    offloaded_tensors: int = 0  # pack calls answered with a store record
    storages: int = 0  # distinct storages recorded
    bytes_written: int = 0
    bytes_read: int = 0
    memory_hits: int = 0  # unpacked while still in memory (kept, or write not finished)
    prefetch_hits: int = 0  # unpacked from a read issued ahead
    misses: int = 0  # unpacked with a synchronous read
    read_wait_s: float = 0.0
    write_wait_s: float = 0.0  # forward blocked by the in-flight write budget
    io_busy_s: float = 0.0  # wall time during which any of the step's I/O was in flight

    def add(self, other: OffloadStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Record:
    """One storage saved this step: in memory, on its way to disk, on disk, or released.

    ``state``: ``held`` (in the keep-last window) | ``kept`` (still in memory when forward ended) |
    ``copying`` (CUDA: device -> pinned host) | ``writing`` | ``stored`` | ``released`` (the step ended).
    """

    __slots__ = ("index", "nbytes", "device", "step", "version", "data", "state", "region", "offset", "write",
                 "host", "copy_event", "prefetch", "pinned", "__weakref__")

    def __init__(self, index: int, data: torch.Tensor, step: int, version: int) -> None:
        self.index = index  # position in save order
        self.nbytes = data.numel()
        self.device = data.device
        self.step = step
        self.version = version
        self.data: torch.Tensor | None = data  # uint8 over the whole storage while it is held
        self.state = "held"
        self.region = ""
        self.offset = 0
        self.write: IOHandle | None = None
        self.host: torch.Tensor | None = None  # CUDA: pinned copy being written
        self.copy_event: torch.cuda.Event | None = None  # CUDA: marks the end of the copy to ``host``
        self.prefetch: tuple[IOHandle, torch.Tensor] | None = None  # a read issued ahead, and its buffer
        self.pinned = False  # needed soon in backward: do not drop ``data`` when its write completes

    def release(self) -> None:
        """The step is over: drop every buffer (the store space is reused by the next step)."""
        self.data = self.host = self.prefetch = self.copy_event = None
        self.state = "released"


class Packed:
    """What the autograd graph holds instead of a tensor: the record and the view to rebuild."""

    __slots__ = ("record", "dtype", "size", "stride", "storage_offset")

    def __init__(self, record: Record, t: torch.Tensor) -> None:
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.storage_offset = t.storage_offset()

    def rebuild(self, buf: torch.Tensor) -> torch.Tensor:
        """The saved view over ``buf``, the bytes of the whole storage on the record's device."""
        out = torch.empty(0, dtype=self.dtype, device=self.record.device)
        return out.set_(buf.untyped_storage(), self.storage_offset, self.size, self.stride)


def busy_seconds(handles: list[IOHandle]) -> float:
    """Length of the union of [submit, done] over ``handles``."""
    spans = sorted((h.t_submit, h.t_done) for h in handles if h.t_done is not None)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total
