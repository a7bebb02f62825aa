"""Where each rank's shard of a block lies: a block's parameters as one flat tensor, cut into N equal shards.

``nvme_offload_fsdp`` keeps only rank r's shard ``flat[r * S:(r + 1) * S]`` of every block in r's store. The
flat layout is the same on every rank (computed from the module), so a shard is all a rank needs to take part in
``all_gather`` (forward, backward) and ``reduce_scatter`` (gradients) of the block.

Why each parameter starts ``PARAM_SLOT_ALIGN`` bytes into the flat tensor (as in a store block's region): kernels
may choose their code path by pointer alignment, and a gathered parameter must compute exactly as one allocated by
torch. The gaps and the tail padding (to ``N * S``) are zeros that belong to no parameter.

The shard a rank owns is also the optimizer state it owns: ``owned`` maps it back to element ranges of each
parameter, the form ``OffloadedOptimizer(owned=...)`` and the data-parallel checkpoints (``Partition``) use, so a
checkpoint saved at N ranks reshards on load at any other N exactly as ``nvme_offload_ddp``'s does.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from lightning_nvme.constants import ALIGN
from lightning_nvme.params.layout import PARAM_SLOT_ALIGN


@dataclass(frozen=True)
class FlatSlot:
    """Parameter ``param`` (``name`` in its block) at elements ``[offset, offset + numel)`` of the flat tensor."""

    name: str
    param: torch.Tensor
    offset: int
    numel: int
    shape: torch.Size


class FlatShards:
    """The flat layout of some parameters (one dtype) and its cut into ``world`` shards of ``shard`` elements.

    ``state_align``: every parameter's offset and every cut fall on a multiple of this many elements, so each
    rank's part of a parameter starts at a multiple of it counted from the parameter's element 0. The optimizer
    state format's ``align`` (``state_format="int8"``: its 256-element blocks, one absmax each): no block is then
    split between two ranks, and each rank encodes exactly the blocks one process holding the whole parameter
    would."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], world: int, state_align: int = 1) -> None:
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"parameters {[n for n, _ in named]} have dtypes {sorted(map(str, dtypes))}: one flat "
                             "shard holds one dtype")
        self.dtype = next(iter(dtypes))
        self.world = world
        self.align = math.lcm(max(1, PARAM_SLOT_ALIGN // torch.empty((), dtype=self.dtype).element_size()),
                              max(1, state_align))
        self.slots: list[FlatSlot] = []
        offset = 0
        for name, p in named:
            self.slots.append(FlatSlot(name, p, offset, p.numel(), p.shape))
            offset = -(-(offset + p.numel()) // self.align) * self.align
        self.used = offset
        ends = [s.offset + s.numel for s in self.slots]
        self._gaps = [(e, s.offset) for e, s in zip(ends, self.slots[1:]) if s.offset > e]  # alignment padding
        per_rank = -(-offset // world)
        self.shard = max(self.align, -(-per_rank // self.align) * self.align)  # each shard starts aligned too
        self.total = self.shard * world
        if self.total > (ends[-1] if ends else 0):
            self._gaps.append((ends[-1] if ends else 0, self.total))

    @property
    def shard_bytes(self) -> int:
        return self.shard * torch.empty((), dtype=self.dtype).element_size()

    def bounds(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard

    @property
    def trainable_start(self) -> int:
        """The first element of a trainable parameter (the slots come frozen first); ``total`` if none."""
        return min((s.offset for s in self.slots if s.param.requires_grad), default=self.total)

    def trainable_counts(self) -> list[int]:
        """Per rank, the elements of ``[trainable_start, total)`` in its shard: the pieces a gradient reduction of
        the trainable tail alone scatters (a LoRA block's frozen base is never reduced)."""
        first = self.trainable_start
        return [max(0, hi - max(lo, first)) for lo, hi in map(self.bounds, range(self.world))]

    def writable_offset(self, rank: int) -> int:
        """Bytes into ``rank``'s shard from which it holds trainable parameters, page-aligned down (the slots come
        frozen first, as in a store block: ``plan_layout``); the shard's size where it holds none. An update writes
        back only from here: a LoRA base's shard is written once, at setup."""
        first = self.trainable_start
        lo, hi = self.bounds(rank)
        if first >= hi:
            return self.shard_bytes
        frozen = max(0, first - lo) * torch.empty((), dtype=self.dtype).element_size()
        return frozen - frozen % ALIGN

    def owned(self, rank: int) -> list[tuple[FlatSlot, int, int]]:
        """``(slot, start, stop)``: the elements of each parameter that lie in ``rank``'s shard (param order)."""
        lo, hi = self.bounds(rank)
        out = []
        for s in self.slots:
            start, stop = max(lo, s.offset), min(hi, s.offset + s.numel)
            if start < stop:
                out.append((s, start - s.offset, stop - s.offset))
        return out

    def window(self, rank: int, params: Collection[int]) -> tuple[int, int]:
        """Elements ``[a, b)`` of the flat tensor: ``rank``'s shard, widened to hold whole every parameter whose
        ``id`` is in ``params`` and that has elements in it (what an update of the shard reads and writes)."""
        lo, hi = self.bounds(rank)
        for s, _, _ in self.owned(rank):
            if id(s.param) in params:
                lo, hi = min(lo, s.offset), max(hi, s.offset + s.numel)
        return lo, hi

    def view(self, flat: torch.Tensor, slot: FlatSlot, base: int = 0) -> torch.Tensor:
        """``slot``'s parameter inside ``flat`` (the flat tensor from element ``base`` on: a ``window``), shaped like
        the parameter."""
        return flat[slot.offset - base:slot.offset - base + slot.numel].view(slot.shape)

    def pack(self, tensors: list[torch.Tensor | None], out: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """``tensors`` (one per slot, shaped like it) copied into ``out`` (``total`` elements), gaps zeroed; a
        ``None`` leaves its slot zero (a frozen parameter's gradient). Each element is written once (a block's
        gradient is packed on the critical path of every backward: zeroing all of ``out`` first was a second pass
        over it). ``scale``: each value multiplied by it as it is written (bitwise a copy, then ``mul_``)."""
        for lo, hi in self._gaps:
            out[lo:hi].zero_()
        for s, t in zip(self.slots, tensors):
            if t is None:
                self.view(out, s).zero_()
            elif scale is None:
                self.view(out, s).copy_(t)
            else:
                torch.mul(t, scale, out=self.view(out, s))
        return out
