"""``OffloadedOptimizer``: a user's torch optimizer whose per-parameter state lives in a FlatStore.

The user's optimizer object stays the one Lightning, LR schedulers and callbacks see; its ``state``
stays empty. Its ``step`` is replaced on the instance by a pipelined step that, chunk by chunk,
reads the chunk's state into a ring buffer, runs the optimizer's *own* update code on it, and
issues the write-back, while the next chunks are being read. Reads for the first chunks start on
entry to ``step``, i.e. while the closure still runs forward and backward; writes issued at step N
may still be in flight during step N+1's forward. The store orders a read after the last write to
the same bytes, so a chunk is never updated from stale state.

``overlap="backward"`` updates a chunk as soon as every parameter in it has its final gradient
(``register_post_accumulate_grad_hook``), so most optimizer I/O hides behind backward compute.

The plan follows the optimizer: parameters without per-element state (plain SGD) are updated whole in
memory; a parameter that gets a gradient without being planned (``add_param_group``,
``requires_grad_(True)`` after setup) is planned, given store space and stepped from that step on.
Torch's step hooks fire once per ``optimizer.step()``, kwargs reach the optimizer's own step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from lightning_nvme.constants import MiB
from lightning_nvme.memory import keep_freed_heap, temporaries_off_heap, temporaries_on_heap
from lightning_nvme.optim.buffers import ChunkBuffer, ChunkRing, DecodeArena
from lightning_nvme.optim.plan import MASTER_KEY, Chunk, Piece, Plan, plan_chunks
from lightning_nvme.optim.probe import UnsupportedOptimizerError, raw_step
from lightning_nvme.optim.state_format import EXACT, STATE_DICT_KEY, Component, StateFormat
from lightning_nvme.optim.step_hooks import call_with_step_hooks, hooks_silenced
from lightning_nvme.optim.store_ref import StoreRef
from lightning_nvme.store import FlatStore, IOHandle

# Defaults of the strategies' arguments of the same names (lightning_nvme.settings reads them from here).
CHUNK_BYTES = 32 * MiB
PREFETCH_DEPTH = 2
OVERLAP_MODES = ("step", "backward")  # the first is the default

class StateSource(Protocol):
    """Where ``import_state`` reads per-parameter state from (a dict, a checkpoint file...)."""

    def tensor(self, index: int, key: str, start: int, stop: int) -> torch.Tensor | None: ...

    def scalars(self, index: int, tensor_keys: set[str]) -> dict[str, Any]: ...


class UpdateListener(Protocol):
    """Told around each chunk update (parameter offload: make the chunk's parameters resident first,
    write them back after). ``touched``: the chunk's parameters that have a gradient; ``finished``: those
    whose every piece is now updated in this step."""

    def before_update(self, touched: Sequence[torch.Tensor]) -> None: ...

    def after_update(self, touched: Sequence[torch.Tensor], finished: Sequence[torch.Tensor]) -> None: ...


class StateSink(Protocol):
    """Where ``export_state`` writes per-parameter state to, one piece at a time. ``values`` start at
    element ``piece.start // per`` of the entry ``key`` (``per`` > 1: per-block scales of a compressed key)."""

    def put(self, piece: Piece, key: str, values: torch.Tensor, per: int = 1) -> None: ...


