"""``Shelf``: store regions kept in host memory instead of on the disk (``host_memory_budget``).

Why inside the store: every reader and writer of a region (the optimizer, parameter blocks, checkpoints,
``state_dict``, digests) goes through ``FlatStore.read``/``write``, so a shelved region serves them all from
the same bytes the disk would have held, and results stay bitwise equal. A request on a shelved region is a
memory copy done at submit time (a completed handle comes back), skipped when the caller hands the shelf's
own tensor (``FlatStore.shelved``: the optimizer and the parameter blocks work in it in place, zero copy).
The disk copy of a shelved region is stale until ``FlatStore.close`` writes the shelf back, so a store
reopened after ``fit`` reads the true bytes (unless its owner discarded it, ``FlatStore.discard_shelved``:
parameter blocks restored into the module are never read from the store again).
"""

from __future__ import annotations

import threading

import torch


class Shelf:
    """Region name -> a page-aligned uint8 tensor of the region's capacity holding its bytes."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0  # served from memory instead of the disk
        self.bytes_written = 0

    def get(self, name: str) -> torch.Tensor | None:
        return self._held.get(name)

    def hold(self, name: str, data: torch.Tensor) -> None:
        self._held[name] = data

    def names(self) -> list[str]:
        return list(self._held)

    def drop(self, names: list[str]) -> None:
        for name in names:
            self._held.pop(name, None)

    def take_all(self) -> dict[str, torch.Tensor]:
        """Empty the shelf, returning what it held (to write it back to the disk)."""
        held, self._held = self._held, {}
        return held

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._held.values())

    def transfer(self, name: str, data: torch.Tensor, offset: int, write: bool) -> None:
        """Copy ``data`` (flat uint8, CPU or device) into (``write``) or out of the shelved region at ``offset``."""
        held = self._held[name]
        nbytes = data.numel()
        with self._lock:
            if write:
                self.bytes_written += nbytes
            else:
                self.bytes_read += nbytes
        if data.device == held.device and data.data_ptr() == held.data_ptr() + offset:
            return  # the caller worked in the shelf itself
        part = held[offset:offset + nbytes]
        if write:
            part.copy_(data)
        else:
            data.copy_(part)
