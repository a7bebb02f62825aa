"""``StateTransfer``: an offloaded optimizer's state in and out, streamed one chunk at a time.

Why: checkpoints (``checkpoint/``) and torch's ``state_dict``/``load_state_dict`` must see the state the
store holds without bringing it all into memory at once; they go through ``export_state``/``import_state``
and the read-only accessors below, never through the update's bookkeeping.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch.optim import Optimizer

from lightning_nvme.optim import chunk_views
from lightning_nvme.optim.buffers import ChunkBuffer
from lightning_nvme.optim.chunk_update import Scalars
from lightning_nvme.optim.chunk_views import flat, view
from lightning_nvme.optim.formats.state_format import STATE_DICT_KEY, Component, StateFormat
from lightning_nvme.optim.pipeline import ReadAhead
from lightning_nvme.optim.plan import MASTER_KEY, ChunkPlan, Piece
from lightning_nvme.optim.state_io import DictSink, DictSource, StateSink, StateSource


class StateTransfer:
    """Export/import of the stored state, torch's state dict, and what checkpoints read.

    Args: the user's ``optimizer``; the ``plan``; the ``reads`` whose ring and store the state passes
    through; the ``scalars`` of initialized pieces (shared with the updater); ``empty_state``, what
    ``optimizer.state`` is between calls; the stored format ``fmt``; ``prefetch_depth`` chunk reads ahead."""

    def __init__(self, optimizer: Optimizer, plan: ChunkPlan, reads: ReadAhead, scalars: Scalars,
                 empty_state: defaultdict[Any, dict[str, Any]], *, fmt: StateFormat, prefetch_depth: int) -> None:
        self.optimizer = optimizer
        self.plan = plan
        self.reads = reads
        self.scalars = scalars
        self.empty_state = empty_state
        self.fmt = fmt
        self.prefetch_depth = prefetch_depth

    def _chunk_has_state(self, c: int) -> bool:
        return any(self.initialized(p) for p in self.plan.chunks[c].pieces)

    def export_state(self, sink: StateSink, decoded: bool = False) -> None:
        """Stream every initialized piece's state to ``sink``, one chunk buffer at a time, reading the
        next chunks while the sink consumes this one. ``decoded``: the optimizer's view of each key
        (torch format) instead of what the store holds (compressed formats: codes and scales)."""
        reads = self.reads
        reads.fence()
        order = [c for c in range(len(self.plan.chunks)) if self._chunk_has_state(c)]
        for i, c in enumerate(order):
            for ahead in order[i + 1:i + 1 + self.prefetch_depth - len(reads.inflight)]:
                if ahead not in reads.inflight:
                    reads.issue(ahead)
            buf = reads.take(c)
            try:
                for piece in self.plan.chunks[c].pieces:
                    if not self.initialized(piece):
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
        self.reads.fence()
        ring = self.reads.live_ring()
        for c, chunk in enumerate(self.plan.chunks):
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
            handle = self.reads.live_store().write(chunk.region, buf.data[:self.reads.capacity[c]]) if wrote else None
            ring.release(buf, handle)
        for piece in self.plan.unchunked:
            self.scalars.pop((piece.index, 0), None)
            state = source.scalars(piece.index, set())
            if state:
                self.scalars[(piece.index, 0)] = dict(state)
        self.reads.fence()

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

    def state_dict(self, steps_done: int) -> dict[str, Any]:
        """The optimizer's state dict in torch's own format, materialized in memory (the store open);
        ``steps_done`` is recorded with a lossy format (it seeds ``bf16_sr`` rounding)."""
        sink = DictSink()
        self.export_state(sink, decoded=True)
        params = self.plan.params
        opt = self.optimizer
        try:
            opt.state = defaultdict(dict)
            for index, tensors in sink.full(params).items():
                first = self.plan.pieces_of[index][0][1]
                opt.state[params[index]] = {**tensors, **self.scalars[(index, first.start)]}
            for piece in self.plan.unchunked:
                if (piece.index, 0) in self.scalars:
                    opt.state[params[piece.index]] = dict(self.scalars[(piece.index, 0)])
            out = type(opt).state_dict(opt)
            if not self.fmt.exact:  # values are decoded; this records where they came from
                out[STATE_DICT_KEY] = {**self.fmt.to_dict(), "steps": steps_done}
            return out
        finally:
            opt.state = self.empty_state

    def set_param_groups(self, saved: list[dict[str, Any]]) -> dict[Any, int]:
        """Take hyperparameters from saved torch-format param groups; return saved param id -> position."""
        groups = self.optimizer.param_groups
        if len(groups) != len(saved) or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved)):
            raise ValueError("loaded optimizer state has a different number of param groups or parameters "
                             "than the optimizer it is loaded into")
        for g, s in zip(groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
        return {pid: i for i, pid in enumerate(pid for s in saved for pid in s["params"])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> int:
        """Load torch-format optimizer state (hyperparameters into the param groups, state into the store);
        returns the step count it recorded (0 if none)."""
        position = self.set_param_groups(state_dict["param_groups"])
        self.import_state(DictSource({position[k]: v for k, v in state_dict["state"].items()}))
        return int(state_dict.get(STATE_DICT_KEY, {}).get("steps", 0))

    # ---- read by checkpoints (public: checkpoint code never touches the bookkeeping above) ---------------
    def initialized(self, piece: Piece) -> bool:
        """Whether ``piece`` has optimizer state yet (a fresh optimizer creates it at the first step)."""
        return (piece.index, piece.start) in self.scalars

    def planned_indices(self) -> set[int]:
        """The param indices this optimizer updates (and, with per-element state, stores) in this process."""
        return set(self.plan.pieces_of)

    def initialized_pieces(self) -> list[Piece]:
        """Every stored piece that has state, in chunk order (what ``export_state`` streams out)."""
        return [p for c in self.plan.chunks for p in c.pieces if self.initialized(p)]

    def scalar_state(self) -> dict[int, dict[str, Any]]:
        """Param index -> its scalar state (``step``...), for the params that have state: torch's
        ``state_dict()["state"]`` without the per-element tensors."""
        out = {}
        for index, pieces in sorted(self.plan.pieces_of.items()):
            key = (index, pieces[0][1].start)
            if key in self.scalars:
                out[index] = dict(self.scalars[key])
        return out

    def stored_state(self) -> list[tuple[int, tuple[int, ...], tuple[Component, ...]]]:
        """``(param index, param shape, stored components)`` of each param whose state is stored and
        initialized: the tensors a checkpoint of this optimizer holds (with a compressed ``state_format``
        the codes and per-block scales, as the store holds them; see ``Piece.stored``)."""
        out = []
        for index, pieces in sorted(self.plan.pieces_of.items()):
            first = pieces[0][1]
            if first.keys and self.initialized(first):
                out.append((index, tuple(first.param.shape), tuple(first.stored())))
        return out
