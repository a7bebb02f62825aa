"""``OffloadedOptimizer``: a user's torch optimizer whose per-parameter state lives in a FlatStore.

The user's optimizer object stays the one Lightning, LR schedulers and callbacks see; its ``state``
stays empty. Its ``step`` is replaced on the instance (``binding``) by a pipelined step that, chunk by
chunk, reads the chunk's state into a ring buffer (``pipeline``), runs the optimizer's *own* update code on
it (``chunk_update``), and issues the write-back, while the next chunks are being read. Reads for the first
chunks start on entry to ``step``, i.e. while the closure still runs forward and backward; writes issued at
step N may still be in flight during step N+1's forward. The store orders a read after the last write to
the same bytes, so a chunk is never updated from stale state.

``overlap="backward"`` updates a chunk as soon as every parameter in it has its final gradient
(``trigger``), and the plan follows the optimizer (``plan.ChunkPlan``); state goes in and out through
``state_transfer``. Torch's step hooks fire once per ``optimizer.step()``, kwargs reach the optimizer's own step.

Why composed: each part is an object with its own arguments (the chunk plan, the read-ahead, the updater,
the backward trigger, the state transfer), built here and given what it reads, in the spirit of FSDP2's
state objects; this class only wires them and keeps the API Lightning, the strategies and checkpoints call.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_nvme.constants import MiB
from lightning_nvme.optim import buffers
from lightning_nvme.optim.binding import OptimizerBinding
from lightning_nvme.optim.buffers import ChunkRing
from lightning_nvme.optim.chunk_update import ChunkUpdater, Scalars
from lightning_nvme.optim.formats.state_format import EXACT, StateFormat
from lightning_nvme.optim.pipeline import ReadAhead, WriteBack
from lightning_nvme.optim.plan import Chunk, ChunkPlan, Piece, Plan, plan_chunks
from lightning_nvme.optim.probe import UnsupportedOptimizerError
from lightning_nvme.optim.state_io import DictSource, StateSink, StateSource, UpdateListener
from lightning_nvme.optim.state_transfer import StateTransfer
from lightning_nvme.optim.store_ref import StoreRef
from lightning_nvme.optim.trigger import BackwardTrigger
from lightning_nvme.store import FlatStore

# Defaults of the strategies' arguments of the same names (lightning_nvme.settings reads them from here).
CHUNK_BYTES = 32 * MiB
PREFETCH_DEPTH = 2
OVERLAP_MODES = ("step", "backward")  # the first is the default

__all__ = ["CHUNK_BYTES", "OVERLAP_MODES", "PREFETCH_DEPTH", "OffloadedOptimizer", "StateRegion", "StateSink",
           "StateSource", "UpdateListener"]


@dataclass(frozen=True)
class StateRegion:
    """One store region of an offloaded optimizer's state, as the strategies see it (``regions()``)."""

    name: str  # the store region
    nbytes: int  # its capacity in the store
    params: tuple[torch.Tensor, ...]  # the parameters whose state (or part of it) it holds
    # The pieces in it that have optimizer state, in region order: each names its parameter range
    # (``index``, ``start``, ``stop``), its stored components (``stored()``) and their byte offsets in the region
    # (``slots``). For whoever addresses the stored bytes directly (a checkpoint's reflink clones, a shard's entries).
    stored: tuple[Piece, ...]

    @property
    def has_state(self) -> bool:
        """Some piece in it has optimizer state (a fresh optimizer creates it at the first step)."""
        return bool(self.stored)


