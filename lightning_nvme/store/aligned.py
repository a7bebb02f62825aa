"""Page-aligned host memory: staging buffers for I/O and aligned tensors callers may fill directly.

Why aligned: ``O_DIRECT`` needs the buffer address, file offset and length aligned to the logical
block size. Anonymous ``mmap`` gives page-aligned memory; a tensor over it can be read into or
written from with no staging copy. Why a fixed pool: memory must not grow with the data, so a
request for a staging buffer waits for one to come back instead of allocating another.
"""

from __future__ import annotations

import ctypes
import mmap
import queue
import threading

import torch

from lightning_nvme.store.layout import ALIGN, align_up
from lightning_nvme.store.pinned import pinned_empty


def aligned_empty(shape: tuple[int, ...] | int, dtype: torch.dtype = torch.uint8, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised tensor whose storage is page-aligned and padded to a multiple of 4 KiB.

    The store reads into and writes from such tensors without a staging copy. ``pin``: registered with
    CUDA for as long as it lives (``pinned``; pageable if refused): only for memory a device copy uses.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = pinned_empty(nbytes) if pin else None
    if raw is None:
        raw = torch.frombuffer(mmap.mmap(-1, align_up(max(nbytes, 1))), dtype=torch.uint8)
    # The tensor keeps the mmap alive through its storage.
    return raw[:nbytes].view(dtype).view(shape)


def is_direct_capable(t: torch.Tensor, nbytes: int, *, for_read: bool) -> bool:
    """True when ``t`` can be handed to O_DIRECT as is: a contiguous CPU tensor at a page-aligned
    address with room for the 4 KiB-padded length after its start. A padded *read* also overwrites
    the bytes after the tensor, so it is allowed only when those bytes are the storage's own tail
    padding (as for ``aligned_empty`` tensors) or there are none."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() % ALIGN:
        return False
    padded = align_up(nbytes)
    storage = t.untyped_storage()
    room = storage.nbytes() - (t.data_ptr() - storage.data_ptr())
    if room < padded:
        return False
    return not for_read or padded == nbytes or room == padded


def memview(ptr: int, nbytes: int) -> memoryview:
    """A writable memoryview over raw memory (used to hand tensor memory to ``os.pwrite/preadv``)."""
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def copy_bytes(dst: torch.Tensor, dst_off: int, src: torch.Tensor, src_off: int, nbytes: int) -> None:
    """Copy ``nbytes`` between flat uint8 tensors. Host to host it is a plain ``memmove`` (GIL released),
    much faster than ``Tensor.copy_``, whose intra-op threads compete with the I/O workers for the cores
    (docs/store.md, Throughput). Device tensors go through ``copy_``."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr() + dst_off, src.data_ptr() + src_off, nbytes)
    else:
        dst[dst_off:dst_off + nbytes].copy_(src[src_off:src_off + nbytes])


class StagingPool:
    """A fixed number of page-aligned buffers of ``buffer_bytes`` each. ``acquire`` blocks while all
    are in use, which is what bounds the store's memory whatever the size of the data."""

    def __init__(self, count: int, buffer_bytes: int) -> None:
        if count < 1:
            raise ValueError(f"staging pool needs at least one buffer, got {count}")
        if buffer_bytes <= 0 or buffer_bytes % ALIGN:
            raise ValueError(f"staging buffer size must be a positive multiple of {ALIGN}, got {buffer_bytes}")
        self.buffer_bytes = buffer_bytes
        self.count = count
        self._free: queue.LifoQueue[torch.Tensor] = queue.LifoQueue()
        # One mapping cut into the buffers: a mapping per buffer hit the kernel's limit of 65530 maps per
        # process (ENOMEM) once a few stores with small io_chunk_bytes were open (4 KiB: 16 K buffers each).
        whole = aligned_empty(count * buffer_bytes)  # host <-> disk only: never pinned
        for i in range(count):
            self._free.put(whole[i * buffer_bytes:(i + 1) * buffer_bytes])
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        return self.count * self.buffer_bytes

    def acquire(self, timeout: float | None = None) -> torch.Tensor:
        return self._free.get(timeout=timeout)

    def release(self, buf: torch.Tensor) -> None:
        self._free.put(buf)
