"""The plan of an offloaded optimizer: which state each parameter has, and how parameters are cut
into pieces and grouped into chunks, each chunk one store region of bounded size.

Why probe: the strategy wraps *any* optimizer whose state is per-parameter tensors. Instead of a
table of known optimizers, the plan runs the optimizer's own step once on a two-element dummy per
param group and reads back which state keys it creates, their dtypes, and which are per-element
(shaped like the parameter) versus scalar (``step``). Only per-element state goes to the store.

Why pieces: memory must not scale with the largest parameter, so a parameter whose state exceeds
the chunk budget is cut into element ranges. Updates of AdamW/Adam/SGD/RMSprop/Adagrad are
element-wise, so running the optimizer on ranges gives the same bits as on the whole tensor.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch.optim import Optimizer

from lightning_nvme.optim.state_format import EXACT, HALF_DTYPES, MASTER_KEY, Component, StateFormat

SLOT_ALIGN = 64  # bytes; keeps every state view SIMD-aligned inside a chunk buffer


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class StateSpec:
    """Per-element state keys (name -> dtype) of one param group, and whether fp32 master weights are kept."""

    tensor_keys: tuple[tuple[str, torch.dtype], ...]
    scalar_keys: tuple[str, ...]


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
        return sum(_align(c.count(self.numel) * c.dtype.itemsize, SLOT_ALIGN) for c in self.stored())


@dataclass
class Chunk:
    """A set of pieces whose state lives in one store region and moves in one request."""

    index: int
    region: str
    pieces: list[Piece]
    nbytes: int


def probe_state_spec(optimizer: Optimizer, group: dict, master: bool) -> StateSpec:
    """Run the optimizer's own step on a dummy parameter with this group's hyperparameters and
    report the state it creates. The real params and state are restored afterwards."""
    dtype = torch.float32 if master else next((p.dtype for p in group["params"]), torch.float32)
    dummy = torch.zeros(2, dtype=dtype)
    dummy.grad = torch.zeros_like(dummy)
    saved_groups = optimizer.param_groups
    saved_state = optimizer.state
    probe_group = dict(group, params=[dummy])
    try:
        optimizer.param_groups = [probe_group]
        optimizer.state = defaultdict(dict)
        try:
            type(optimizer).step(optimizer)
            created = optimizer.state.get(dummy, {})
        except KeyError:
            # Optimizers that create their state in __init__ (Adagrad) fail a step on a fresh param:
            # build a throwaway instance with this group's hyperparameters instead.
            accepted = inspect.signature(type(optimizer).__init__).parameters
            kwargs = {k: v for k, v in group.items() if k in accepted and k != "params"}
            fresh = type(optimizer)([dummy], **kwargs)
            fresh.step()
            created = fresh.state.get(dummy, {})
    finally:
        optimizer.param_groups = saved_groups
        optimizer.state = saved_state
    tensor_keys, scalar_keys = [], []
    for key, value in created.items():
        if torch.is_tensor(value) and value.shape == dummy.shape:
            tensor_keys.append((key, value.dtype))
        else:
            scalar_keys.append(key)
    if master:
        tensor_keys.append((MASTER_KEY, torch.float32))
    return StateSpec(tuple(tensor_keys), tuple(scalar_keys))


def param_state_keys(optimizer: Optimizer, master_weights: bool = True, fmt: StateFormat = EXACT
                     ) -> tuple[list[StateSpec], list[tuple[int, torch.Tensor, tuple[tuple[str, torch.dtype], ...]]]]:
    """The probed spec of each param group, and ``(group, param, per-element state keys)`` for every
    parameter in the optimizer's flat order (keys empty for frozen or stateless params; no master key
    where ``fmt`` rounds bf16 params instead of keeping a master)."""
    specs: list[StateSpec] = []
    params: list[tuple[int, torch.Tensor, tuple[tuple[str, torch.dtype], ...]]] = []
    for g, group in enumerate(optimizer.param_groups):
        master = master_weights and any(p.dtype in HALF_DTYPES for p in group["params"])
        spec = probe_state_spec(optimizer, group, master)
        specs.append(spec)
        for p in group["params"]:
            keep_master = p.dtype in HALF_DTYPES and not fmt.rounds_master(p.dtype)
            keys = tuple(k for k in spec.tensor_keys if k[0] != MASTER_KEY or keep_master)
            params.append((g, p, keys if p.requires_grad else ()))
    return specs, params


def bytes_per_element(keys: tuple[tuple[str, torch.dtype], ...], fmt: StateFormat = EXACT) -> float:
    """Stored bytes per element of these state keys in format ``fmt`` (int8 scales: 4 / BLOCK)."""
    return sum(c.dtype.itemsize / c.per for k, d in keys for c in fmt.components(k, d))


def plan_chunks(optimizer: Optimizer, chunk_bytes: int, region_prefix: str, master_weights: bool = True,
                owned: Mapping[int, Sequence[tuple[int, int]]] | None = None,
                fmt: StateFormat = EXACT) -> tuple[list[Chunk], list[StateSpec]]:
    """Cut the optimizer's trainable parameters into pieces and pack them into chunks of at most
    ``chunk_bytes`` of state each (a chunk holds whole small params, big params are split).

    ``owned`` (param index -> element ranges) restricts the plan to those ranges: a data-parallel rank
    plans, stores and updates only its partition (see ``partition.partition_by_bytes``). ``fmt`` says how
    each key is stored; cuts fall on multiples of ``fmt.align`` elements (int8 blocks)."""
    chunks: list[Chunk] = []
    current: list[Piece] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            chunks.append(Chunk(len(chunks), f"{region_prefix}/chunk{len(chunks)}", current, used))
        current, used = [], 0

    specs, params = param_state_keys(optimizer, master_weights, fmt)
    for index, (g, p, keys) in enumerate(params):
        if not keys:
            continue
        ranges = [(0, p.numel())] if owned is None else [tuple(r) for r in owned.get(index, ())]
        components = {k: fmt.components(k, d) for k, d in keys}
        per_elem = bytes_per_element(keys, fmt)
        slack = SLOT_ALIGN * sum(len(c) for c in components.values())
        # Whole params whenever they fit; only contiguous params can be cut into ranges.
        max_elems = max(fmt.align, int((chunk_bytes - slack) // per_elem) // fmt.align * fmt.align)
        if (p.numel() > max_elems or ranges != [(0, p.numel())]) and not p.is_contiguous():
            raise ValueError(f"parameter {index} ({tuple(p.shape)}) is non-contiguous and must be cut into "
                             f"ranges (its state exceeds chunk_bytes={chunk_bytes}, or it is split between "
                             f"ranks); raise chunk_bytes or make it contiguous")
        for lo, hi in ranges:
            start = lo
            while start < hi or (lo == hi and start == lo):
                stop = min(hi, start + max_elems)
                if start % fmt.align:
                    raise ValueError(f"parameter {index}: owned range starts at element {start}, not a multiple "
                                     f"of {fmt.align} ({fmt.describe()} stores blocks of {fmt.align})")
                piece = Piece(g, index, p, start, stop, keys, components=components,
                              rounds_master=fmt.rounds_master(p.dtype))
                size = piece.state_bytes()
                if used and used + size > chunk_bytes:
                    close()
                offset = used
                for c in piece.stored():
                    piece.slots[c.name] = offset
                    offset += _align(c.count(piece.numel) * c.dtype.itemsize, SLOT_ALIGN)
                current.append(piece)
                used = offset
                start = stop
                if lo == hi:
                    break
    close()
    return chunks, specs