class OffloadedOptimizer:
    """Drives one user optimizer with its per-element state in ``store``.

    Args:
        optimizer: the user's optimizer (AdamW, Adam, SGD, RMSprop, Adagrad, ... any optimizer whose
            state is per-parameter tensors updated element-wise).
        store: the flat store the state lives in.
        name: region prefix in the store (one per optimizer).
        chunk_bytes: state bytes moved per request; memory is ``(prefetch_depth + 2) x chunk_bytes``.
        prefetch_depth: chunks read ahead of the one being updated.
        overlap: ``"step"`` (pipeline inside the step, reads start on entry) or ``"backward"``.
        clip_value: with ``overlap="backward"``, element-wise gradient value clipping applied before
            each chunk's update (what Lightning would apply after the closure).
        owned: param index -> element ranges: offload and update only these (a data-parallel rank's
            partition, see ``partition_by_bytes``); ``None`` = every trainable parameter.
        grad_hooks: with ``overlap="backward"``, learn that a parameter's gradient is final from its
            post-accumulate-grad hook. ``False``: the caller says so with ``grad_ready`` (data parallel:
            a gradient is final only once its all-reduce has completed).
        plan: the result of ``plan_chunks(optimizer, chunk_bytes, name, owned=owned, fmt=fmt)`` when the
            caller already made it (e.g. to size the store before allocating it).
        store_ref: how to reopen ``store`` once it is closed (default: the same file).
        free_grads: set each parameter's ``.grad`` to ``None`` as soon as every piece of it is updated,
            so with ``overlap="backward"`` the whole model's gradients never coexist.
        listener: told before and after each chunk update (see ``UpdateListener``).
        fmt: how the state is stored (``StateFormat``: exact, bf16 or int8 state; fp32 or bf16_sr masters);
            a plan grown mid-run uses the same format.
    """

    def __init__(self, optimizer: Optimizer, store: FlatStore, *, name: str = "opt0",
                 chunk_bytes: int = CHUNK_BYTES, prefetch_depth: int = PREFETCH_DEPTH,
                 overlap: str = OVERLAP_MODES[0], clip_value: float | None = None,
                 owned: Mapping[int, Sequence[tuple[int, int]]] | None = None, grad_hooks: bool = True,
                 plan: Plan | None = None, store_ref: StoreRef | None = None, free_grads: bool = False,
                 listener: UpdateListener | None = None, fmt: StateFormat = EXACT) -> None:
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {overlap!r}")
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        self.optimizer = optimizer
        self.overlap = overlap
        self.owned = owned
        self.fmt = fmt
        self.store_ref = store_ref or StoreRef.of(store)
        self.chunk_plan = ChunkPlan(optimizer, plan or plan_chunks(optimizer, chunk_bytes, name, owned=owned, fmt=fmt),
                                    name=name, chunk_bytes=chunk_bytes, fmt=fmt, backward=overlap == "backward")
        chunks = self.chunk_plan.chunks
        store.add_regions([(c.region, c.nbytes) for c in chunks])
        self.scalars: Scalars = {}
        self.transfer: StateTransfer  # set below: the read-ahead asks it which chunks hold state
        params = self.chunk_plan.params
        self.reads = ReadAhead(store, chunks, {c.index: store.region(c.region).capacity for c in chunks},
                               prefetch_depth, self._chunk_has_state, pin=any(p.device.type == "cuda" for p in params))
        devices = [p.device for p in params if p.device.type != "cpu"]
        self.writeback = WriteBack(self.reads, buffers.copy_ops_for(params), devices[0] if devices else None, fmt)
        empty_state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)  # the optimizer's state between updates
        self.updater = ChunkUpdater(optimizer, self.chunk_plan, self.reads, self.writeback, self.scalars, empty_state,
                                    fmt=fmt, clip_value=clip_value, free_grads=free_grads, listener=listener)
        self.trigger = BackwardTrigger(self.chunk_plan, self.updater, hooks=overlap == "backward" and grad_hooks)
        self.transfer = StateTransfer(optimizer, self.chunk_plan, self.reads, self.scalars, empty_state, fmt=fmt,
                                      prefetch_depth=prefetch_depth)
        existing = {i: dict(s) for i, p in enumerate(self.params) if (s := optimizer.state.get(p, {}))}
        optimizer.state = empty_state
        self.import_state(DictSource(existing))
        OptimizerBinding(self).install()  # Lightning, schedulers and users all call the optimizer's own methods

    # ---- what the strategies, checkpoints and tests read ----------------------------------------------
    @property
    def chunks(self) -> list[Chunk]:
        return self.chunk_plan.chunks

    @property
    def unchunked(self) -> list[Piece]:
        """Pieces without per-element state (whole parameters), updated with their state in memory."""
        return self.chunk_plan.unchunked

    @property
    def params(self) -> list[torch.Tensor]:
        return self.chunk_plan.params

    @property
    def capacity(self) -> dict[int, int]:
        """Chunk index -> bytes of its store region."""
        return self.reads.capacity

    @property
    def store(self) -> FlatStore | None:
        """The open store (``None`` in a copy, deepcopy/pickle, until ``attach``)."""
        return self.reads.store

    @property
    def ring(self) -> ChunkRing:
        """The chunk buffers (a copy has none until ``attach``)."""
        return self.reads.live_ring()

    @property
    def state_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def steps_done(self) -> int:
        """Completed steps: part of the bf16_sr rounding noise, saved in checkpoints."""
        return self.updater.steps_done

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        self.updater.steps_done = value

    @property
    def fused_elements(self) -> int:
        """Elements updated by the one-pass kernel so far."""
        return self.updater.fused_elements

    @property
    def listener(self) -> UpdateListener | None:
        return self.updater.listener

    @listener.setter
    def listener(self, value: UpdateListener | None) -> None:
        self.updater.listener = value

    def regions(self) -> list[StateRegion]:
        """The store regions of the state, in chunk order: what a strategy places, shelves or checkpoints."""
        return [StateRegion(c.region, self.capacity[c.index], tuple({id(p.param): p.param for p in c.pieces}.values()),
                            tuple(p for p in c.pieces if self.transfer.initialized(p))) for c in self.chunks]

    def _chunk_has_state(self, chunk: Chunk) -> bool:
        return any(self.transfer.initialized(p) for p in chunk.pieces)

    # ---- the step ---------------------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Keep up to ``prefetch_depth`` reads in flight, in update order. Called on entry to the step."""
        self.reads.prefetch(self.chunk_plan.order, self.updater.done)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Pipelined step: reads start now, the closure runs forward/backward, then every chunk is
        updated in order (in backward mode, those not already updated during backward), then the
        unchunked params. ``kwargs`` go to the optimizer's own step. Step hooks are not fired here
        (``optimizer.step()`` fires them once around this)."""
        if self.store is None:
            raise RuntimeError(f"this {type(self.optimizer).__name__} is a copy (deepcopy/pickle) of an offloaded "
                               f"optimizer; its state stays in the original's store {self.store_ref.path}. Step the "
                               "original optimizer.")
        OptimizerBinding.mark_called(self.optimizer)
        self.updater.begin(kwargs)
        self.prefetch()
        loss = None
        if closure is not None:
            with self.trigger.armed() if self.overlap == "backward" else nullcontext(), torch.enable_grad():
                loss = closure()
        self._follow_optimizer()
        self.updater.end()
        return loss

    def grad_ready(self, index: int) -> None:
        """Parameter ``index``'s gradient is final for this step (``grad_hooks=False``: the caller says so)."""
        self.trigger.grad_ready(index)

    def _follow_optimizer(self) -> None:
        """Plan, store and step from now on every parameter that has a gradient but no plan yet."""
        new = self.chunk_plan.joined()
        if not new:
            return
        if self.owned is not None:
            raise UnsupportedOptimizerError(
                f"nvme_offload_ddp: parameters {new} of {type(self.optimizer).__name__} became trainable after fit "
                "started (optimizer.add_param_group or requires_grad_(True), e.g. BackboneFinetuning); data-parallel "
                "ranks partition the optimizer state once at setup and cannot grow it. Make them trainable (and in "
                "the optimizer) from the start, or use strategy='nvme_offload' (single device).")
        if self.listener is not None:
            raise UnsupportedOptimizerError(
                f"nvme_offload: parameters {new} of {type(self.optimizer).__name__} became trainable after fit started "
                "(optimizer.add_param_group or requires_grad_(True), e.g. BackboneFinetuning); with offload_params=True "
                "the blocks written back after each update are fixed at setup. Make them trainable (and in the "
                "optimizer) from the start, or set offload_params=False.")
        extra = self.chunk_plan.plan_more(new)  # the same state format as the rest of the plan
        self.writeback.settle(block=True)  # no buffer of the ring still pending: the ring may be rebuilt
        self.reads.add(extra.chunks)
        self.chunk_plan.merge(extra)
        self.trigger.watch(extra.planned)

    def close(self) -> None:
        self.trigger.close()
        self.writeback.settle(block=True)  # a step that raised after updates in backward left one pending
        self.reads.close()

    def fence(self, durable: bool = False) -> None:
        self.reads.fence(durable)

    # ---- state in and out (``StateTransfer``) -------------------------------------------------------------
    def export_state(self, sink: StateSink, decoded: bool = False) -> None:
        """Stream every initialized piece's state to ``sink`` (see ``StateTransfer.export_state``)."""
        self.transfer.export_state(sink, decoded)

    def import_state(self, source: StateSource, stored: bool = False) -> None:
        """Replace the stored state with ``source``'s (see ``StateTransfer.import_state``)."""
        self.transfer.import_state(source, stored)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict in torch's own format, materialized in memory (for users who call
        ``optimizer.state_dict()`` or convert to a plain checkpoint; Lightning checkpoints stream instead).
        Works after ``fit`` too: the closed store is reopened for the call."""
        with self.store_open():
            return self.transfer.state_dict(self.steps_done)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch-format optimizer state (hyperparameters into the param groups, state into the store)."""
        self.steps_done = self.transfer.load_state_dict(state_dict)

    def set_param_groups(self, saved: list[dict[str, Any]]) -> dict[Any, int]:
        return self.transfer.set_param_groups(saved)

    def initialized(self, piece: Piece) -> bool:
        return self.transfer.initialized(piece)

    def planned_indices(self) -> set[int]:
        return self.transfer.planned_indices()

    def initialized_pieces(self) -> list[Piece]:
        return self.transfer.initialized_pieces()

    def scalar_state(self) -> dict[int, dict[str, Any]]:
        return self.transfer.scalar_state()

    def stored_state(self) -> list[tuple[int, tuple[int, ...], tuple[Any, ...]]]:
        return self.transfer.stored_state()

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

