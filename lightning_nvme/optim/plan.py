"""The plan of an offloaded optimizer: which state each parameter has, and how parameters are cut
into pieces and grouped into chunks, each chunk one store region of bounded size.

What state a parameter has comes from probing the optimizer's own step (see ``probe``). Only
per-element state goes to the store; parameters without any (plain SGD) are "unchunked": updated whole
with their (scalar or factored) state in memory, so they still step.

Why pieces: memory must not scale with the largest parameter, so a parameter whose state exceeds
the chunk budget is cut into element ranges. Updates of AdamW/Adam/SGD/RMSprop/Adagrad are
element-wise, so running the optimizer on ranges gives the same bits as on the whole tensor; a
parameter whose update is not element-wise (the probe's split test) is never cut.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.optim import Optimizer

from lightning_nvme.constants import ALIGN, SLOT_ALIGN, align_up
from lightning_nvme.optim.formats.state_format import EXACT, HALF_DTYPES, MASTER_KEY, Component, StateFormat
from lightning_nvme.optim.probe import StateSpec, UnsupportedOptimizerError, check_supported, probe_state_spec, shape_class


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a module holds for a parameter whose values live only in the store (``params`` makes them; the plan
    below recognises them, so they live here, the lower of the two layers).

    Why this shape: the ``nn.Parameter`` object must stay the same (the optimizer, autograd's saved tensors and
    the user's references all hold it), so only its ``.data`` is swapped. The placeholder keeps shape, dtype and
    device (model summaries, optimizer planning and shape checks still work) but owns one element: a NaN for
    floating dtypes, so code that reads an offloaded parameter without the strategy loading it produces NaNs
    instead of plausible numbers. ``stride 0`` marks it."""
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((1,), fill, dtype=dtype, device=device).expand(shape)


def is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and all(s == 0 for s in t.stride())


@dataclass
class Piece:
    """Elements [start, stop) of parameter ``index`` (its position in the optimizer's flat param order)."""

    group: int
    index: int
    param: torch.Tensor
    start: int
    stop: int
    keys: tuple[tuple[str, torch.dtype], ...]  # includes MASTER_KEY for half-precision params
    slots: dict[str, int] = field(default_factory=dict)  # component name -> byte offset within the chunk buffer
    # what the store holds for each key (see state_format): the key itself unless compressed
    components: dict[str, tuple[Component, ...]] = field(default_factory=dict)
    rounds_master: bool = False  # bf16 param without a stored fp32 master (master_format="bf16_sr")

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.param.numel()

    def stored(self) -> list[Component]:
        return [c for k, _ in self.keys for c in self.components.get(k, ())]

    def state_bytes(self) -> int:
        return sum(align_up(c.count(self.numel) * c.dtype.itemsize, SLOT_ALIGN) for c in self.stored())


@dataclass
class Chunk:
    """A set of pieces whose state lives in one store region and moves in one request."""

    index: int
    region: str
    pieces: list[Piece]
    nbytes: int


@dataclass
class Plan:
    """Where each trainable parameter's optimizer state lives.

    ``chunks`` hold the per-element state in the store; ``unchunked`` are whole parameters without
    per-element state (plain SGD, or only factored/scalar state), updated with their state in memory;
    ``planned`` are the param indices decided on (including those another rank owns), so a parameter
    that later becomes trainable (``add_param_group``, ``requires_grad_(True)``) is seen as new."""

    chunks: list[Chunk]
    unchunked: list[Piece]
    specs: dict[tuple[int, int], StateSpec]  # (group, shape class) -> spec
    planned: set[int]
    units: Mapping[int, int] | None = None  # id(param) -> the unit no chunk crosses (``plan_chunks``' ``units``)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@dataclass(frozen=True)
class ParamInfo:
    group: int
    index: int
    param: torch.Tensor
    keys: tuple[tuple[str, torch.dtype], ...]  # per-element state keys; empty: stateless or frozen
    splittable: bool
    trainable: bool


def describe_params(optimizer: Optimizer, master_weights: bool = True,
                    specs: dict[tuple[int, int], StateSpec] | None = None,
                    only: Collection[int] | None = None,
                    fmt: StateFormat = EXACT) -> tuple[list[ParamInfo], dict[tuple[int, int], StateSpec]]:
    """Every parameter in the optimizer's flat order (or those in ``only``) with its probed state keys
    (no master key where ``fmt`` rounds bf16 params instead of keeping a master).
    ``specs`` caches probes already made (extended in place and returned)."""
    specs = {} if specs is None else specs
    infos: list[ParamInfo] = []
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        master = master_weights and any(p.dtype in HALF_DTYPES for p in group["params"])
        for p in group["params"]:
            if only is None or index in only:
                cls = shape_class(p)
                if (g, cls) not in specs:
                    specs[(g, cls)] = probe_state_spec(optimizer, group, master, cls)
                spec = specs[(g, cls)]
                keep_master = p.dtype in HALF_DTYPES and not fmt.rounds_master(p.dtype)
                keys = tuple(k for k in spec.tensor_keys if k[0] != MASTER_KEY or keep_master)
                trainable = p.requires_grad or p.grad is not None  # torch steps any param with a gradient
                infos.append(ParamInfo(g, index, p, keys if trainable else (), spec.splittable, trainable))
            index += 1
    return infos, specs


