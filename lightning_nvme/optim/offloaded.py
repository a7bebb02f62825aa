"""``OffloadedOptimizer``: a user's torch optimizer whose per-parameter state lives in a FlatStore.

The user's optimizer object stays the one Lightning, LR schedulers and callbacks see; its ``state``
stays empty. Its ``step`` is replaced on the instance (``binding``) by a pipelined step that, chunk by
chunk, reads the chunk's state into a ring buffer (``pipeline``), runs the optimizer's *own* update code on
it (``chunk_update``), and issues the write-back, while the next chunks are being read. Reads for the first
chunks start on entry to ``step``, i.e. while the closure still runs forward and backward; writes issued at
step N may still be in flight during step N+1's forward. The store orders a read after the last write to
the same bytes, so a chunk is never updated from stale state.

``overlap="backward"`` updates a chunk as soon as every parameter in it has its final gradient, and the
plan follows the optimizer (``plan_growth``); state goes in and out through ``state_transfer``.
Torch's step hooks fire once per ``optimizer.step()``, kwargs reach the optimizer's own step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_nvme.constants import MiB
from lightning_nvme.memory import keep_freed_heap
from lightning_nvme.optim import fused_update
from lightning_nvme.optim.binding import OptimizerBinding
from lightning_nvme.optim.buffers import DecodeArena
from lightning_nvme.optim.pipeline import ReadAhead
from lightning_nvme.optim.plan import Plan, plan_chunks
from lightning_nvme.optim.plan_growth import GrowingPlan
from lightning_nvme.optim.state_format import EXACT, StateFormat
from lightning_nvme.optim.state_io import DictSource, StateSink, StateSource, UpdateListener
from lightning_nvme.optim.state_transfer import StateTransfer
from lightning_nvme.optim.store_ref import StoreRef
from lightning_nvme.store import FlatStore

# Defaults of the strategies' arguments of the same names (lightning_nvme.settings reads them from here).
CHUNK_BYTES = 32 * MiB
PREFETCH_DEPTH = 2
OVERLAP_MODES = ("step", "backward")  # the first is the default

__all__ = ["CHUNK_BYTES", "OVERLAP_MODES", "PREFETCH_DEPTH", "OffloadedOptimizer", "StateSink", "StateSource",
           "UpdateListener"]


class OffloadedOptimizer(GrowingPlan, StateTransfer):
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
        self.name = name
        self.overlap = overlap
        self.prefetch_depth = prefetch_depth
        self.clip_value = clip_value
        self.owned = owned
        self.free_grads = free_grads
        self.listener = listener
        self.chunk_bytes = chunk_bytes
        self.store_ref = store_ref or StoreRef.of(store)
        self.fmt = fmt
        self.steps_done = 0
        self.plan = plan or plan_chunks(optimizer, chunk_bytes, name, owned=owned, fmt=fmt)
        self.chunks, self.resident, self.specs = self.plan.chunks, self.plan.resident, self.plan.specs
        self.pieces_of = defaultdict(list)
        self._index(self.plan)
        store.add_regions([(c.region, c.nbytes) for c in self.chunks])
        self.capacity = {c.index: store.region(c.region).capacity for c in self.chunks}
        self.reads = ReadAhead(store, self.chunks, self.capacity, prefetch_depth, self._chunk_has_state,
                               pin=any(p.device.type == "cuda" for p in self.params))
        self.arena = DecodeArena()
        self.scalars = {}
        self._known = [id(p) for p in self.params]
        self._signature = []
        self._unplanned = []
        self._step_kwargs = {}
        self._first_inner_run = True
        self._fused_plan = None
        self.fused_elements = 0
        self._empty_state = defaultdict(dict)
        self._done = set()
        self._armed = False
        self._waiting = {}
        self._hooks = []
        self.grad_hooks = grad_hooks
        self._set_order()
        if overlap == "backward" and grad_hooks:
            self._install_grad_hooks()
        existing = {i: dict(s) for i, s in self._indexed_state().items() if s}
        optimizer.state = self._empty_state
        self.import_state(DictSource(existing))
        OptimizerBinding(self).install()  # Lightning, schedulers and users all call the optimizer's own methods

    def prefetch(self) -> None:
        """Keep up to ``prefetch_depth`` reads in flight, in update order. Called on entry to the step."""
        self.reads.prefetch(self._order, self._done)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Pipelined step: reads start now, the closure runs forward/backward, then every chunk is
        updated in order (in backward mode, those not already updated during backward), then the
        resident params. ``kwargs`` go to the optimizer's own step. Step hooks are not fired here
        (``optimizer.step()`` fires them once around this)."""
        if self.store is None:
            raise RuntimeError(f"this {type(self.optimizer).__name__} is a copy (deepcopy/pickle) of an offloaded "
                               f"optimizer; its state stays in the original's store {self.store_ref.path}. Step the "
                               "original optimizer.")
        OptimizerBinding.mark_called(self.optimizer)
        self._done = set()
        self._step_kwargs = kwargs
        self._first_inner_run = True
        self._fused_plan = fused_update.plan(self.optimizer, self.fmt, kwargs)
        self.prefetch()
        loss = None
        if closure is not None:
            self._armed = self.overlap == "backward"
            self._waiting = {c.index: {p.index for p in c.pieces} for c in self.chunks}
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self._armed = False
        self._follow_optimizer()
        with keep_freed_heap():  # one chunk's update temporaries serve the next (returned at the end)
            for c in self._order:
                if c not in self._done:
                    self._update_chunk(c)
            self._update_resident()
        self._step_kwargs = {}
        self._fused_plan = None
        self.steps_done += 1
        return loss

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.reads.close()

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the open store, I/O buffers, pending reads (``ReadAhead`` drops those) and autograd
        hooks: a copy (deepcopy, pickle) reopens the store file through ``store_ref`` to read the state, and
        cannot step."""
        state = self.__dict__.copy()
        state.update(arena=DecodeArena(), _hooks=[], _armed=False)
        return state
