"""``ActivationArena``: where one training step's activations go in the store, reused every step.

Why a bump allocator: a step's saved tensors are written in forward and all read back by the end of
backward, so their space is free again at the next step. Allocation is a cursor moving through a
chain of store regions ("segments"), reset at every step. The store's regions are append-only, so
the area grows by appending a segment, and only when a step needs more than all segments hold; the
new segment adds at least ``grow_fraction`` of the current capacity (the margin), so a slowly
growing workload adds few segments. Offsets are 4 KiB aligned, as O_DIRECT requires.
"""

from __future__ import annotations

from lightning_nvme.store import FlatStore, Region, align_up


class ActivationArena:
    def __init__(self, store: FlatStore, prefix: str = "activations", *, min_segment_bytes: int = 256 << 20,
                 grow_fraction: float = 0.5) -> None:
        if min_segment_bytes <= 0:
            raise ValueError(f"min_segment_bytes must be > 0, got {min_segment_bytes}")
        if grow_fraction < 0:
            raise ValueError(f"grow_fraction must be >= 0, got {grow_fraction}")
        self.store = store
        self.prefix = prefix
        self.min_segment_bytes = align_up(min_segment_bytes)
        self.grow_fraction = grow_fraction
        self.segments: list[Region] = []
        self._seg = 0  # segment the cursor is in
        self._pos = 0  # byte offset of the cursor in that segment
        self.used_bytes = 0  # allocated this step (aligned)
        self.peak_step_bytes = 0  # largest step seen

    @property
    def capacity_bytes(self) -> int:
        return sum(r.capacity for r in self.segments)

    def reset(self) -> None:
        """Start a new step: everything allocated before may be overwritten."""
        self.peak_step_bytes = max(self.peak_step_bytes, self.used_bytes)
        self._seg = self._pos = self.used_bytes = 0

    def alloc(self, nbytes: int) -> tuple[str, int]:
        """Space for ``nbytes``: ``(region name, 4 KiB-aligned byte offset)`` valid until the next ``reset``."""
        need = align_up(max(nbytes, 1))
        while self._seg < len(self.segments):
            seg = self.segments[self._seg]
            if self._pos + need <= seg.capacity:
                offset = self._pos
                self._pos += need
                self.used_bytes += need
                return seg.name, offset
            self._seg += 1
            self._pos = 0
        seg = self._grow(need)
        self._pos = need
        self.used_bytes += need
        return seg.name, 0

    def _grow(self, need: int) -> Region:
        size = align_up(max(need, self.min_segment_bytes, int(self.grow_fraction * self.capacity_bytes)))
        index = len(self.segments)
        while f"{self.prefix}.{index}" in self.store:
            index += 1
        region = self.store.add_region(f"{self.prefix}.{index}", size)
        self.segments.append(region)
        self._seg = len(self.segments) - 1
        return region