def bytes_per_element(keys: tuple[tuple[str, torch.dtype], ...], fmt: StateFormat = EXACT) -> float:
    """Stored bytes per element of these state keys in format ``fmt`` (int8 scales: 4 / BLOCK)."""
    return sum(c.dtype.itemsize / c.per for k, d in keys for c in fmt.components(k, d))


def _refuse_split(optimizer: Optimizer, info: ParamInfo, chunk_bytes: int, why: str, fmt: StateFormat) -> None:
    p = info.param
    needed = align_up(sum(align_up(c.count(p.numel()) * c.dtype.itemsize, SLOT_ALIGN)
                        for k, d in info.keys for c in fmt.components(k, d)), ALIGN)
    raise UnsupportedOptimizerError(
        f"nvme_offload: {type(optimizer).__name__}'s update of parameter {info.index} ({tuple(p.shape)}) is not "
        f"element-wise (e.g. it uses the whole parameter's norm or factored state), so it cannot be cut into "
        f"element ranges, but {why}. Raise chunk_bytes to at least {needed} so it fits whole in one chunk, "
        f"or use strategy='auto'.")


def plan_chunks(optimizer: Optimizer, chunk_bytes: int, region_prefix: str, master_weights: bool = True,
                owned: Mapping[int, Sequence[tuple[int, int]]] | None = None, *,
                only: Collection[int] | None = None, first_chunk: int = 0,
                specs: dict[tuple[int, int], StateSpec] | None = None, fmt: StateFormat = EXACT,
                units: Mapping[int, int] | None = None) -> Plan:
    """Cut the optimizer's trainable parameters into pieces and pack them into chunks of at most
    ``chunk_bytes`` of state each (a chunk holds whole small params, big element-wise params are split).

    ``owned`` (param index -> element ranges) restricts the stored state to those ranges: a data-parallel
    rank plans, stores and updates only its partition (see ``partition.partition_by_bytes``); unchunked
    (stateless) params are updated by every rank. ``only``/``first_chunk``/``specs`` extend an existing
    plan with newly trainable params (chunk numbering continues, probes are reused; pass the plan's
    ``fmt`` again). ``fmt`` says how each key is stored; cuts fall on multiples of ``fmt.align`` elements
    (int8 blocks).

    ``units`` (``id(param)`` -> a unit, e.g. its block with parameter offload; a parameter not listed is a unit
    of its own kind, -1): a chunk never holds pieces of two units. Why: a block in the store stays in memory
    until every chunk holding its state is updated; a chunk spanning blocks held them all until the last one's
    backward, and with Hugging Face's two parameter groups (decay / no decay, each listing every block) one chunk
    of biases and norms spanned the whole model (gpu_check's first GPU run: 4 blocks on the device where at
    most 3 were documented)."""
    check_supported(optimizer)
    chunks: list[Chunk] = []
    unchunked: list[Piece] = []
    planned: set[int] = set()
    current: list[Piece] = []
    used = 0
    unit = None  # the unit of the pieces in ``current``

    def close() -> None:
        nonlocal current, used
        if current:
            n = first_chunk + len(chunks)
            chunks.append(Chunk(n, f"{region_prefix}/chunk{n}", current, used))
        current, used = [], 0

    infos, specs = describe_params(optimizer, master_weights, specs, only, fmt)
    for info in infos:
        index, p, keys = info.index, info.param, info.keys
        if not info.trainable:
            continue
        planned.add(index)
        if not keys:
            unchunked.append(Piece(info.group, index, p, 0, p.numel(), (), rounds_master=fmt.rounds_master(p.dtype)))
            continue
        ranges = [(0, p.numel())] if owned is None else [tuple(r) for r in owned.get(index, ())]
        components = {k: fmt.components(k, d) for k, d in keys}
        per_elem = bytes_per_element(keys, fmt)
        slack = SLOT_ALIGN * sum(len(c) for c in components.values())
        # Whole params whenever they fit; only contiguous params can be cut into ranges.
        max_elems = max(fmt.align, int((chunk_bytes - slack) // per_elem) // fmt.align * fmt.align)
        if not info.splittable:
            if ranges not in ([(0, p.numel())], []):
                _refuse_split(optimizer, info, chunk_bytes, "it is split between data-parallel ranks", fmt)
            if p.numel() > max_elems:
                _refuse_split(optimizer, info, chunk_bytes, f"its state exceeds chunk_bytes={chunk_bytes}", fmt)
        # A parameter offloaded to the store (a placeholder now) is a contiguous view of its block when resident.
        if (p.numel() > max_elems or ranges != [(0, p.numel())]) and not (p.is_contiguous() or is_placeholder(p)):
            raise ValueError(f"parameter {index} ({tuple(p.shape)}) is non-contiguous and must be cut into "
                             f"ranges (its state exceeds chunk_bytes={chunk_bytes}, or it is split between "
                             f"ranks); raise chunk_bytes or make it contiguous")
        if units is not None:
            if current and units.get(id(p), -1) != unit:
                close()
            unit = units.get(id(p), -1)
        for lo, hi in ranges:
            start = lo
            while start < hi or (lo == hi and start == lo):
                stop = min(hi, start + max_elems)
                if start % fmt.align:
                    raise ValueError(f"parameter {index}: owned range starts at element {start}, not a multiple "
                                     f"of {fmt.align} ({fmt.describe()} stores blocks of {fmt.align})")
                piece = Piece(info.group, index, p, start, stop, keys, components=components,
                              rounds_master=fmt.rounds_master(p.dtype))
                size = piece.state_bytes()
                if used and used + size > chunk_bytes:
                    close()
                offset = used
                for c in piece.stored():
                    piece.slots[c.name] = offset
                    offset += align_up(c.count(piece.numel) * c.dtype.itemsize, SLOT_ALIGN)
                current.append(piece)
                used = offset
                start = stop
                if lo == hi:
                    break
    close()
    return Plan(chunks, unchunked, specs, planned, units)


class ChunkPlan:
    """A ``Plan`` that follows its optimizer: the pieces of each parameter, the chunks' update order, and the
    parameters that join after setup (``add_param_group``, ``requires_grad_(True)`` by a fine-tuning callback).

    Why an object of its own: the update, the backward trigger and the state transfer all ask "which pieces
    does parameter i have" and "in which order are chunks updated"; only this object changes the answer.
    ``backward``: chunks are updated last first (backward's order). The ``chunks`` and ``unchunked`` lists are
    the plan's own, extended in place (the read-ahead holds the same list)."""

    def __init__(self, optimizer: Optimizer, plan: Plan, *, name: str, chunk_bytes: int, fmt: StateFormat,
                 backward: bool) -> None:
        self.optimizer = optimizer
        self.plan = plan
        self.name = name
        self.chunk_bytes = chunk_bytes
        self.fmt = fmt
        self.backward = backward
        self.pieces_of: defaultdict[int, list[tuple[Chunk | None, Piece]]] = defaultdict(list)  # None: unchunked
        self.order: list[int] = []  # chunk indices in update order
        self._known = [id(p) for p in self.params]  # id of each param, in the order the indices refer to
        self._signature: list[tuple[int, int]] = []  # (id, length) of each group's param list when last checked
        self._unplanned: list[tuple[int, torch.Tensor]] = []  # params not decided on (frozen at setup)
        self._index(plan)

    @property
    def chunks(self) -> list[Chunk]:
        return self.plan.chunks

    @property
    def unchunked(self) -> list[Piece]:
        return self.plan.unchunked

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _index(self, plan: Plan) -> None:
        for c in plan.chunks:
            for piece in c.pieces:
                self.pieces_of[piece.index].append((c, piece))
        for piece in plan.unchunked:
            self.pieces_of[piece.index].append((None, piece))
        self.order = list(range(len(self.chunks)))
        if self.backward:
            self.order.reverse()

    def joined(self) -> list[int]:
        """Indices of the parameters that have a gradient but no plan yet (checked cheaply when the param
        groups are unchanged); parameters removed or reordered are refused."""
        signature = [(id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups]
        if signature != self._signature:  # groups added or edited: check what changed
            params = self.params
            if len(params) < len(self._known) or any(id(p) != k for p, k in zip(params, self._known)):
                raise UnsupportedOptimizerError(
                    f"{type(self.optimizer).__name__}: parameters were removed from or reordered in its param "
                    "groups during training; the offloaded state follows parameters by position, so only appending "
                    "(optimizer.add_param_group) is supported. Rebuild the optimizer, or use strategy='auto'.")
            self._known, self._signature = [id(p) for p in params], signature
            self._unplanned = [(i, p) for i, p in enumerate(params) if i not in self.plan.planned]
        return [i for i, p in self._unplanned if p.grad is not None]

    def plan_more(self, new: list[int]) -> Plan:
        """The plan of parameters ``new`` (in this plan's format, chunks numbered after this plan's); not
        merged yet: the caller gives its chunks store regions first, then calls ``merge``."""
        return plan_chunks(self.optimizer, self.chunk_bytes, self.name, only=new, first_chunk=len(self.chunks),
                           specs=self.plan.specs, fmt=self.fmt, units=self.plan.units)

    def merge(self, extra: Plan) -> None:
        self.chunks.extend(extra.chunks)
        self.unchunked.extend(extra.unchunked)
        self.plan.planned |= extra.planned
        self._unplanned = [(i, p) for i, p in self._unplanned if i not in extra.planned]
        self._index(Plan(extra.chunks, extra.unchunked, {}, set()))

    def finished(self, chunk: Chunk, param: torch.Tensor, done: Collection[int]) -> bool:
        """Whether every piece of ``param`` (one of ``chunk``'s) is in a chunk in ``done``."""
        index = next(p.index for p in chunk.pieces if p.param is param)
        return all(other.index in done for other, _ in self.pieces_of[index] if other is not None)