def _view(buf: ChunkBuffer, piece: Piece, key: str, dtype: torch.dtype, shape: torch.Size | tuple) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    off = piece.slots[key]
    return buf.data[off:off + math.prod(shape) * size].view(dtype).view(shape)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


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
        self.store = store
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
        self.steps_done = 0  # completed steps: part of the bf16_sr rounding noise, saved in checkpoints
        self.plan = plan or plan_chunks(optimizer, chunk_bytes, name, owned=owned, fmt=fmt)
        self.chunks, self.resident, self.specs = self.plan.chunks, self.plan.resident, self.plan.specs
        # param index -> its pieces and their chunks (``None`` for a resident param)
        self.pieces_of: dict[int, list[tuple[Chunk | None, Piece]]] = defaultdict(list)
        self._index(self.plan)
        store.add_regions([(c.region, c.nbytes) for c in self.chunks])
        self.capacity = {c.index: store.region(c.region).capacity for c in self.chunks}
        self.ring = ChunkRing(store, prefetch_depth + 2, max(self.capacity.values(), default=4096))
        self.arena = DecodeArena()  # compressed formats: one chunk's decoded state
        self.scalars: dict[tuple[int, int], dict[str, Any]] = {}  # (param index, start) -> scalar state
        self._known = [id(p) for p in self.params]  # the param order the plan's indices refer to
        self._signature: list[tuple[int, int]] = []  # (id, length) of each group's param list when last checked
        self._unplanned: list[tuple[int, torch.Tensor]] = []  # params the plan has not decided on (frozen at setup)
        self._step_kwargs: dict[str, Any] = {}
        self._first_inner_run = True
        self._empty_state: defaultdict = defaultdict(dict)
        self._inflight: dict[int, tuple[ChunkBuffer, IOHandle | None]] = {}
        self._done: set[int] = set()
        self._armed = False
        self._waiting: dict[int, set[int]] = {}
        self._hooks: list[Any] = []
        self.grad_hooks = grad_hooks
        self._order = list(range(len(self.chunks)))
        if overlap == "backward":
            self._order.reverse()
            if grad_hooks:
                self._install_grad_hooks()
        existing = {i: dict(s) for i, s in self._indexed_state().items() if s}
        optimizer.state = self._empty_state
        self.import_state(_DictSource(existing))
        optimizer.step = _OffloadedStep(self)  # instance attribute: Lightning, schedulers and users all call it
        optimizer.state_dict = self.state_dict
        optimizer.load_state_dict = self.load_state_dict

    # ---- bookkeeping ----------------------------------------------------------------------------
    @property
    def _inner_step(self) -> Callable[..., Any]:
        return raw_step(self.optimizer)

    def _index(self, plan: Plan) -> None:
        for c in plan.chunks:
            for piece in c.pieces:
                self.pieces_of[piece.index].append((c, piece))
        for piece in plan.resident:
            self.pieces_of[piece.index].append((None, piece))

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _indexed_state(self) -> dict[int, dict]:
        return {i: self.optimizer.state.get(p, {}) for i, p in enumerate(self.params)}

    @property
    def state_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def _initialized(self, piece: Piece) -> bool:
        return (piece.index, piece.start) in self.scalars

    # ---- reads ahead ------------------------------------------------------------------------------
    def _issue_read(self, c: int) -> None:
        chunk = self.chunks[c]
        shelved = self.store.shelved(chunk.region)
        if shelved is not None:  # host_memory_budget: updated in place in memory; its "write" is then free
            self._inflight[c] = (ChunkBuffer(shelved[:self.capacity[c]], borrowed=True), None)
            return
        buf = self.ring.acquire()
        handle = None
        if any(self._initialized(p) for p in chunk.pieces):
            handle = self.store.read(chunk.region, buf.data[:self.capacity[c]])
        self._inflight[c] = (buf, handle)

    def prefetch(self) -> None:
        """Keep up to ``prefetch_depth`` reads in flight, in update order. Called on entry to the step."""
        for c in self._order:
            if len(self._inflight) >= self.prefetch_depth:
                break
            if c not in self._done and c not in self._inflight:
                self._issue_read(c)

    def _take(self, c: int) -> ChunkBuffer:
        if c not in self._inflight:
            self._issue_read(c)
        buf, handle = self._inflight.pop(c)
        if handle is not None:
            self.store.wait(handle)
        return buf

    # ---- the update -------------------------------------------------------------------------------
    def _nested_hooks(self, opt: Optimizer) -> AbstractContextManager[None]:
        """A custom step calling ``super().step()`` fires the hooks again inside, in torch too: let that happen
        in the first per-chunk run of a step only, so the counts and order are torch's."""
        first, self._first_inner_run = self._first_inner_run, False
        return nullcontext() if first else hooks_silenced(opt)

    def _update_resident(self) -> None:
        """Run the optimizer's own step on the resident params (no per-element state) with their state in memory."""
        work = [piece for piece in self.resident if piece.param.grad is not None]
        if not work:
            return
        params: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        state: defaultdict = defaultdict(dict)
        targets = []
        for piece in work:
            target = piece.param
            if piece.rounds_master:  # bf16_sr: the update runs on an fp32 copy, rounded back stochastically
                target = piece.param.detach().float()
                target.grad = piece.param.grad.float()
            targets.append(target)
            params[piece.group].append(target)
            if (piece.index, 0) in self.scalars:
                state[target] = self.scalars[(piece.index, 0)]
        self._step_on(params, state)
        for piece, target in zip(work, targets):
            if state.get(target):  # stateless optimizers (plain SGD) leave none, like torch's state_dict
                self.scalars[(piece.index, 0)] = state[target]
            if target is not piece.param:
                with torch.no_grad():
                    self.fmt.write_param(piece.param.detach(), target, self.steps_done, piece.index, 0)
                target.grad = None

    def _step_on(self, params: list[list[torch.Tensor]], state: defaultdict) -> None:
        """The optimizer's own step with ``params`` (per group) in its param groups and ``state`` as its state."""
        opt = self.optimizer
        groups = opt.param_groups
        saved_params = [g["params"] for g in groups]
        try:
            for g, ps in zip(groups, params):
                g["params"] = ps
            opt.state = state
            # Heap temporaries (no page faults per temporary) only after backward: during backward, backward's
            # own allocations land above each chunk's freed temporaries, so the heap could not reuse or shrink
            # them and grew with every chunk of the step (3 GiB at 2.5 B params, 1.2 B/param, with the model).
            heap = temporaries_on_heap() if not self._armed else temporaries_off_heap()
            with torch.no_grad(), heap, self._nested_hooks(opt):
                self._inner_step(opt, **self._step_kwargs)
        finally:
            for g, ps in zip(groups, saved_params):
                g["params"] = ps
            opt.state = self._empty_state

    def _update_chunk(self, c: int) -> None:
        buf = self._take(c)
        self._done.add(c)
        self.prefetch()
        chunk = self.chunks[c]
        touched = list({id(p.param): p.param for p in chunk.pieces if p.param.grad is not None}.values())
        if self.listener is not None:
            self.listener.before_update(touched)
        changed = self._run_inner_step(chunk, buf)
        handle = self.store.write(chunk.region, buf.data[:self.capacity[c]]) if changed else None
        self.ring.release(buf, handle)
        finished = [p for p in touched if all(other.index in self._done for other, _ in self.pieces_of[
            self._index_of(chunk, p)])]
        if self.free_grads:
            for p in finished:
                p.grad = None  # consumed: gradient memory is bounded by the chunks not yet updated
        if self.listener is not None:
            self.listener.after_update(touched, finished)
        self.prefetch()

    @staticmethod
    def _index_of(chunk: Chunk, param: torch.Tensor) -> int:
        return next(p.index for p in chunk.pieces if p.param is param)

    def _run_inner_step(self, chunk: Chunk, buf: ChunkBuffer) -> bool:
        """Run the optimizer's own ``step`` on this chunk's pieces, with state views into ``buf``.

        On an accelerator the chunk's state is copied to the parameters' device for the update and
        back into ``buf`` afterwards (device memory: one chunk)."""
        chunk_params: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        state: defaultdict = defaultdict(dict)
        self.arena.reset(DecodeArena.need([size for p in chunk.pieces if p.param.grad is not None
                                           for size in self._temporaries(p)]))
        work = [w for w in (self._prepare_piece(piece, buf, state) for piece in chunk.pieces) if w is not None]
        if not work:
            return False
        for piece, target, _, _ in work:
            chunk_params[piece.group].append(target)
        self._step_on(chunk_params, state)
        for piece, target, host, working in work:
            self._finish_piece(piece, target, host, working, state[target], buf)
        return True

    def _prepare_piece(self, piece: Piece, buf: ChunkBuffer, state: defaultdict):
        """The tensor the optimizer will update for ``piece`` (the param, a range of it, or its fp32
        master), with its grad set and its state (if any yet) in ``state``."""
        p = piece.param
        if p.grad is None:
            return None
        shape = p.shape if piece.whole else (piece.numel,)
        host = {k: self._load(buf, piece, k, d, self.arena).view(shape) for k, d in piece.keys}
        working = host if p.device.type == "cpu" else {
            k: v.to(p.device, non_blocking=True) for k, v in host.items()}
        working = dict(working)
        grad = p.grad if piece.whole else _flat(p.grad)[piece.start:piece.stop]
        if self.clip_value is not None:
            grad.clamp_(min=-self.clip_value, max=self.clip_value)
        master = working.pop(MASTER_KEY, None)
        if piece.rounds_master:  # bf16_sr: no stored master, the update runs on an fp32 copy of the param
            master = self._fp32(p.detach() if piece.whole else _flat(p.detach())[piece.start:piece.stop])
        if master is not None:
            if not self._initialized(piece):
                master.copy_(p.detach() if piece.whole else _flat(p.detach())[piece.start:piece.stop])
            target = master
            target.grad = self._fp32(grad)
        elif piece.whole:
            target = p
        else:
            target = _flat(p.detach())[piece.start:piece.stop]
            target.grad = grad
        if self._initialized(piece):
            state[target] = {**working, **self.scalars[(piece.index, piece.start)]}
        if master is not None:
            working[MASTER_KEY] = master
        return piece, target, host, working

    def _finish_piece(self, piece: Piece, target: torch.Tensor, host: dict[str, torch.Tensor],
                      working: dict[str, torch.Tensor], new: dict[str, Any], buf: ChunkBuffer) -> None:
        """Bring the updated state back into the chunk buffer and keep the scalar state in memory."""
        scalars = {}
        for key, value in new.items():
            if key in host:
                self._store(buf, piece, key, value)
            else:
                scalars[key] = value
        self.scalars[(piece.index, piece.start)] = scalars
        if MASTER_KEY in working:
            if MASTER_KEY in host:
                self._store(buf, piece, MASTER_KEY, working[MASTER_KEY])
            dst = piece.param.detach() if piece.whole else _flat(piece.param.detach())[piece.start:piece.stop]
            self.fmt.write_param(dst, target, self.steps_done, piece.index, piece.start)
            target.grad = None
        elif not piece.whole:
            target.grad = None

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Pipelined step: reads start now, the closure runs forward/backward, then every chunk is
        updated in order (in backward mode, those not already updated during backward), then the
        resident params. ``kwargs`` go to the optimizer's own step. Step hooks are not fired here
        (``optimizer.step()`` fires them once around this)."""
        if self.store is None:
            raise RuntimeError(f"this {type(self.optimizer).__name__} is a copy (deepcopy/pickle) of an offloaded "
                               f"optimizer; its state stays in the original's store {self.store_ref.path}. Step the "
                               "original optimizer.")
        self.optimizer._opt_called = True  # what an LR scheduler's step-tracking wrapper would set
        self._done = set()
        self._step_kwargs = kwargs
        self._first_inner_run = True
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
        self.steps_done += 1
        return loss

    # ---- the plan follows the optimizer -------------------------------------------------------------
    def _follow_optimizer(self) -> None:
        """Plan, store and step from now on every parameter that has a gradient but no plan yet."""
        signature = [(id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups]
        if signature != self._signature:  # groups added or edited: check what changed (cheap path otherwise)
            params = self.params
            if len(params) < len(self._known) or any(id(p) != k for p, k in zip(params, self._known)):
                raise UnsupportedOptimizerError(
                    f"{type(self.optimizer).__name__}: parameters were removed from or reordered in its param "
                    "groups during training; the offloaded state follows parameters by position, so only appending "
                    "(optimizer.add_param_group) is supported. Rebuild the optimizer, or use strategy='auto'.")
            self._known, self._signature = [id(p) for p in params], signature
            self._unplanned = [(i, p) for i, p in enumerate(params) if i not in self.plan.planned]
        new = [i for i, p in self._unplanned if p.grad is not None]
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
        extra = plan_chunks(self.optimizer, self.chunk_bytes, self.name, only=new, first_chunk=len(self.chunks),
                            specs=self.specs, fmt=self.fmt)  # the same state format as the rest of the plan
        self._drain_reads()
        self.store.add_regions([(c.region, c.nbytes) for c in extra.chunks])
        self.capacity.update({c.index: self.store.region(c.region).capacity for c in extra.chunks})
        need = max(self.capacity.values(), default=4096)
        if need > self.ring.nbytes:
            self.fence()  # no write may still read from the old buffers
            self.ring = ChunkRing(self.store, self.prefetch_depth + 2, need)
        self.chunks.extend(extra.chunks)
        self.resident.extend(extra.resident)
        self.plan.planned |= extra.planned
        self._unplanned = [(i, p) for i, p in self._unplanned if i not in extra.planned]
        self._index(extra)
        self._order = list(range(len(self.chunks)))
        if self.overlap == "backward":
            self._order.reverse()
            if self.grad_hooks:
                self._install_grad_hooks(extra.planned)

    # ---- overlap="backward" -------------------------------------------------------------------------
    def _install_grad_hooks(self, indices: set[int] | None = None) -> None:
        for index, p in enumerate(self.params):
            if p.requires_grad and (indices is None or index in indices):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(index)))

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self.grad_ready(index)
        return hook

    def grad_ready(self, index: int) -> None:
        """Parameter ``index``'s gradient is final for this step: update every chunk now complete."""
        if not self._armed:
            return
        for chunk, _piece in self.pieces_of.get(index, []):
            if chunk is None:
                continue  # resident: updated after the chunks
            waiting = self._waiting.get(chunk.index)
            if waiting is None:
                continue
            waiting.discard(index)
            if not waiting and chunk.index not in self._done:
                with keep_freed_heap(trim=False):  # pieces of this chunk share temporaries; backward's heap kept
                    self._update_chunk(chunk.index)

    def _temporaries(self, piece: Piece) -> list[tuple[int, torch.dtype]]:
        """The fp32 tensors ``_prepare_piece`` takes from the arena for ``piece``: decoded state keys, and
        for half-precision params the fp32 gradient (and the master that ``bf16_sr`` does not store)."""
        sizes = [(piece.numel, d) for k, d in piece.keys if self.fmt.compresses(k, d)]
        has_master = piece.rounds_master or any(k == MASTER_KEY for k, _ in piece.keys)
        return sizes + [(piece.numel, torch.float32)] * (has_master + piece.rounds_master)

    def _fp32(self, t: torch.Tensor) -> torch.Tensor:
        """``t.float()`` in the arena (CPU; a fresh tensor on an accelerator)."""
        if t.device.type != "cpu":
            return t.float()
        return self.arena.take(t.numel(), torch.float32).view(t.shape).copy_(t)

    # ---- state format hooks: the chunk buffer holds each key as stored (see state_format) ----------------
    def _raws(self, buf: ChunkBuffer, piece: Piece, key: str) -> list[torch.Tensor]:
        return [_view(buf, piece, c.name, c.dtype, (c.count(piece.numel),)) for c in piece.components[key]]

    def _load(self, buf: ChunkBuffer, piece: Piece, key: str, dtype: torch.dtype,
              arena: DecodeArena | None = None) -> torch.Tensor:
        """Key ``key`` of ``piece`` as the optimizer sees it (1-D; a view into ``buf`` when stored as is,
        else decoded into ``arena`` or a new tensor)."""
        out = arena.take(piece.numel, dtype) if arena is not None and self.fmt.compresses(key, dtype) else None
        return self.fmt.decode(key, dtype, self._raws(buf, piece, key), out)

    def _store(self, buf: ChunkBuffer, piece: Piece, key: str, value: torch.Tensor) -> None:
        self.fmt.encode(key, _flat(value), self._raws(buf, piece, key), f" of parameter {piece.index}")

    # ---- moving state in and out ----------------------------------------------------------------------
    def fence(self, durable: bool = False) -> None:
        self.store.fence([c.region for c in self.chunks], durable=durable)

    def export_state(self, sink: StateSink, decoded: bool = False) -> None:
        """Stream every initialized piece's state to ``sink``, one chunk buffer at a time, reading the
        next chunks while the sink consumes this one. ``decoded``: the optimizer's view of each key
        (torch format) instead of what the store holds (compressed formats: codes and scales)."""
        self.fence()
        order = [c for c, chunk in enumerate(self.chunks) if any(self._initialized(p) for p in chunk.pieces)]
        for i, c in enumerate(order):
            for ahead in order[i + 1:i + 1 + self.prefetch_depth - len(self._inflight)]:
                if ahead not in self._inflight:
                    self._issue_read(ahead)
            buf = self._take(c)
            try:
                for piece in self.chunks[c].pieces:
                    if not self._initialized(piece):
                        continue
                    if decoded:
                        for key, dtype in piece.keys:
                            sink.put(piece, key, self._load(buf, piece, key, dtype))
                    else:
                        for comp in piece.stored():
                            sink.put(piece, comp.name, _view(buf, piece, comp.name, comp.dtype,
                                                             (comp.count(piece.numel),)), comp.per)
            finally:
                self.ring.release(buf)

    def import_state(self, source: StateSource, stored: bool = False) -> None:
        """Replace the stored state with ``source``'s, one chunk at a time (pieces absent from the
        source become uninitialized, as in a fresh optimizer). ``stored``: the source holds the state as
        this optimizer's format stores it (a checkpoint of the same format), else in torch's format."""
        self.fence()
        for c, chunk in enumerate(self.chunks):
            buf = self.ring.acquire()
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
                    tensors[MASTER_KEY] = _flat(p)[piece.start:piece.stop]  # plain checkpoint: params are the master
                if any(v is None for v in tensors.values()):
                    continue
                for key, dtype in piece.keys:
                    self._store(buf, piece, key, tensors[key].to(dtype))
                self.scalars[(piece.index, piece.start)] = dict(source.scalars(piece.index, set(tensors)))
                wrote = True
            handle = self.store.write(chunk.region, buf.data[:self.capacity[c]]) if wrote else None
            self.ring.release(buf, handle)
        for piece in self.resident:
            self.scalars.pop((piece.index, 0), None)
            state = source.scalars(piece.index, set())
            if state:
                self.scalars[(piece.index, 0)] = dict(state)
        self.fence()

    def _import_stored(self, source: StateSource, piece: Piece, buf: ChunkBuffer) -> bool:
        comps = piece.stored()
        tensors = [source.tensor(piece.index, c.name, piece.start // c.per, -(-piece.stop // c.per)) for c in comps]
        if any(t is None for t in tensors):
            return False
        for comp, t in zip(comps, tensors):
            _view(buf, piece, comp.name, comp.dtype, (comp.count(piece.numel),)).copy_(_flat(t))
        names = {k for k, _ in piece.keys} | {c.name for c in comps}
        self.scalars[(piece.index, piece.start)] = dict(source.scalars(piece.index, names))
        return True

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict in torch's own format, materialized in memory (for users who call
        ``optimizer.state_dict()`` or convert to a plain checkpoint; Lightning checkpoints stream instead).
        Works after ``fit`` too: the closed store is reopened for the call."""
        sink = _DictSink()
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
        self.import_state(_DictSource({position[k]: v for k, v in state_dict["state"].items()}))

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
        self.store = store
        if self.ring is None:  # a copy: buffers are recreated, not pickled
            self.ring = ChunkRing(store, self.prefetch_depth + 2, max(self.capacity.values(), default=4096))
        self.ring.store = store

    @contextmanager
    def store_open(self) -> Iterator[FlatStore]:
        """The store, reopened from ``store_ref`` for the call if it is closed (after ``fit``, or in a copy)."""
        if self.store is not None and not self.store._closed:
            yield self.store
            return
        store = self.store_ref.open()
        try:
            self.attach(store)
            yield store
        finally:
            store.close()

    def _drain_reads(self) -> None:
        for c in list(self._inflight):
            buf, handle = self._inflight.pop(c)
            if handle is not None:
                handle.wait(self.store.io_timeout_s)
            self.ring.release(buf)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._drain_reads()

    # ---- copies ---------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the open store, I/O buffers, pending reads and autograd hooks: a copy (deepcopy,
        pickle) reopens the store file through ``store_ref`` to read the state, and cannot step."""
        state = self.__dict__.copy()
        state.update(store=None, ring=None, arena=DecodeArena(), _inflight={}, _hooks=[], _armed=False)
        return state


class _OffloadedStep:
    """``optimizer.step`` of an offloaded optimizer: torch's step hooks once, then the offloaded step.

    A class rather than a closure so the optimizer stays picklable; ``_wrapped_by_lr_sched`` tells an LR
    scheduler the step is already tracked (the offloaded step sets ``_opt_called`` itself)."""

    _wrapped_by_lr_sched = True

    def __init__(self, offloaded: OffloadedOptimizer) -> None:
        self.offloaded = offloaded

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        off = self.offloaded
        return call_with_step_hooks(off.optimizer, lambda _opt, *a, **kw: off.step(*a, **kw),
                                    (off.optimizer, *args), kwargs)


class _DictSource:
    """State from a ``{param index: {key: tensor or scalar}}`` dict (torch's format, indexed by position)."""

    def __init__(self, state: dict[int, dict[str, Any]]) -> None:
        self.state = state

    def tensor(self, index: int, key: str, start: int, stop: int) -> torch.Tensor | None:
        value = self.state.get(index, {}).get(key)
        return _flat(value)[start:stop] if torch.is_tensor(value) else None

    def scalars(self, index: int, tensor_keys: set[str]) -> dict[str, Any]:
        return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.state.get(index, {}).items()
                if k not in tensor_keys}


class _DictSink:
    """Collects exported pieces into full tensors shaped like their parameters."""

    def __init__(self) -> None:
        self.parts: dict[int, dict[str, list[tuple[int, torch.Tensor]]]] = defaultdict(lambda: defaultdict(list))

    def put(self, piece: Piece, key: str, values: torch.Tensor, per: int = 1) -> None:
        self.parts[piece.index][key].append((piece.start // per, values.clone()))

    def full(self, params: list[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        out: dict[int, dict[str, torch.Tensor]] = {}
        for index, keys in self.parts.items():
            shape = params[index].shape
            out[index] = {k: torch.cat([v for _, v in sorted(parts, key=lambda x: x[0])]).view(shape)
                          for k, parts in keys.items()}
        return out
