"""``ForwardStream``: evaluation (validate, test, predict, generation) of a model whose blocks are not in memory,
each block's weights read from a read-only source just before its forward and dropped right after.

Why not the training path (``BlockResidency`` + ``BlockScheduler``): evaluation writes nothing, keeps no optimizer
state and has no backward, and its weights may come from places that are not the store: a Hugging Face safetensors
directory read where it lies (no copy into a store when no training follows), the safetensors file a streamed
checkpoint keeps beside itself, or the store a fit left behind (``restore_params=False``). Each is a
``BlockSource``: ``read(block)`` returns the block's tensors by parameter name, read in a worker thread ahead of need
(``prefetch`` blocks, in forward order).

Memory: the bound block plus ``prefetch`` blocks read ahead (``prefetch + 1`` blocks; the read in flight is one of
them), whatever the model's size. Bitwise: the values bound are the stored values converted to the parameter's dtype
(what ``copy_`` into an in-memory model gives), and the forward is the module's own.

The read-only sources (``TensorSource``: ``name in source`` and ``source.get(name)``, the protocol of
``lightning_nvme.params.materialize.InitialWeights``) are reusable wherever frozen weights are served without a
store: ``HubWeights`` and ``PretrainedWeights`` (a safetensors directory, each tensor preadv'd at its header offset),
``BesideSource`` (a checkpoint's beside file), ``MappingSource`` (tensors already in memory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lightning_nvme.checkpoint.weights import BesideWeight, WeightReaders
from lightning_nvme.optim.plan import is_placeholder, placeholder
from lightning_nvme.params.layout import BlockLayout, ParamLayout
from lightning_nvme.params.materialize import InitialWeights
from lightning_nvme.store import aligned_empty

# set on a module whose block placeholders stand for its initial_weights() (a later evaluation may read them again);
# placeholders standing for other values (a checkpoint's, a fit's store) must not be served from there
FROM_INITIAL = "_lightning_nvme_blocks_are_initial_weights"

TensorSource = InitialWeights  # read-only, tensor by tensor: ``name in source``, ``source.get(name)``

NOT_FORWARD_ONLY = (
    "{block}: streamed evaluation (offload_params=True outside fit) runs forward only, but autograd is recording "
    "(torch.is_grad_enabled()): a backward would need the block's weights again, which are gone after its forward. "
    "Evaluate under torch.no_grad() (Lightning's validate/test/predict do), or train with trainer.fit.")


def check_streamable(model: nn.Module, layout: ParamLayout) -> None:
    """Refuse, by name and before anything is read, a model whose blocks cannot be served one forward at a time:
    a block holding buffers not yet computed (on the meta device: only a block's parameters are streamed), or a
    block nested in another (its parameters would be bound twice)."""
    for block in layout.blocks:
        meta = [f"{block.name}.{n}" for n, b in block.module.named_buffers() if b.is_meta]
        if meta:
            raise ValueError(f"{meta[:4]}: buffers of block {block.name} are on the meta device; streamed evaluation "
                             "reads only a block's parameters per forward. Compute them at build time (as "
                             "lightning_nvme.models.hf.recompute_buffers does), or evaluate with offload_params=False.")
    names = [b.name for b in layout.blocks]
    nested = [(a, b) for a in names for b in names if b.startswith(a + ".")]
    if nested:
        raise ValueError(f"blocks {nested[0][1]} inside {nested[0][0]}: streamed evaluation binds each block for its "
                         "own forward. Name only the outer class in param_block_classes.")


class BlockSource(Protocol):
    """Where a block's weights are read from, one block at a time (called from the stream's worker thread)."""

    def read(self, block: BlockLayout) -> dict[str, torch.Tensor]: ...

    def describe(self) -> str: ...


class MappingSource:
    """Tensors already in memory (a checkpoint file holding its weights inline)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class BesideSource:
    """A streamed checkpoint's block weights, read from its beside safetensors file tensor by tensor (checked to be
    of the same save); other entries of its state dict served as they are. Also a ``RangedWeights``: a sharded resume
    reads only each rank's shard of a tensor (``read_range``)."""

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        self.state_dict = state_dict
        self.readers = WeightReaders()

    def __contains__(self, name: object) -> bool:
        return name in self.state_dict

    def get(self, name: str) -> torch.Tensor:
        value = self.state_dict[name]
        return self.readers.read(value) if isinstance(value, BesideWeight) else value

    def stored_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state_dict[name].shape)

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        value = self.state_dict[name]
        if isinstance(value, BesideWeight):
            return self.readers.read_range(value, start, stop)
        return value.reshape(-1)[start:stop]

    def close(self) -> None:
        self.readers.close()


