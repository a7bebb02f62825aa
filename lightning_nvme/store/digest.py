"""Digests of a store's regions as they are on disk.

Why: reopen checks version, layout hash, header and size, but cannot see changed data bytes (a torn
write-back from a killed run, bit rot, tampering). Record digests when committing a checkpoint and compare
them before trusting a reused store. Costs one full read, through one chunk-sized buffer.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

from lightning_nvme.store.aligned import memview
from lightning_nvme.store.handle import IOHandle
from lightning_nvme.store.layout import Layout


class _Readable(Protocol):
    layout: Layout

    @property
    def io_chunk_bytes(self) -> int: ...

    def fence(self) -> None: ...
    def aligned_empty(self, shape: tuple[int, ...] | int) -> torch.Tensor: ...
    def read(self, name: str, out: torch.Tensor, offset: int = 0) -> IOHandle: ...
    def wait(self, handle: IOHandle) -> None: ...


def region_digests(store: _Readable, regions: list[str] | None = None) -> dict[str, str]:
    """BLAKE2b (16 bytes, hex) of each region's bytes (every region when ``regions`` is None)."""
    store.fence()
    buf = store.aligned_empty(store.io_chunk_bytes)
    out = {}
    for name in (list(store.layout.regions) if regions is None else regions):
        region, h = store.layout[name], hashlib.blake2b(digest_size=16)
        for off in range(0, region.nbytes, store.io_chunk_bytes):
            view = buf[:min(store.io_chunk_bytes, region.nbytes - off)]
            store.wait(store.read(name, view, off))
            h.update(memview(view.data_ptr(), view.numel()))
        out[name] = h.hexdigest()
    return out
