"""``ShardedParams``: each block's parameters sharded 1/N across data-parallel ranks, each rank's shard in its store.

The engine of ``nvme_offload_fsdp`` (ZeRO stage 3 with an NVMe tier). Per block (``params.policy`` decides which
modules are blocks, as for ``offload_params``), per step::

    forward   pre-hook: read this rank's shard (read ahead ``prefetch`` blocks) -> all_gather -> bind -> compute;
              the next block's all_gather is started here, asynchronously, and runs while this block computes
              post-hook: unbind (placeholders), the gathered block is freed
    backward  a hook on the block's outputs: read the shard, all_gather again, bind
              once every trainable parameter's gradient is accumulated: reduce_scatter of the block's flat
              gradient (pre-scaled by 1/N, as DDP averages) -> the owned shard of the averaged gradient
              the optimizer updates the owned elements (``OffloadedOptimizer(owned=...)``, told by ``reduced``),
              then the updated shard is written back to the store asynchronously; the identity function on the
              block's inputs says when the block's backward is over, and the block is unbound

Parameters outside every block (embeddings, tied heads, final norms) stay in memory on every rank, replicated as
under DDP: their gradients are all-reduced (same pre-scaling) as each becomes final, each rank updates the 1/N of
their elements it owns (so their optimizer state is sharded too), and one all-gather after the step makes the
replicas equal again.

Every collective runs on ``group`` from a module or autograd hook whose order is the same on every rank (the same
model, the same graph); an optimizer update never communicates, because each rank updates only its own shard from
its own store. The block's shard goes through ``BlockResidency`` (the store reads, the bounded write-backs, the
shelf), as a one-parameter block: its values are the shard.
``ShardedParams`` arguments: ``model`` (the LightningModule: its blocks are sharded, every other parameter stays
replicated); ``block_classes`` (as ``offload_params``' ``param_block_classes``); ``rank``, ``world``; ``group`` (the
process group of the gathers and reductions: its own, so they never interleave with others'); ``prefetch`` (blocks
whose shard is read ahead); ``device`` (where gathered blocks and gradients live); ``reduced`` (called with the
parameters whose averaged, owned gradient is final: the strategy hands them to the offloaded optimizer's
``grad_ready``, which may update them at once); ``reduce_order`` (``"rank"``: every gradient element summed in
rank order, ``lightning_nvme.params.ordered_sum``, so the result equals DDP with ``ordered_allreduce_hook``
bitwise at any N; ``"backend"``: the backend's reduce-scatter and all-reduce, whose order is its own);
``inflight`` (reductions started and not yet waited for, at most: each keeps its block gathered and its flat
gradient alive until its update); ``state_align`` (elements: the optimizer state format's block, on which every cut
falls, ``FlatShards``); ``comm`` (``params.comm``: how the gathers and all-to-alls move bytes; default the backend of
``group``).

Overlap: in both passes the next block's all-gather is started (asynchronously) before this block computes, and
in backward a block's reduction is started as its last gradient arrives and waited for ``inflight`` reductions
later (or at the end of backward), so the collectives of one block run while the next computes. Every wait is in
the same order on every rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_nvme.checkpoint.weights import BesideWeight
from lightning_nvme.optim.plan import placeholder
from lightning_nvme.params.comm import BackendComm, Comm
from lightning_nvme.params.layout import BlockLayout, ParamSlot, plan_layout
from lightning_nvme.params.materialize import (
    InitialWeights,
    RangedWeights,
    copy_range_checked,
    has_meta_tensors,
    initial_weights,
    materialize,
    ranged,
)
from lightning_nvme.params.ordered_sum import ScatterSum
from lightning_nvme.params.policy import BlockClasses, find_blocks, model_block_classes
from lightning_nvme.params.residency import BlockResidency
from lightning_nvme.params.schedule import (
    _PostBackward,  # the same post-backward trigger as one device's
    in_backward,
)
from lightning_nvme.params.sharded_weights import ShardedWeights
from lightning_nvme.params.shards import FlatShards
from lightning_nvme.params.spare import SpareBuffers
from lightning_nvme.params.transfer import HostTransfer

FWD, BWD, UPDATE, USER, RECOMPUTE, GATHER, REDUCE = ("forward", "backward", "update", "user", "recompute", "gather",
                                                   "reduce")
REDUCE_ORDERS = ("rank", "backend")  # ``reduce_order``: the sum in rank order (ScatterSum), or the backend's own


class _BackendSum:
    """The backend's own reduction, started asynchronously: ``reduce_scatter`` of ``flat`` (``wait()``: this rank's
    piece of the sum) or, with ``whole``, ``all_reduce`` in place (``wait()``: all of ``flat``)."""

    def __init__(self, flat: torch.Tensor, shard: int, group: Any, whole: bool = False) -> None:
        self.count = flat.numel() if whole else shard
        if whole:
            self._out = flat
            self._work = dist.all_reduce(flat, group=group, async_op=True)
        else:
            self._out = torch.empty(shard, dtype=flat.dtype, device=flat.device)
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            self._work = scatter(self._out, flat, group=group, async_op=True)

    def wait(self, out: torch.Tensor | None = None) -> torch.Tensor:
        self._work.wait()
        return self._out if out is None else out.copy_(self._out)


@dataclass
class _Reduction:
    """A gradient reduction in flight: a block's flat gradient (``unit``) or a replicated parameter's (``param``)."""

    sum: ScatterSum | _BackendSum
    flat: torch.Tensor
    unit: Unit | None = None
    param: torch.Tensor | None = None


@dataclass
class Unit:
    """One block: its flat layout, its shard in the store (a one-slot ``BlockLayout``), what is gathered now."""

    index: int
    name: str
    module: nn.Module
    flat: FlatShards
    shard: BlockLayout  # the residency's view: region ``fsdp/block<i>``, one slot whose "parameter" is the shard
    params: list[torch.Tensor]  # every parameter of the block, in slot order (frozen ones too: gathered, never reduced)
    trainable: list[torch.Tensor]  # those with requires_grad: their gradients are reduce-scattered and updated
    owned_params: list[torch.Tensor]  # trainable parameters with elements in this rank's shard
    full: torch.Tensor | None = None  # the gathered flat tensor while bound (elements ``window`` of it, if set)
    window: tuple[int, int] | None = None  # ``[a, b)``: only this part is kept, waiting for a reduction and update
    ahead: tuple[torch.Tensor, Any] | None = None  # a gather started one block early (forward): (output, work)
    grad: torch.Tensor | None = None  # the flat gradient while the update is pending (owned slice reduced)
    refs: Counter = field(default_factory=Counter)
    arrived: set[int] = field(default_factory=set)  # id(param): gradients accumulated this backward
    pending: set[int] = field(default_factory=set)  # id(param): owned, not yet updated this step


@dataclass
class _Call:
    unit: Unit
    pre: bool = False
    post: bool = False


class GradReductions:
    """The gradient reductions in flight, waited for in the order they were started (the same on every rank), at
    most ``inflight`` at once: ``block`` (a block's packed, pre-scaled flat gradient; ``on_block(unit, flat, mine)``
    gets this rank's summed shard) and ``param`` (a replicated parameter's gradient, as autograd's hook hands it;
    ``on_param(p)`` once this rank's elements of it are summed). ``order``: ``REDUCE_ORDERS``."""

    def __init__(self, rank: int, world: int, group: Any, comm: Comm, spare: SpareBuffers, order: str, inflight: int,
                 replicated: list[FlatShards],
                 on_block: Callable[[Unit, torch.Tensor, ScatterSum | _BackendSum], None],
                 on_param: Callable[[torch.Tensor], None]) -> None:
        if order not in REDUCE_ORDERS:
            raise ValueError(f"reduce_order={order!r}: one of {REDUCE_ORDERS}")
        self.rank, self.world, self.group, self.order, self.inflight = rank, world, group, order, max(0, inflight)
        self.comm, self.spare = comm, spare
        self.on_block, self.on_param, self.replicated = on_block, on_param, replicated
        self.queue: list[_Reduction] = []
        # a replicated parameter's elements owned by each rank: consecutive, in rank order (the ScatterSum pieces)
        self._counts: dict[int, list[int]] = {}
        self._mine: dict[int, tuple[int, int]] = {}
        for flat in replicated:
            for r in range(world):
                for piece, lo, hi in flat.owned(r):
                    self._counts.setdefault(id(piece.param), [0] * world)[r] = hi - lo
                    if r == rank:
                        self._mine[id(piece.param)] = (lo, hi)

    def regather(self, device: torch.device) -> None:
        """After the step: each replicated parameter's elements gathered from the ranks that updated them (a
        collective, in the same order on every rank), so the replicas are equal again."""
        for flat in self.replicated:
            lo, hi = flat.bounds(self.rank)
            with torch.no_grad():
                full = flat.pack([p.detach() for p in (s.param for s in flat.slots)],
                                 torch.empty(flat.total, dtype=flat.dtype, device=device))
                out = torch.empty_like(full)
                self.comm.all_gather(out, full[lo:hi].clone()).wait()
                for s in flat.slots:
                    s.param.copy_(flat.view(out, s))

    def block(self, u: Unit, flat: torch.Tensor) -> None:
        if self.order == "rank":  # the trainable tail only: a frozen head (a LoRA base) has nothing to sum
            first = u.flat.trainable_start
            total: ScatterSum | _BackendSum = ScatterSum(flat[first:], u.flat.trainable_counts(), self.rank,
                                                         self.comm, self.spare)
        else:
            total = _BackendSum(flat, u.flat.shard, self.group)
        self._started(_Reduction(total, flat, unit=u))

    def param(self, p: torch.Tensor) -> None:
        """A replicated parameter's gradient is final: average it across ranks (1/N, then the sum); in rank order
        only this rank's elements are summed (the others are never read: this rank updates its own)."""
        assert p.grad is not None
        p.grad.mul_(1.0 / self.world)
        flat = p.grad.view(-1)
        if self.order == "rank":
            total: ScatterSum | _BackendSum = ScatterSum(flat, self._counts[id(p)], self.rank, self.comm)
        else:
            total = _BackendSum(flat, 0, self.group, whole=True)
        self._started(_Reduction(total, flat, param=p))

    def _started(self, r: _Reduction) -> None:
        self.queue.append(r)
        while len(self.queue) > self.inflight:
            self._finish(self.queue.pop(0))

    def finish_all(self) -> None:
        while self.queue:
            self._finish(self.queue.pop(0))

    def _finish(self, r: _Reduction) -> None:
        if r.param is not None:
            if self.order == "rank":  # this rank's elements summed in place
                lo, hi = self._mine.get(id(r.param), (0, 0))
                r.sum.wait(out=r.flat[lo:hi])
            else:
                r.sum.wait()
            self.on_param(r.param)
        else:
            assert r.unit is not None
            self.on_block(r.unit, r.flat, r.sum)


class ShardIO:
    """A rank's block shards in its store, and the gathers that make whole blocks of them (the collectives that read
    a shard). Its ``residency`` exists from ``ShardedParams.start`` on."""

    def __init__(self, rank: int, comm: Comm, device: torch.device, in_flight: int) -> None:
        self.rank, self.comm, self.device = rank, comm, device
        # block-sized work buffers (gathered blocks, flat gradients, receive buffers), ``in_flight`` blocks' worth:
        # the blocks gathered (this one, the next, one per reduction pending), a gradient and a receive buffer each
        self.spare = SpareBuffers(per_size=2 * in_flight)
        self.residency: BlockResidency | None = None

    def attach(self, store: Any, shards: list[BlockLayout], prefetch: int) -> BlockResidency:
        """The residency of ``shards`` in ``store``; their host buffers from a pool, as ``offload_params``' blocks
        (``HostTransfer``): a fresh mapping per read and write-back was faulted page by page, three times per block
        and step, on the rank's core."""
        writes = prefetch + 1
        largest = max((store.region(s.region).capacity for s in shards), default=0)
        self.residency = BlockResidency(store, shards, writes,
                                        transfer=HostTransfer(largest, pool_size=prefetch + 2 + writes))
        return self.residency

    def gathered(self, u: Unit) -> torch.Tensor:
        """The whole block as one flat tensor: this rank's shard from the store, all-gathered (a collective)."""
        assert self.residency is not None
        self.residency.acquire(u.shard, GATHER)
        try:
            local = u.shard.slots[0].param.data
            full = self.spare.take(u.flat.total, u.flat.dtype, self.device)
            self.comm.all_gather(full, local.to(self.device)).wait()
        finally:
            self.residency.release(u.shard, GATHER)
        return full

    def gather_ahead(self, u: Unit) -> None:
        """Start ``u``'s all-gather now (asynchronously), so it runs while the block before it computes. Its shard
        stays held until the gather is waited for (the collective reads it)."""
        assert self.residency is not None
        if u.full is not None or u.ahead is not None:
            return
        self.residency.acquire(u.shard, GATHER)
        full = self.spare.take(u.flat.total, u.flat.dtype, self.device)
        u.ahead = (full, self.comm.all_gather(full, u.shard.slots[0].param.data.to(self.device)))

    def take_ahead(self, u: Unit) -> torch.Tensor | None:
        if u.ahead is None:
            return None
        assert self.residency is not None
        (full, work), u.ahead = u.ahead, None
        work.wait()
        self.residency.release(u.shard, GATHER)
        return full

    def write_shard(self, u: Unit, full: torch.Tensor, updated: bool = False, base: int = 0) -> None:
        """This rank's slice of ``full`` (elements from ``base`` of the flat tensor on) becomes the block's shard in the
        store (written asynchronously). ``updated`` (after an optimizer update): only the shard's trainable tail is
        written, its frozen head stays as stored."""
        assert self.residency is not None
        lo, hi = (x - base for x in u.flat.bounds(self.rank))
        if self.residency.is_resident(u.shard):
            self.residency.evict(u.shard)  # read ahead for a pass to come, never used: dropped (it is unchanged)
        u.shard.slots[0].param.data = full[lo:hi]
        self.residency.place(u.shard, tail=updated)  # copies into an aligned buffer, writes it, leaves a placeholder

    def prefetch(self, units: Iterable[Unit]) -> None:
        assert self.residency is not None
        for u in units:
            if u.full is None:
                self.residency.prefetch(u.shard)


class ShardedParams:
    """The blocks of ``model`` sharded over ``world`` ranks of ``group`` (arguments: the module docstring)."""

    def __init__(self, model: nn.Module, block_classes: BlockClasses, rank: int, world: int, group: Any,
                 prefetch: int = 1, device: torch.device | None = None,
                 reduced: Callable[[Sequence[torch.Tensor]], None] | None = None, reduce_order: str = "rank",
                 inflight: int = 1, state_align: int = 1, comm: Comm | None = None) -> None:
        self.model = model
        self.rank, self.world, self.group = rank, world, group
        self.prefetch = prefetch
        self.device = device or torch.device("cpu")
        self.io = ShardIO(rank, comm if comm is not None else BackendComm(group), self.device, prefetch + inflight + 1)
        self.reduced = reduced or (lambda params: None)
        classes = block_classes if block_classes is not None else model_block_classes(model)
        blocks = find_blocks(model, classes)
        if not blocks:
            raise ValueError(f"nvme_offload_fsdp: no blocks found in {type(model).__name__} (no nn.ModuleList or "
                             f"nn.Sequential with parameters, or no module of param_block_classes={classes}). Name the "
                             "block module classes with param_block_classes=[...], e.g. your transformer layer class.")
        layout = plan_layout(model, blocks, region_prefix="fsdp")
        self.units: list[Unit] = []
        for block in layout.blocks:
            flat = FlatShards([(s.name, s.param) for s in block.slots], world, state_align)
            holder = nn.Parameter(torch.empty(0, dtype=flat.dtype), requires_grad=False)
            slot = ParamSlot("shard", holder, torch.Size([flat.shard]), flat.dtype, 0, flat.shard_bytes)
            shard = BlockLayout(block.index, f"{block.name} (shard {rank}/{world})", block.module, block.region,
                                [slot], flat.shard_bytes, flat.writable_offset(rank))
            owned = list({id(s.param): s.param for s, _, _ in flat.owned(rank) if s.param.requires_grad}.values())
            self.units.append(Unit(block.index, block.name, block.module, flat, shard, [s.param for s in block.slots],
                                   [s.param for s in block.slots if s.param.requires_grad], owned))
        self.outside = [(n, p) for n, p in layout.outside_blocks if p.requires_grad]
        self._outside_all = [p for _, p in layout.outside_blocks]
        by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for n, p in self.outside:
            by_dtype.setdefault(p.dtype, []).append((n, p))
        # owned 1/N, gathered after a step
        self.replicated = [FlatShards(named, world, state_align) for named in by_dtype.values()]
        self.reductions = GradReductions(rank, world, group, self.io.comm, self.io.spare, reduce_order, inflight, self.replicated,
                                         on_block=self._reduced_block, on_param=lambda p: self.reduced([p]))
        self._unit_of = {id(p): u for u in self.units for p in u.trainable}
        self._handles: list[Any] = []
        self.weights = ShardedWeights(self)  # the blocks' weights for checkpoints and exports
        self._stack: dict[int, list[_Call]] = {u.index: [] for u in self.units}
        self._open: list[_Call] = []
        self._recomputed: list[Unit] = []
        self._callback_queued_for = -1

    # ---- geometry --------------------------------------------------------------------------------------
    def regions(self) -> list[tuple[str, int]]:
        return [(u.shard.region, u.shard.nbytes) for u in self.units]

    @property
    def sharded_bytes(self) -> int:
        """Bytes of block parameters (the whole model's, not this rank's shard)."""
        return sum(s.numel * torch.empty((), dtype=u.flat.dtype).element_size() for u in self.units for s in u.flat.slots)

    @property
    def residency(self) -> BlockResidency | None:
        return self.io.residency

    @property
    def active(self) -> bool:
        return self.residency is not None

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self, store: Any, optimized: Iterable[torch.Tensor], initial: InitialWeights | None = None) -> None:
        """Write this rank's shard of every block to the store, leave placeholders in the module, install hooks.
        ``optimized``: the parameters offloaded optimizers update (a block waits for their update only);
        ``initial``: where a model on the meta device takes its values (a resumed checkpoint's weights; default:
        its own ``initial_weights()``, else its initialization)."""
        for h in self._handles:  # a previous fit's refusals (``_released_hook``)
            h.remove()
        self._handles = []
        ids = {id(p) for p in optimized}
        for u in self.units:
            u.owned_params = [p for p in u.owned_params if id(p) in ids]
        store.add_regions(self.regions())
        residency = self.io.attach(store, [u.shard for u in self.units], self.prefetch)
        if has_meta_tensors(self.model):
            _build_from_meta(self, initial)
        else:
            for u in self.units:
                _write_initial(self, u, broadcast=False)  # every rank holds rank 0's values (the strategy's sync)
        residency.drain()
        for u in self.units:
            self._handles.append(u.module.register_forward_pre_hook(self._pre_forward(u), with_kwargs=True))
            self._handles.append(u.module.register_forward_hook(self._post_forward(u)))
            self._handles.append(u.module._register_state_dict_hook(_gather_hook(self, u)))
            for p in u.trainable:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(u)))
        for _, p in self.outside:
            self._handles.append(p.register_post_accumulate_grad_hook(self.reductions.param))

    def stop(self, restore: bool = True) -> None:
        """End of fit: with ``restore`` every block is gathered back into its module (a collective: every rank
        calls it), the hooks go, the residency drains."""
        if self.residency is None:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        self.reductions.queue = []  # after a failure mid-backward: never waited for (another rank may be gone)
        for u in self.units:
            u.refs.clear()
            u.pending.clear()
            u.grad = None
            if restore:
                full = self.io.take_ahead(u)
                full = full if full is not None else self.io.gathered(u)
                for s in u.flat.slots:
                    s.param.data = u.flat.view(full, s)
            else:
                self._unbind(u)  # a gather started ahead is not waited for: another rank may be gone
                self._handles.append(u.module._register_state_dict_hook(_released_hook(u)))
            u.full, u.ahead, u.window = None, None, None
        self.residency.release_all()
        self.residency.drain()
        self.io.residency = None
        self.io.spare.close()  # the pooled work buffers serve the steps only: not held after fit

    # ---- gather, bind, release ---------------------------------------------------------------------------
    def _hold(self, u: Unit, why: str) -> None:
        if u.window is not None and why not in (REDUCE, UPDATE):
            raise RuntimeError(f"block {u.name}: held for {why!r} while only its owned part is kept (a bug)")
        if u.full is None:
            u.full = self.io.take_ahead(u)
            if u.full is None:
                u.full = self.io.gathered(u)
            for s in u.flat.slots:
                s.param.data = u.flat.view(u.full, s)
        u.refs[why] += 1

    def _let_go(self, u: Unit, why: str) -> None:
        if u.refs[why] <= 0:
            raise RuntimeError(f"block {u.name}: release({why!r}) without a matching hold (a bug)")
        u.refs[why] -= 1
        if not +u.refs:
            self._unbind(u)
        elif set(+u.refs) <= {REDUCE, UPDATE}:
            _keep_owned(u, self.rank, self.io.spare)

    def _unbind(self, u: Unit) -> None:
        for s in u.flat.slots:
            s.param.data = placeholder(s.shape, u.flat.dtype, self.device)
        self.io.spare.give(u.full)
        u.full, u.window = None, None

    # ---- forward ---------------------------------------------------------------------------------------------
    def _pre_forward(self, u: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if in_backward():  # recomputation under activation checkpointing: held for its backward already
                if u.full is None or not +u.refs:
                    self._hold(u, RECOMPUTE)
                    self._recomputed.append(u)
                return None
            self._hold(u, FWD)
            # reads run one block further ahead than the gathers: the next block's read had this block's
            # predecessor's compute to complete, its gather gets this block's compute
            self.io.prefetch(self.units[u.index + 2:u.index + 2 + self.prefetch])
            if u.index + 1 < len(self.units):
                self.io.gather_ahead(self.units[u.index + 1])
            call = _Call(u)
            self._stack[u.index].append(call)
            if not torch.is_grad_enabled():
                return None
            flat, spec = tree_flatten((args, kwargs))
            needs = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
            if not needs:
                return None
            wrapped = _PostBackward.apply(lambda: self._post_backward(call), *(flat[i] for i in needs))
            for i, t in zip(needs, wrapped):
                flat[i] = t
            return tree_unflatten(flat, spec)
        return hook

    def _post_forward(self, u: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if in_backward():
                return
            call = self._stack[u.index].pop()
            outputs = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
            if outputs and torch.is_grad_enabled():
                self._open.append(call)
                register_multi_grad_hook(outputs, lambda _grad: self._pre_backward(call), mode="any")
            self._let_go(u, FWD)
            if outputs and torch.is_grad_enabled() and u.index == len(self.units) - 1:
                self.io.gather_ahead(u)  # the first block of backward: gathered while the head and the loss compute
        return hook

    # ---- backward --------------------------------------------------------------------------------------------
    def _pre_backward(self, call: _Call) -> None:
        if call.pre:
            return
        call.pre = True
        u = call.unit
        self._hold(u, BWD)
        # as in forward: reads run one block further ahead than the gathers; the previous block's gather is started
        # now and runs while this block's backward computes
        self.io.prefetch(reversed(self.units[max(0, u.index - 1 - self.prefetch):u.index]))
        if u.index > 0:
            self.io.gather_ahead(self.units[u.index - 1])
        task = torch._C._current_graph_task_id()
        if task != self._callback_queued_for:
            self._callback_queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _post_backward(self, call: _Call) -> None:
        if call.pre and not call.post:
            call.post = True
            self._let_go(call.unit, BWD)

    def _grad_hook(self, u: Unit) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            u.arrived.add(id(p))
            if len(u.arrived) == len(u.trainable):
                self._reduce(u)
        return hook

    def _reduce(self, u: Unit) -> None:
        """The block's gradients are all accumulated: start averaging them across ranks (this rank keeps its shard
        of the average); the block stays gathered until the reduction is waited for and its update done."""
        u.arrived.clear()
        grads = [p.grad if p.requires_grad else None for p in u.params]  # a frozen parameter's: zeros
        assert all(p.grad is not None for p in u.trainable)  # every one arrived (``_grad_hook``)
        # averaged as DDP's reducer does: multiplied by 1/N (as it is packed), then summed
        flat = u.flat.pack(grads, self.io.spare.take(u.flat.total, u.flat.dtype, self.device), scale=1.0 / self.world)
        for p in u.trainable:
            p.grad = None  # packed: freed now, the owned views are set when the reduction is waited for
        self._hold(u, REDUCE)
        self.reductions.block(u, flat)

    def _reduced_block(self, u: Unit, flat: torch.Tensor, total: ScatterSum | _BackendSum) -> None:
        """A block's reduction is waited for: its owned gradient is final, the optimizer may update it."""
        owned = {id(p) for p in u.owned_params}
        grad = _owned_grad(u, self.rank, owned, flat, total, self.io.spare)  # the other parameters' .grad None
        if owned:
            u.grad = grad
            u.pending = set(owned)
            self._hold(u, UPDATE)  # the update writes into the gathered block; its owned slice is then written back
        self._let_go(u, REDUCE)
        if owned:
            self.reduced(u.owned_params)

    def _end_backward(self) -> None:
        self.reductions.finish_all()
        for call in self._open:
            self._post_backward(call)
        self._open = [c for c in self._open if not c.pre]
        for u in self._recomputed:
            self._let_go(u, RECOMPUTE)
        self._recomputed = []
        self._callback_queued_for = -1
        for u in self.units:
            if u.arrived:
                missing = [s.name for s in u.flat.slots if s.param.requires_grad and id(s.param) not in u.arrived]
                u.arrived.clear()
                raise RuntimeError(f"nvme_offload_fsdp: parameters {missing} of block {u.name} received no gradient "
                                   "in this backward while others of the block did; every trainable parameter of a "
                                   "sharded block must take part in the loss (or be frozen).")

    # ---- updates (``UpdateListener`` of the offloaded optimizer) -----------------------------------------------
    def before_update(self, touched: Sequence[torch.Tensor]) -> None:
        """Nothing to load: a block's owned parameters stay gathered from its reduce-scatter to its update."""

    def after_update(self, touched: Sequence[torch.Tensor], finished: Sequence[torch.Tensor]) -> None:
        done: dict[int, Unit] = {}
        for p in finished:
            u = self._unit_of.get(id(p))
            if u is not None and id(p) in u.pending:
                u.pending.discard(id(p))
                done[u.index] = u
        for u in done.values():
            if not u.pending:
                self._updated(u)

    def _updated(self, u: Unit) -> None:
        assert u.full is not None
        self.io.write_shard(u, u.full, updated=True, base=u.window[0] if u.window else 0)
        self.io.spare.give(u.grad)
        u.grad = None
        self._let_go(u, UPDATE)

    def finish_step(self) -> None:
        """After the optimizer step: every block updated and written back, nothing gathered; then the replicated
        parameters gathered from their owners (a collective, in the same order on every rank)."""
        if self.reductions.queue:
            raise RuntimeError(f"nvme_offload_fsdp: {len(self.reductions.queue)} gradient reductions were not waited for "
                               "by the end of backward (a bug)")
        for u in self.units:
            if u.pending:
                raise RuntimeError(f"nvme_offload_fsdp: block {u.name} was not updated in this step (a bug)")
        for call in self._open:
            self._post_backward(call)
        self._open = []
        for u in self.units:
            self.io.spare.give(self.io.take_ahead(u))  # a gather for a block never reached: waited for, buffer pooled
        if self.residency is not None:
            self.residency.evict_unheld()
            self.residency.poll_writes()
        self.reductions.regather(self.device)


def _owned_grad(u: Unit, rank: int, owned: set[int], flat: torch.Tensor, total: ScatterSum | _BackendSum,
                spare: SpareBuffers) -> torch.Tensor:
    """The gradient an update of ``u``'s owned parameters reads (each owned parameter's ``.grad`` a view into it): the
    window of ``flat`` that ``FlatShards.window`` names, this rank's summed elements (``total``'s ``count``, its
    shard's trainable tail) in place of its own terms, summed straight into it; the elements outside the shard are
    never read. Not the whole block's gradient: N times as much, alive until the update. ``flat`` goes back to
    ``spare`` when the update does not read it (no owned parameters: discard the result; or a window of its own)."""
    if not owned:
        total.wait()
        for s in u.flat.slots:
            s.param.grad = None
        spare.give(flat)
        return flat
    _, hi = u.flat.bounds(rank)
    a, b = u.flat.window(rank, owned)
    off = hi - total.count
    if (a, b) != (0, u.flat.total):
        grad = spare.take(b - a, flat.dtype, flat.device)
        grad[:off - a].copy_(flat[a:off])
        grad[hi - a:].copy_(flat[hi:b])
        total.wait(out=grad[off - a:hi - a])
        spare.give(flat)
        flat = grad
    else:
        total.wait(out=flat[off - a:hi - a])
    for s in u.flat.slots:
        s.param.grad = u.flat.view(flat, s, a) if id(s.param) in owned else None
    return flat


def _keep_owned(u: Unit, rank: int, spare: SpareBuffers) -> None:
    """``u`` waits only for its gradient's reduction and its update: keep the window of its gathered weights that the
    update writes (``FlatShards.window``: this rank's shard, owned parameters whole), free the rest, and make the
    other parameters placeholders. Why: from a block's backward to its update the whole gathered block stayed
    alive, N times what the update touches, beside its gradient: block-sized buffers at the peak of RSS (#37)."""
    if u.full is None or u.window is not None:
        return
    owned = {id(p) for p in u.owned_params}
    a, b = u.flat.window(rank, owned)
    if (a, b) == (0, u.flat.total):
        return
    kept = spare.take(b - a, u.full.dtype, u.full.device).copy_(u.full[a:b])
    for s in u.flat.slots:
        s.param.data = u.flat.view(kept, s, a) if id(s.param) in owned else placeholder(s.shape, u.flat.dtype, kept.device)
    spare.give(u.full)
    u.full, u.window = kept, (a, b)


def owned_ranges(engine: ShardedParams, params: Sequence[torch.Tensor], rank: int) -> dict[int, list[tuple[int, int]]]:
    """Param index (in ``params``, an optimizer's flat order) -> the element ranges ``rank`` owns: its shard of
    every block and its 1/N of every replicated parameter."""
    index = {id(p): i for i, p in enumerate(params)}
    out: dict[int, list[tuple[int, int]]] = {}
    for flat in [u.flat for u in engine.units] + engine.replicated:
        for slot, lo, hi in flat.owned(rank):
            i = index.get(id(slot.param))
            if i is not None and slot.param.requires_grad:
                out.setdefault(i, []).append((lo, hi))
    return out


def _write_initial(self: ShardedParams, u: Unit, broadcast: bool) -> None:
    """The block's values (in its module) become this rank's shard in the store; placeholders are left behind.
    ``broadcast``: rank 0's values are taken (as DDP's start), e.g. after each rank initialized its own."""
    with torch.no_grad():
        full = u.flat.pack([p.detach() for p in u.params],
                           torch.empty(u.flat.total, dtype=u.flat.dtype, device=self.device))
        if broadcast and self.world > 1:
            dist.broadcast(full, src=dist.get_global_rank(self.group, 0), group=self.group)
    self.io.write_shard(u, full)
    self._unbind(u)


def _write_by_range(self: ShardedParams, u: Unit, source: RangedWeights) -> None:
    """This rank's shard of ``u`` filled straight from ``source``, each piece of a parameter it owns read by its
    element range (``FlatShards.owned``; gaps zero, as ``pack`` leaves them): each rank reads 1/N of the block's
    bytes, not all of them, and no broadcast follows (every rank reads the same file, so its shard holds what rank
    0's broadcast would give it). The values are converted as on the whole path (``copy_range_checked``)."""
    lo, hi = u.flat.bounds(self.rank)
    shard = torch.zeros(hi - lo, dtype=u.flat.dtype, device=self.device)
    for slot, start, stop in u.flat.owned(self.rank):
        at = slot.offset + start - lo
        copy_range_checked(source, slot.name, slot.shape, slot.param.dtype, start, stop, shard[at:at + stop - start])
    self.io.write_shard(u, shard, base=lo)
    self._unbind(u)


def _by_range(u: Unit, source: RangedWeights | None) -> bool:
    """Whether ``u`` is built from element ranges of ``source`` (``_write_by_range``): every tensor of its modules
    still on the meta device is in ``source``. A parameter not in it (an adapter added for finetuning) needs its
    module's ``reset_parameters()`` or ``init_module``, which would also write the parameters read by range: such a
    block is built whole (``materialize``), as is one whose parameters are no longer on the meta device."""
    if source is None or not all(p.is_meta for p in u.params):
        return False
    tensors = [*u.module.named_parameters(remove_duplicate=False), *u.module.named_buffers(remove_duplicate=False)]
    return all(f"{u.name}.{n}" in source for n, t in tensors if t.is_meta)


def _build_from_meta(self: ShardedParams, initial: InitialWeights | None = None) -> None:
    """A model built on the meta device is initialized module by module (``params.materialize``), each block
    sharded into the store as soon as its last module is initialized: at most about one block is ever whole in
    memory. Every rank then holds rank 0's values (blocks, parameters outside blocks and buffers broadcast), as
    an in-memory model gets from the strategy's start.

    A source that reads element ranges (``RangedWeights``) serves each block it covers whole by range instead: its
    parameters get placeholders, never values (``materialize(skip=...)``), and each rank reads only its shard
    (``_write_by_range``); parameters outside blocks, which every rank holds whole, are still read whole."""
    source = initial if initial is not None else initial_weights(self.model)
    by_range = ranged(source)
    ranges = {u.index for u in self.units if _by_range(u, by_range)}
    written: set[int] = set()

    def shard_complete_blocks() -> None:
        for u in self.units:
            if u.index not in written and not any(p.is_meta for p in u.params):
                written.add(u.index)
                if u.index in ranges:
                    assert by_range is not None
                    _write_by_range(self, u, by_range)
                else:
                    _write_initial(self, u, broadcast=True)

    skip = {id(p) for u in self.units if u.index in ranges for p in u.params}
    try:
        materialize(self.model, self.device, shard_complete_blocks, skip=skip, source=source)
    finally:
        if by_range is not None:
            by_range.close()
    if self.world > 1:
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in [*self._outside_all, *self.model.buffers()]:
                dist.broadcast(t.data, src=src, group=self.group)


def _released_hook(u: Unit) -> Any:
    """``state_dict()`` of a block whose weights were not gathered back at the end of fit: refused (its parameters
    are placeholders), never NaNs handed on as weights."""
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
        raise RuntimeError(f"nvme_offload_fsdp: block {u.name}'s weights were not gathered back into the module at the "
                           "end of fit (restore_params=False, or the fit failed); its parameters are placeholders. "
                           "Fix: restore_params=True, or save a checkpoint during fit (ModelCheckpoint) and load it.")
    return hook


def _gather_hook(engine: ShardedParams, u: Unit) -> Any:
    """``state_dict()`` of a sharded block: its weights gathered from every rank (a collective: every rank calls it),
    or under ``ShardedWeights.by_reference`` a ``BesideWeight`` per parameter, gathered later by the save
    (``read_block``)."""
    names = {id(s.param): s for s in u.flat.slots}
    local = [(n, names[id(p)]) for n, p in u.module.named_parameters(remove_duplicate=False) if id(p) in names]

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
        if engine.residency is None:
            return
        if engine.weights.referencing:
            for name, slot in local:
                if prefix + name in state_dict:
                    like = torch.empty((), dtype=u.flat.dtype).expand(slot.shape)  # dtype and shape, no memory
                    state_dict[prefix + name] = BesideWeight.of(prefix + name, like, (u, slot.name))
            return
        values = engine.weights.read_block(u)
        for name, slot in local:
            if prefix + name in state_dict:
                state_dict[prefix + name] = values[slot.name].clone()
    return hook