class TensorBlocks:
    """A block's values from a ``TensorSource``, by the block's parameter names (the ``state_dict`` keys of the
    module the blocks were planned on), converted to each parameter's dtype."""

    def __init__(self, source: TensorSource, what: str) -> None:
        self.source = source
        self.what = what

    def describe(self) -> str:
        return self.what

    def missing(self, blocks: list[BlockLayout]) -> list[str]:
        return [s.name for b in blocks for s in b.slots if s.name not in self.source]

    def read(self, block: BlockLayout) -> dict[str, torch.Tensor]:
        """The block's values in one page-aligned buffer laid out as in the store (``slot.offset``): an anonymous
        mapping, returned to the OS when the block is dropped (not a heap hole a later block may not fit), each value
        copied in with ``copy_`` (dtype conversion and layout exactly as loading an in-memory model does)."""
        buf = aligned_empty(block.nbytes)
        out = {}
        with torch.no_grad():
            for slot in block.slots:
                value = self.source.get(slot.name)
                if value.numel() != slot.shape.numel():
                    raise ValueError(f"{slot.name}: {self.what} holds shape {tuple(value.shape)}, the model "
                                     f"{tuple(slot.shape)} (weights of another model?)")
                view = buf[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
                view.copy_(value.view(slot.shape) if tuple(value.shape) != tuple(slot.shape) else value)
                del value
                out[slot.name] = view
        return out


class StoreBlocks:
    """A block's values from the store a fit left them in (``restore_params=False``): ``read_block`` is
    ``ParamOffload.read_block`` (one read of the block's region into a fresh buffer; nothing written)."""

    def __init__(self, read_block: Callable[[BlockLayout], dict[str, torch.Tensor]], what: str) -> None:
        self.read_block = read_block
        self.what = what

    def describe(self) -> str:
        return self.what

    def read(self, block: BlockLayout) -> dict[str, torch.Tensor]:
        return self.read_block(block)


@dataclass
class StreamStats:
    reads: int = 0  # block reads
    bytes_read: int = 0
    reads_per_block: dict[int, int] = field(default_factory=dict)
    bound_blocks: int = 0
    peak_bound_blocks: int = 0
    peak_blocks_in_memory: int = 0  # bound + read ahead (futures holding values)
    forwards: int = 0  # block forwards served


class ForwardStream:
    """Module hooks that bind each block's weights for its forward only.

    Args:
        blocks: the layout's blocks (their parameters are placeholders outside their forward).
        source: where their weights are read from; ``None`` until set (``source = ...``), e.g. by a checkpoint load.
        prefetch: blocks read ahead in forward order.
        device: where the parameters are used (values are copied there; the CPU binds them as read).
    """

    def __init__(self, blocks: list[BlockLayout], source: BlockSource | None, prefetch: int = 1,
                 device: torch.device | None = None, unsourced: str = "") -> None:
        self.blocks = blocks
        self.source = source
        self.prefetch = prefetch
        self.device = device or torch.device("cpu")
        self.unsourced = unsourced  # why there is no source yet (the error a forward then raises)
        self.stats = StreamStats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-nvme-eval-read")
        self._ahead: dict[int, Future] = {}
        self._handles: list[Any] = []
        self._bound: set[int] = set()
        self.on_read: Callable[[BlockLayout], None] | None = None  # a test counts reads
        self._paused = False  # the hooks do nothing (a layer-major window binds the blocks itself)

    @contextmanager
    def paused(self) -> Iterator[None]:
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    def install(self) -> None:
        for block in self.blocks:
            self._handles.append(block.module.register_forward_pre_hook(self._pre(block)))
            self._handles.append(block.module.register_forward_hook(self._post(block)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for future in self._ahead.values():
            future.cancel()
        self._ahead = {}
        for block in self.blocks:
            if block.index in self._bound:
                self.unbind(block)
        self._pool.shutdown(wait=True)
        close = getattr(getattr(self.source, "source", None), "close", None)
        if callable(close):
            close()

    # ---- reads -----------------------------------------------------------------------------------------
    def _read(self, block: BlockLayout) -> dict[str, torch.Tensor]:
        assert self.source is not None
        values = self.source.read(block)
        self.stats.reads += 1
        self.stats.bytes_read += sum(v.numel() * v.element_size() for v in values.values())
        self.stats.reads_per_block[block.index] = self.stats.reads_per_block.get(block.index, 0) + 1
        if self.on_read is not None:
            self.on_read(block)
        return values

    def request(self, block: BlockLayout) -> None:
        """Start reading ``block`` (if not read or bound already)."""
        if block.index not in self._ahead and block.index not in self._bound:
            self._ahead[block.index] = self._pool.submit(self._read, block)
            self._count_memory()

    def _take(self, block: BlockLayout) -> dict[str, torch.Tensor]:
        self.request(block)
        return self._ahead.pop(block.index).result()

    def _count_memory(self) -> None:
        self.stats.peak_blocks_in_memory = max(self.stats.peak_blocks_in_memory, len(self._ahead) + len(self._bound))

    # ---- binding ---------------------------------------------------------------------------------------
    def bind(self, block: BlockLayout) -> None:
        if block.index in self._bound:
            return
        if self.source is None:
            raise RuntimeError(self.unsourced or f"{block.name}: no source for its weights (a bug)")
        values = self._take(block)
        for slot in block.slots:
            value = values[slot.name]
            slot.param.data = value if value.device == self.device else value.to(self.device)
        self._bound.add(block.index)
        self._count_memory()
        self.stats.bound_blocks = len(self._bound)
        self.stats.peak_bound_blocks = max(self.stats.peak_bound_blocks, len(self._bound))

    def unbind(self, block: BlockLayout) -> None:
        for slot in block.slots:
            slot.param.data = placeholder(slot.shape, slot.dtype, slot.param.device)
        self._bound.discard(block.index)
        self.stats.bound_blocks = len(self._bound)

    def _pre(self, block: BlockLayout) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._paused:
                return
            if torch.is_grad_enabled():
                raise RuntimeError(NOT_FORWARD_ONLY.format(block=block.name))
            self.bind(block)
            for ahead in self.blocks[block.index + 1:block.index + 1 + self.prefetch]:
                self.request(ahead)
            self.stats.forwards += 1
        return hook

    def _post(self, block: BlockLayout) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._paused:
                self.unbind(block)
        return hook


@contextmanager
def streamed_blocks(model: nn.Module, source: TensorSource | None, prefetch: int = 1,
                    device: torch.device | None = None, block_classes: Any = None) -> Iterator[ForwardStream | None]:
    """Inside, ``model``'s blocks whose parameters are not in memory (meta, or placeholders) are read from ``source``
    for each forward (``ForwardStream``); its other meta parameters are materialized first (from ``source``, or the
    model's ``initial_weights()``). Yields the stream (its ``stats`` count the reads), or ``None`` for a model in memory
    (nothing to stream). Used outside Lightning's loops: ``HFCausalLM.generate``."""
    from lightning_nvme.params.materialize import copy_checked, has_meta_tensors, initial_weights, materialize
    from lightning_nvme.params.offload import ParamOffload  # the layout's planner (its store is never started)

    if not has_meta_tensors(model) and not any(is_placeholder(p) for p in model.parameters()):
        yield None
        return
    device = device or torch.device("cpu")
    layout = ParamOffload(model, block_classes, prefetch, device).layout
    check_streamable(model, layout)
    streamed = {id(s.param) for b in layout.blocks for s in b.slots}
    materialize(model, device, skip=streamed)
    if source is not None and source is not initial_weights(model):  # a checkpoint: its values outside the blocks too
        with torch.no_grad():
            for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
                if id(t) not in streamed and name in source:
                    copy_checked(name, source.get(name), t)
    if source is None:
        raise ValueError(f"{type(model).__name__}: its block weights are not in memory and no source gives them "
                         "(initial_weights() or a checkpoint)")
    blocks = TensorBlocks(source, type(source).__name__)
    missing = blocks.missing(layout.blocks)
    if missing:
        raise ValueError(f"{type(source).__name__} does not hold {missing[:4]} (weights of another model?)")
    stream = ForwardStream(layout.blocks, blocks, prefetch, device)
    for block in layout.blocks:
        stream.unbind(block)
    stream.install()
    try:
        yield stream
    finally:
        stream.remove()
