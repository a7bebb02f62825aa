"""What every part of an offloaded optimizer shares: the user's optimizer, the store, the plan and the
bookkeeping of which pieces hold state (``OffloadedCore``, the base of ``OffloadedOptimizer``).

Why a base of its own: the update, the plan growth and the state import/export each live in their own
module as a class on top of this one; the attributes they all read are declared (and typed) here once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_nvme.optim.buffers import ChunkRing, DecodeArena
from lightning_nvme.optim.pipeline import ReadAhead
from lightning_nvme.optim.plan import Chunk, Piece, Plan
from lightning_nvme.optim.probe import raw_step
from lightning_nvme.optim.state_format import StateFormat
from lightning_nvme.optim.state_io import UpdateListener
from lightning_nvme.optim.store_ref import StoreRef
from lightning_nvme.store import FlatStore


class OffloadedCore:
    """The shared state of an offloaded optimizer (set by ``OffloadedOptimizer.__init__``)."""

    optimizer: Optimizer
    store_ref: StoreRef
    name: str
    fmt: StateFormat
    overlap: str
    prefetch_depth: int
    chunk_bytes: int
    clip_value: float | None
    owned: Mapping[int, Sequence[tuple[int, int]]] | None
    free_grads: bool
    grad_hooks: bool
    listener: UpdateListener | None
    steps_done: int  # completed steps: part of the bf16_sr rounding noise, saved in checkpoints
    plan: Plan
    chunks: list[Chunk]
    resident: list[Piece]
    pieces_of: defaultdict[int, list[tuple[Chunk | None, Piece]]]  # param index -> its pieces (chunk None: resident)
    capacity: dict[int, int]  # chunk index -> bytes of its store region
    reads: ReadAhead
    arena: DecodeArena  # compressed formats: one chunk's decoded state
    scalars: dict[tuple[int, int], dict[str, Any]]  # (param index, start) -> scalar state
    _order: list[int]  # chunk indices in update order
    _done: set[int]  # chunks updated in this step
    _armed: bool  # inside the closure of an overlap="backward" step: updates follow gradients
    _empty_state: defaultdict[Any, dict[str, Any]]  # the optimizer's ``state`` between updates

    @property
    def store(self) -> FlatStore | None:
        """The open store (``None`` in a copy, deepcopy/pickle, until ``attach``)."""
        return self.reads.store

    @property
    def ring(self) -> ChunkRing:
        """The chunk buffers (a copy has none until ``attach``)."""
        return self.reads.live_ring()

    @property
    def _inner_step(self) -> Callable[..., Any]:
        return raw_step(self.optimizer)

    def _live_store(self) -> FlatStore:
        return self.reads.live_store()

    def _index(self, plan: Plan) -> None:
        for c in plan.chunks:
            for piece in c.pieces:
                self.pieces_of[piece.index].append((c, piece))
        for piece in plan.resident:
            self.pieces_of[piece.index].append((None, piece))

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _indexed_state(self) -> dict[int, dict[str, Any]]:
        return {i: self.optimizer.state.get(p, {}) for i, p in enumerate(self.params)}

    @property
    def state_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def _initialized(self, piece: Piece) -> bool:
        return (piece.index, piece.start) in self.scalars

    def _chunk_has_state(self, chunk: Chunk) -> bool:
        return any(self._initialized(p) for p in chunk.pieces)

    def fence(self, durable: bool = False) -> None:
        self._live_store().fence([c.region for c in self.chunks], durable=durable)
