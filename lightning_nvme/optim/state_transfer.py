"""``StateTransfer``: an offloaded optimizer's state in and out, streamed one chunk at a time.

Why: checkpoints (``checkpoint/``) and torch's ``state_dict``/``load_state_dict`` must see the state the
store holds without bringing it all into memory at once; they go through ``export_state``/``import_state``
and the read-only accessors below, never through the update's bookkeeping.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_nvme.optim import chunk_views
from lightning_nvme.optim.buffers import ChunkBuffer
from lightning_nvme.optim.chunk_views import flat, view
from lightning_nvme.optim.core import OffloadedCore
from lightning_nvme.optim.plan import MASTER_KEY, Piece
from lightning_nvme.optim.state_format import STATE_DICT_KEY, Component
from lightning_nvme.optim.state_io import DictSink, DictSource, StateSink, StateSource
from lightning_nvme.store import FlatStore


class StateTransfer(OffloadedCore):
    """Export/import of the stored state, torch's state dict, and what checkpoints read."""

    def export_state(self, sink: StateSink, decoded: bool = False) -> None:
        """Stream every initialized piece's state to ``sink``, one chunk buffer at a time, reading the
        next chunks while the sink consumes this one. ``decoded``: the optimizer's view of each key
        (torch format) instead of what the store holds (compressed formats: codes and scales)."""
        self.fence()
        reads = self.reads
        order = [c for c, chunk in enumerate(self.chunks) if self._chunk_has_state(chunk)]
        for i, c in enumerate(order):
            for ahead in order[i + 1:i + 1 + self.prefetch_depth - len(reads.inflight)]:
                if ahead not in reads.inflight:
                    reads.issue(ahead)
            buf = reads.take(c)
            try:
                for piece in self.chunks[c].pieces:
                    if not self._initialized(piece):
                        continue
                    if decoded:
                        for key, dtype in piece.keys:
                            sink.put(piece, key, chunk_views.load(self.fmt, buf, piece, key, dtype))
                    else:
                        for comp in piece.stored():
                            sink.put(piece, comp.name, view(buf, piece, comp.name, comp.dtype,
                                                            (comp.count(piece.numel),)), comp.per)
            finally:
                reads.release(buf)

    def import_state(self, source: StateSource, stored: bool = False) -> None:
        """Replace the stored state with ``source``'s, one chunk at a time (pieces absent from the
        source become uninitialized, as in a fresh optimizer). ``stored``: the source holds the state as
        this optimizer's format stores it (a checkpoint of the same format), else in torch's format."""
        self.fence()
        ring = self.reads.live_ring()
        for c, chunk in enumerate(self.chunks):
            buf = ring.acquire()
            wrote = False
            for piece in chunk.pieces:
                self.scalars.pop((piece.index, piece.start), None)
                if stored:
                    wrote = self._import_stored(source, piece, buf) or wrote
                    continue
                tensors = {k: source.tensor(piece.index, k, piece.start, piece.stop) for k, _ in piece.keys}
                if MASTER_KEY in tensors and tensors[MASTER_KEY] is None and any(
                        v is not None for k, v in tensors.items() if k != MASTER_KEY):
                    p = piece.param.detach()
                    tensors[MASTER_KEY] = flat(p)[piece.start:piece.stop]  # plain checkpoint: params are the master
                present = {k: v for k, v in tensors.items() if v is not None}
                if len(present) < len(tensors):
                    continue
                for key, dtype in piece.keys:
                    chunk_views.store(self.fmt, buf, piece, key, present[key].to(dtype))
                self.scalars[(piece.index, piece.start)] = dict(source.scalars(piece.index, set(tensors)))
                wrote = True
            handle = self._live_store().write(chunk.region, buf.data[:self.capacity[c]]) if wrote else None
            ring.release(buf, handle)
        for piece in self.resident:
            self.scalars.pop((piece.index, 0), None)
            state = source.scalars(piece.index, set())
            if state:
                self.scalars[(piece.index, 0)] = dict(state)
        self.fence()

    def _import_stored(self, source: StateSource, piece: Piece, buf: ChunkBuffer) -> bool:
        comps = piece.stored()
        tensors = [source.tensor(piece.index, c.name, piece.start // c.per, -(-piece.stop // c.per)) for c in comps]
        present = [t for t in tensors if t is not None]
        if len(present) < len(tensors):
            return False
        for comp, t in zip(comps, present):
            view(buf, piece, comp.name, comp.dtype, (comp.count(piece.numel),)).copy_(flat(t))
        names = {k for k, _ in piece.keys} | {c.name for c in comps}
        self.scalars[(piece.index, piece.start)] = dict(source.scalars(piece.index, names))
        return True

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict in torch's own format, materialized in memory (for users who call
        ``optimizer.state_dict()`` or convert to a plain checkpoint; Lightning checkpoints stream instead).
        Works after ``fit`` too: the closed store is reopened for the call."""
        sink = DictSink()
        with self.store_open():
            self.export_state(sink, decoded=True)
        params = self.params
        opt = self.optimizer
        try:
            opt.state = defaultdict(dict)
            for index, tensors in sink.full(params).items():
                first = self.pieces_of[index][0][1]
                opt.state[params[index]] = {**tensors, **self.scalars[(index, first.start)]}
            for piece in self.resident:
                if (piece.index, 0) in self.scalars:
                    opt.state[params[piece.index]] = dict(self.scalars[(piece.index, 0)])
            out = type(opt).state_dict(opt)
            if not self.fmt.exact:  # values are decoded; this records where they came from
                out[STATE_DICT_KEY] = {**self.fmt.to_dict(), "steps": self.steps_done}
            return out
        finally:
            opt.state = self._empty_state

    def set_param_groups(self, saved: list[dict[str, Any]]) -> dict[Any, int]:
        """Take hyperparameters from saved torch-format param groups; return saved param id -> position."""
        groups = self.optimizer.param_groups
        if len(groups) != len(saved) or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved)):
            raise ValueError("loaded optimizer state has a different number of param groups or parameters "
                             "than the optimizer it is loaded into")
        for g, s in zip(groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
        return {pid: i for i, pid in enumerate(pid for s in saved for pid in s["params"])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch-format optimizer state (hyperparameters into the param groups, state into the store)."""
        position = self.set_param_groups(state_dict["param_groups"])
        self.steps_done = int(state_dict.get(STATE_DICT_KEY, {}).get("steps", 0))
        self.import_state(DictSource({position[k]: v for k, v in state_dict["state"].items()}))

    # ---- read by checkpoints (public: checkpoint code never touches the bookkeeping above) ---------------
    def initialized(self, piece: Piece) -> bool:
        """Whether ``piece`` has optimizer state yet (a fresh optimizer creates it at the first step)."""
        return self._initialized(piece)

    def planned_indices(self) -> set[int]:
        """The param indices this optimizer updates (and, with per-element state, stores) in this process."""
        return set(self.pieces_of)

    def initialized_pieces(self) -> list[Piece]:
        """Every stored piece that has state, in chunk order (what ``export_state`` streams out)."""
        return [p for c in self.chunks for p in c.pieces if self._initialized(p)]

    def scalar_state(self) -> dict[int, dict[str, Any]]:
        """Param index -> its scalar state (``step``...), for the params that have state: torch's
        ``state_dict()["state"]`` without the per-element tensors."""
        out = {}
        for index, pieces in sorted(self.pieces_of.items()):
            key = (index, pieces[0][1].start)
            if key in self.scalars:
                out[index] = dict(self.scalars[key])
        return out

    def stored_state(self) -> list[tuple[int, tuple[int, ...], tuple[Component, ...]]]:
        """``(param index, param shape, stored components)`` of each param whose state is stored and
        initialized: the tensors a checkpoint of this optimizer holds (with a compressed ``state_format``
        the codes and per-block scales, as the store holds them; see ``Piece.stored``)."""
        out = []
        for index, pieces in sorted(self.pieces_of.items()):
            first = pieces[0][1]
            if first.keys and self._initialized(first):
                out.append((index, tuple(first.param.shape), tuple(first.stored())))
        return out

    def attach(self, store: FlatStore) -> None:
        """Continue on ``store`` (the same file reopened after the previous handle was closed)."""
        self.reads.attach(store)

    @contextmanager
    def store_open(self) -> Iterator[FlatStore]:
        """The store, reopened from ``store_ref`` for the call if it is closed (after ``fit``, or in a copy)."""
        if self.store is not None and not self.store.closed:
            yield self.store
            return
        store = self.store_ref.open()
        try:
            self.attach(store)
            yield store
        finally:
            store.close()
