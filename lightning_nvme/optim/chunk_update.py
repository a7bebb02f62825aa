"""``ChunkUpdater``: one chunk's update, run by the user's optimizer's own ``step`` on views of its state.

Why this shape: the optimizer's code is the reference for what an update is, so it runs unchanged: its
param groups hold the chunk's pieces (or their fp32 masters) and its ``state`` the chunk's decoded state,
for the duration of one call. Masters of half-precision params are stored like any other key
(``master_format="fp32"``) or re-made from the param and rounded back stochastically (``"bf16_sr"``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_nvme.memory import (
    FIRST_UPDATE_OFF_HEAP_THRESHOLD,
    keep_freed_heap,
    temporaries_off_heap,
    temporaries_on_heap,
)
from lightning_nvme.optim import chunk_views
from lightning_nvme.optim.binding import hooks_silenced
from lightning_nvme.optim.buffers import ChunkBuffer, DecodeArena
from lightning_nvme.optim.chunk_views import flat
from lightning_nvme.optim.formats import fused_update
from lightning_nvme.optim.formats.state_format import StateFormat
from lightning_nvme.optim.pipeline import ReadAhead, WriteBack
from lightning_nvme.optim.plan import MASTER_KEY, Chunk, ChunkPlan, Piece
from lightning_nvme.optim.probe import raw_step
from lightning_nvme.optim.state_io import UpdateListener

# The tensor the optimizer updates for a piece, and the state it came with: (piece, target, stored keys as
# read, keys as the update sees them).
Work = tuple[Piece, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]
Scalars = dict[tuple[int, int], dict[str, Any]]  # (param index, piece start) -> the piece's scalar state (``step``)


class ChunkUpdater:
    """Updates chunks (``update_chunk``) and the unchunked params, one step at a time (``begin`` ... ``end``).

    Args:
        optimizer: the user's optimizer, whose own step runs on each chunk.
        plan: the chunks and pieces (read; grown by its owner between steps).
        reads: the read-ahead the chunks' buffers come from.
        writeback: where updated chunks go back to the store (and, from a device, how the state is copied back).
        scalars: the scalar state of every initialized piece (shared with the state transfer; a piece is
            initialized when it has an entry).
        empty_state: what ``optimizer.state`` is between updates.
        fmt: how the state is stored.
        clip_value: element-wise gradient value clipping applied before each chunk's update.
        free_grads: set a parameter's ``.grad`` to ``None`` once every piece of it is updated.
        listener: told before and after each chunk update (settable: a strategy sets it after building).
    """

    def __init__(self, optimizer: Optimizer, plan: ChunkPlan, reads: ReadAhead, writeback: WriteBack, scalars: Scalars,
                 empty_state: defaultdict[Any, dict[str, Any]], *, fmt: StateFormat, clip_value: float | None,
                 free_grads: bool, listener: UpdateListener | None) -> None:
        self.optimizer = optimizer
        self.plan = plan
        self.reads = reads
        self.writeback = writeback
        self.ops = writeback.ops  # the device copies (None: parameters on CPU, the update runs on the buffer)
        self.scalars = scalars
        self.empty_state = empty_state
        self.fmt = fmt
        self.clip_value = clip_value
        self.free_grads = free_grads
        self.listener = listener
        self.arena = DecodeArena()  # compressed formats: one chunk's decoded state
        self.done: set[int] = set()  # chunks updated in this step
        self.steps_done = 0  # completed steps: part of the bf16_sr rounding noise, saved in checkpoints
        self.fused_elements = 0  # elements updated by the one-pass kernel so far (telemetry, tests)
        self._step_kwargs: dict[str, Any] = {}  # kwargs of the current ``optimizer.step()`` call
        self._first_inner_run = True  # no per-chunk run of the optimizer's step has happened yet in this step
        self._fused_plan: fused_update.FusedPlan | None = None  # the pieces of this step the kernel updates
        self._in_backward = False  # the update runs inside backward (an autograd hook)

    @property
    def _inner_step(self) -> Callable[..., Any]:
        return raw_step(self.optimizer)

    def initialized(self, piece: Piece) -> bool:
        return (piece.index, piece.start) in self.scalars

    def begin(self, kwargs: dict[str, Any]) -> None:
        """A new ``optimizer.step(**kwargs)``: no chunk is updated yet."""
        self.done = set()
        self._step_kwargs = kwargs
        self._first_inner_run = True
        self._fused_plan = fused_update.plan(self.optimizer, self.fmt, kwargs)

    def end(self) -> None:
        """Update every chunk not updated during backward, in order, then the unchunked params."""
        with keep_freed_heap():  # one chunk's update temporaries serve the next (returned at the end)
            for c in self.plan.order:
                if c not in self.done:
                    self.update_chunk(c)
            self._update_unchunked()
        self.writeback.settle(block=True)  # every write of the step issued: a checkpoint may fence them
        self._step_kwargs = {}
        self._fused_plan = None
        self.steps_done += 1

    def __getstate__(self) -> dict[str, Any]:
        """A copy (deepcopy, pickle) gets an empty decode arena."""
        return {**self.__dict__, "arena": DecodeArena()}

    def _nested_hooks(self, opt: Optimizer) -> AbstractContextManager[None]:
        """A custom step calling ``super().step()`` fires the hooks again inside, in torch too: let that happen
        in the first per-chunk run of a step only, so the counts and order are torch's."""
        first, self._first_inner_run = self._first_inner_run, False
        return nullcontext() if first else hooks_silenced(opt)

    def _update_unchunked(self) -> None:
        """Run the optimizer's own step on the unchunked params (no per-element state) with their state in memory."""
        work = [piece for piece in self.plan.unchunked if piece.param.grad is not None]
        if not work:
            return
        params: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        targets = []
        for piece in work:
            target = piece.param
            grad = piece.param.grad
            if piece.rounds_master and grad is not None:  # bf16_sr: the update runs on an fp32 copy, rounded back
                target = piece.param.detach().float()
                target.grad = grad.float()
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

    def _step_on(self, params: list[list[torch.Tensor]], state: defaultdict[Any, dict[str, Any]]) -> None:
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
            # A piece without state yet (the first update): the optimizer allocates its state here, off the heap
            # at a lower threshold (``memory.FIRST_UPDATE_OFF_HEAP_THRESHOLD``).
            fresh = any(not state.get(p) for ps in params for p in ps)
            heap = (temporaries_on_heap() if not self._in_backward else
                    temporaries_off_heap(FIRST_UPDATE_OFF_HEAP_THRESHOLD) if fresh else temporaries_off_heap())
            with torch.no_grad(), heap, self._nested_hooks(opt):
                self._inner_step(opt, **self._step_kwargs)
        finally:
            for g, ps in zip(groups, saved_params):
                g["params"] = ps
            opt.state = self.empty_state

    def update_chunk(self, c: int, in_backward: bool = False) -> None:
        """Update chunk ``c`` (read ahead or read now), issue its write-back and keep the reads going.
        ``in_backward``: called from a gradient hook (``BackwardTrigger``) while backward runs."""
        self.writeback.settle()
        buf = self.reads.take(c)
        self.done.add(c)
        self.reads.prefetch(self.plan.order, self.done)
        chunk = self.plan.chunks[c]
        touched = list({id(p.param): p.param for p in chunk.pieces if p.param.grad is not None}.values())
        self._in_backward = in_backward
        try:
            if self.listener is not None:
                self.listener.before_update(touched)
            changed = self._run_inner_step(chunk, buf)
        except BaseException:
            # The buffer goes back to the ring, never written (its state may be half updated): a failed update
            # must not cost the ring one of its buffers. The blocks it held are let go at the end of fit.
            self.writeback.abandon(buf)
            raise
        finally:
            self._in_backward = False
        self.writeback.issue(c, buf, changed)
        finished = [p for p in touched if self.plan.finished(chunk, p, self.done)]
        if self.free_grads:
            for p in finished:
                p.grad = None  # consumed: gradient memory is bounded by the chunks not yet updated
        if self.listener is not None:
            self.listener.after_update(touched, finished)
        self.reads.prefetch(self.plan.order, self.done)

    def _run_inner_step(self, chunk: Chunk, buf: ChunkBuffer) -> bool:
        """Run the optimizer's own ``step`` on this chunk's pieces, with state views into ``buf``.

        On an accelerator the chunk's state is copied to the parameters' device for the update and
        back into ``buf`` afterwards (device memory: one chunk)."""
        chunk_params: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        fused = self._fused_plan
        fast = [p for p in chunk.pieces if fused is not None and fused.covers(p)]
        kernel = {id(p) for p in fast}
        generic = [p for p in chunk.pieces if p.param.grad is not None and id(p) not in kernel]
        for piece in fast:
            self._update_fused(piece, buf)
        self.arena.reset(DecodeArena.need([size for p in generic for size in self._temporaries(p)]))
        work = [w for w in (self._prepare_piece(piece, buf, state) for piece in generic) if w is not None]
        if not work:
            return bool(fast)
        device = work[-1][0].param.device
        if self.ops is not None:  # the buffer is not read into again before the copies to the device have completed
            buf.uploaded = self.ops.event()
            buf.uploaded.record(self.ops.current_stream(device))
        for piece, target, _, _ in work:
            chunk_params[piece.group].append(target)
        self._step_on(chunk_params, state)
        if self.ops is not None:
            self.writeback.begin(chunk.index, buf)
        for piece, target, host, working in work:
            self._finish_piece(piece, target, host, working, state[target], buf)
        return True

    def _update_fused(self, piece: Piece, buf: ChunkBuffer) -> None:
        """``piece`` through the one-pass kernel (``fused_update``): its full blocks there, its last partial
        block through the optimizer's own step, which computes those elements in torch's scalar tail."""
        grad = flat(piece.param.grad)[piece.start:piece.stop]  # type: ignore[arg-type]
        if self.clip_value is not None:
            grad.clamp_(min=-self.clip_value, max=self.clip_value)
        key = (piece.index, piece.start)
        initialized = key in self.scalars
        scalars = self.scalars[key] if initialized else {"step": torch.zeros((), dtype=torch.float32)}
        before = scalars["step"].clone()
        scalars["step"] += 1  # what torch's fused step does before its kernel
        raws = {k: chunk_views.raws(buf, piece, k) for k in fused_update.KEYS}
        group = self.optimizer.param_groups[piece.group]
        done = fused_update.update_blocks(piece, group, scalars["step"], raws, initialized, self.steps_done,
                                          fused_update.threads(piece.numel))
        self.scalars[key] = scalars
        self.fused_elements += done
        if done == piece.numel:
            return
        rest = {k: [raws[k][0][done:], raws[k][1][done // fused_update.BLOCK:]] for k in fused_update.KEYS}
        param = flat(piece.param.detach())[piece.start + done:piece.stop]
        master = param.float()
        master.grad = grad[done:].float()
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        if initialized:
            state[master] = {"step": before, **{k: self.fmt.decode(k, torch.float32, r) for k, r in rest.items()}}
        params: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        params[piece.group].append(master)
        self._step_on(params, state)
        for k, r in rest.items():
            self.fmt.encode(k, state[master][k], r, f" of parameter {piece.index}")
        self.fmt.write_param(param, master, self.steps_done, piece.index, piece.start + done)
        master.grad = None

    def _prepare_piece(self, piece: Piece, buf: ChunkBuffer, state: defaultdict[Any, dict[str, Any]]) -> Work | None:
        """The tensor the optimizer will update for ``piece`` (the param, a range of it, or its fp32
        master), with its grad set and its state (if any yet) in ``state``."""
        p = piece.param
        if p.grad is None:
            return None
        shape = p.shape if piece.whole else (piece.numel,)
        host = {k: chunk_views.load(self.fmt, buf, piece, k, d, self.arena).view(shape) for k, d in piece.keys}
        if self.ops is None:
            working = dict(host)
        elif self.initialized(piece):
            working = {k: torch.empty_like(v, device=p.device) for k, v in host.items()}
            for k, v in host.items():  # on the compute stream: the update queued after them reads them
                self.ops.copy(working[k], v)
        else:  # nothing stored yet: nothing to upload (the optimizer initializes its state, the master is copied)
            working = {k: torch.empty_like(v, device=p.device) for k, v in host.items()}
        grad = p.grad if piece.whole else flat(p.grad)[piece.start:piece.stop]
        if self.clip_value is not None:
            grad.clamp_(min=-self.clip_value, max=self.clip_value)
        master = working.pop(MASTER_KEY, None)
        if piece.rounds_master:  # bf16_sr: no stored master, the update runs on an fp32 copy of the param
            master = self._fp32(p.detach() if piece.whole else flat(p.detach())[piece.start:piece.stop])
        if master is not None:
            if not self.initialized(piece):
                master.copy_(p.detach() if piece.whole else flat(p.detach())[piece.start:piece.stop])
            target = master
            target.grad = self._fp32(grad)
        elif piece.whole:
            target = p
        else:
            target = flat(p.detach())[piece.start:piece.stop]
            target.grad = grad
        if self.initialized(piece):
            state[target] = {**working, **self.scalars[(piece.index, piece.start)]}
        if master is not None:
            working[MASTER_KEY] = master
        return piece, target, host, working

    def _finish_piece(self, piece: Piece, target: torch.Tensor, host: dict[str, torch.Tensor],
                      working: dict[str, torch.Tensor], new: dict[str, Any], buf: ChunkBuffer) -> None:
        """Bring the updated state back into the chunk buffer (from a device: queued, ``WriteBack``) and keep
        the scalar state in memory."""
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
            dst = piece.param.detach() if piece.whole else flat(piece.param.detach())[piece.start:piece.stop]
            self.fmt.write_param(dst, target, self.steps_done, piece.index, piece.start)
            target.grad = None
        elif not piece.whole:
            target.grad = None

    def _store(self, buf: ChunkBuffer, piece: Piece, key: str, value: torch.Tensor) -> None:
        if self.ops is None:
            chunk_views.store(self.fmt, buf, piece, key, value)
        else:
            self.writeback.copy(piece, key, value)

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
