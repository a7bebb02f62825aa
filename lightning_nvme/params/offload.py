"""``ParamOffload``: a model whose blocks' parameters live in the flat store between uses.

Ties the pieces together for a strategy: the layout (which parameters, where), the residency (what is
in memory), the scheduler (module hooks), the optimizer's update listener (make a chunk's parameters
resident for its update, write them back after), and the module's ``state_dict``/``load_state_dict``
(always the true values: gathered from the store, or written into it; for a checkpoint whose weights
stream beside it, references instead of values, and values read block by block from the beside file).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from lightning_nvme.checkpoint.weights import WeightReaders
from lightning_nvme.optim.plan import Chunk
from lightning_nvme.params import transfer
from lightning_nvme.params.frozen_files import FrozenFiles
from lightning_nvme.params.in_place import InPlaceHeads, Tail, read_tail
from lightning_nvme.params.layout import BlockLayout, ParamLayout, plan_layout
from lightning_nvme.params.materialize import initial_weights, materialize
from lightning_nvme.params.policy import BlockClasses, find_blocks, model_block_classes
from lightning_nvme.params.residency import BlockResidency, ResidencyStats
from lightning_nvme.params.schedule import UPDATE, USER, BlockScheduler
from lightning_nvme.params.state_dicts import BlockStateDicts
from lightning_nvme.store import FlatStore


class ParamOffload:
    """Args:
        model: the module whose parameters leave memory (the LightningModule).
        block_classes: module classes (or dotted paths) that are blocks; ``None``: those the model names
            (``param_block_classes()``), else the children of the largest ``ModuleList``/``Sequential``.
        prefetch: blocks read ahead of need, in forward (and reverse, in backward) order.
        device: where the parameters are used (``cuda``: bound blocks are copied there, see ``transfer``).
        frozen_weights: ``"in_place"``: the frozen parameters of a model built on the meta device from a
            safetensors checkpoint are read from that file during fit, not copied into the store
            (``frozen_files``); ``"store"``: every block parameter goes to the store.
    """

    def __init__(self, model: nn.Module, block_classes: BlockClasses = None, prefetch: int = 1,
                 device: torch.device | None = None, frozen_weights: str = "store") -> None:
        self.model = model
        self.in_place_heads = InPlaceHeads(frozen_weights)  # frozen heads read from their files (in place)
        self.state_dicts = BlockStateDicts(self)  # the blocks' state_dict / load_state_dict hooks
        self.prefetch = prefetch
        self.device = device or torch.device("cpu")
        self.block_classes = block_classes
        self._layout: ParamLayout | None = None
        self._block_of: dict[int, BlockLayout] = {}
        self.residency: BlockResidency | None = None
        self.scheduler: BlockScheduler | None = None
        self._state_hooks: list[Any] = []
        self._final_stats = ResidencyStats()

    @property
    def layout(self) -> ParamLayout:
        """Planned on first use: after the precision plugin has converted the module (dtypes are final)."""
        if self._layout is None:
            if self.block_classes is None:
                self.block_classes = model_block_classes(self.model)
            blocks = find_blocks(self.model, self.block_classes)
            if not blocks:
                raise ValueError(f"offload_params=True: no blocks found in {type(self.model).__name__} (no "
                                 "nn.ModuleList or nn.Sequential with parameters, or no module of "
                                 f"param_block_classes={self.block_classes}). Name the block module classes with "
                                 "param_block_classes=[...], e.g. your transformer layer class.")
            self._layout = plan_layout(self.model, blocks)
            self._block_of = self._layout.block_of()
        return self._layout

    @property
    def blocks(self) -> list[BlockLayout]:
        return self.layout.blocks

    @property
    def stats(self) -> ResidencyStats:
        """Loads, write-backs and peak residency (kept after ``stop``)."""
        return self.residency.stats if self.residency is not None else self._final_stats

    def regions(self) -> list[tuple[str, int]]:
        """Each block's store region: the whole block, or only its trainable tail where its head is read in place."""
        heads = self.frozen.heads if self.frozen is not None else {}
        return [(b.region, b.nbytes - (heads[b.index].nbytes if b.index in heads else 0)) for b in self.blocks]

    def block_bytes(self, block: BlockLayout) -> int:
        """Bytes of the block's buffer in memory (its region's capacity, plus a head read in place)."""
        assert self.residency is not None
        return self.residency.buffers.capacity(block)

    @property
    def frozen(self) -> FrozenFiles | None:
        return self.in_place_heads.frozen

    def in_place(self, block: BlockLayout) -> bool:
        return self.in_place_heads.serves(block)

    # ---- lifecycle -----------------------------------------------------------------------------------
    def attach_store(self, store: FlatStore) -> BlockResidency:
        """Add the blocks' regions to ``store`` (once)."""
        if self.residency is None:
            store.add_regions(self.regions())
            writes = self.prefetch + 1
            # host buffers: the blocks resident at once (about prefetch + 2) plus the write-backs in flight
            heads = self.frozen.heads if self.frozen is not None else {}
            largest = max(store.region(b.region).capacity + (heads[b.index].nbytes if b.index in heads else 0)
                          for b in self.blocks)
            mover = transfer.transfer_for(self.device, largest,
                                         pool_size=self.prefetch + 2 + writes)
            self.residency = BlockResidency(store, self.blocks, max_pending_writes=writes, transfer=mover,
                                            frozen=self.frozen)
        return self.residency

    def materialize(self, store: FlatStore, device: torch.device) -> None:
        """Initialize a meta-device model module by module; each block goes to the store as soon as its
        last parameter is initialized, so at most about one block is ever in memory. With
        ``frozen_weights="in_place"``, the frozen parameters the initial weights locate in a file stay there."""
        if self.residency is None:
            self.in_place_heads.plan(initial_weights(self.model), self.blocks)
        residency = self.attach_store(store)

        def place_complete_blocks() -> None:
            for block in self.blocks:
                if not residency.placed(block) and not any(s.param.is_meta for s in block.slots):
                    residency.place(block)

        # Parameters read in place are never read here: placeholders at once (the copy a start then skips).
        served = self.frozen.served() if self.frozen is not None else {}
        skip = {id(s.param) for b in self.blocks for s in b.slots if s.name in served}
        materialize(self.model, device, place_complete_blocks, skip=skip)

    def place(self, store: FlatStore, device: torch.device) -> None:
        """Move an in-memory model's blocks into the store before the model goes to ``device``, leaving
        placeholders already on ``device``: only the parameters outside blocks are then copied there whole."""
        residency = self.attach_store(store)
        for block in self.blocks:
            if not residency.placed(block):
                residency.place(block, device)
        residency.drain()

    def start(self, store: FlatStore, planned: Iterable[torch.Tensor] = ()) -> None:
        """Move the blocks' values into the store (placeholders left behind; blocks already placed by
        ``materialize`` stay), install the hooks. ``planned``: the parameters offloaded optimizers update
        (held until updated)."""
        residency = self.attach_store(store)
        for block in self.blocks:
            if not residency.placed(block):
                residency.place(block)
        residency.drain()
        self.scheduler = BlockScheduler(residency, self.prefetch)
        self.scheduler.planned = {id(p) for p in planned}
        self.scheduler.install()
        for block in self.blocks:
            self._state_hooks.append(block.module._register_state_dict_hook(self.state_dicts.gather_hook(block)))
            self._state_hooks.append(block.module._register_load_state_dict_pre_hook(
                self.state_dicts.load_pre_hook(block), with_module=True))
            self._state_hooks.append(block.module.register_load_state_dict_post_hook(self.state_dicts.load_post_hook(block)))

    def keep_on_desk(self, regions: set[str]) -> None:
        """Keep the blocks of these regions on the device from now on (``device_memory_budget``): each is
        copied up once now and stays bound; the others stream as before."""
        assert self.residency is not None
        for block in self.blocks:
            if block.region in regions:
                self.residency.keep(block)

    def finish_step(self) -> None:
        if self.frozen is not None:
            self.frozen.check()  # a base file changed under the run: refused by name before the next step
        if self.scheduler is not None:
            self.scheduler.finish_step()
        if self.residency is not None:
            # Write-backs whose device -> host copy has completed go to the store; the others stay queued
            # (bounded by ``max_pending_writes``, polled at every block operation). No forced drain: waiting
            # here would stall the host on the GPU every step. Whoever needs them in the store asks
            # (``issue_writes``: a checkpoint, a background save, ``read_values``; ``stop`` drains).
            self.residency.poll_writes()
            self.residency.transfer.finish_step()

    def stop(self, restore: bool) -> None:
        """End of fit: with ``restore``, every block's values go back into its module (the module is
        an ordinary one again); otherwise the parameters stay in the store and stay placeholders."""
        if self.residency is None:
            return
        if self.scheduler is not None:  # None: setup failed before the hooks were installed
            self.scheduler.remove()
        # Every hold is dropped: after an exception inside a step (forward, backward, an update) the holder never
        # released its block; a normal end of fit has none left (``finish_step`` ran).
        self.residency.release_all()
        # Into host memory on every device: a copy to an accelerator would need the whole model there (an
        # out-of-memory exactly when offload was needed), and Lightning's teardown moves the model to the CPU
        # next. Without ``restore``, placeholders on the CPU: ``.cpu()`` of an expanded device placeholder
        # would allocate it full size.
        host = torch.device("cpu")
        for block in self.blocks:
            if restore:
                values = self.residency.read_values(block)
                self.residency.unkeep(block, write=False)  # the module holds the values now, not the store
                for slot in block.slots:
                    slot.param.data = values[slot.name]
            else:
                self.residency.unkeep(block)  # a block kept on the device: its changes go to the store
                if not self.residency.is_resident(block):  # resident only if setup failed midway: left as it is
                    self.residency.unbind(block, host)
        if restore:
            for h in self._state_hooks:
                h.remove()
            self._state_hooks = []
            # The blocks' store regions are never read again (the weights are the module's; a checkpoint after
            # fit gathers them from it, a new run makes its own store): the RAM copies need no write-back.
            self.residency.store.discard_shelved([b.region for b in self.blocks])
        self.residency.drain()
        self.residency.transfer.close()
        if restore:
            self._final_stats = self.residency.stats
            self.residency = None
            self.in_place_heads.close()

    def attach(self, store: FlatStore) -> None:
        """Continue on ``store`` (the same file reopened after fit, e.g. to save a checkpoint)."""
        if self.residency is not None:
            self.residency.store = store

    # ---- optimizer updates (``UpdateListener``) -----------------------------------------------------
    def _blocks_of(self, params: Sequence[torch.Tensor]) -> list[BlockLayout]:
        seen: dict[int, BlockLayout] = {}
        for p in params:
            block = self._block_of.get(id(p))
            if block is not None:
                seen[block.index] = block
        return list(seen.values())

    def before_update(self, touched: Sequence[torch.Tensor]) -> None:
        assert self.residency is not None
        for block in self._blocks_of(touched):
            self.residency.acquire(block, UPDATE, tail=True)  # frozen parameters are not needed for an update

    def after_update(self, touched: Sequence[torch.Tensor], finished: Sequence[torch.Tensor]) -> None:
        assert self.residency is not None and self.scheduler is not None
        for block in self._blocks_of(touched):
            self.residency.mark_dirty(block)
            self.residency.release(block, UPDATE)
        for block in self._blocks_of(finished):
            self.scheduler.updated(block, [p for p in finished if self._block_of.get(id(p)) is block])

    @property
    def hold_for_update(self) -> bool:
        return self.scheduler is not None and self.scheduler.hold_for_update

    @hold_for_update.setter
    def hold_for_update(self, value: bool) -> None:
        if self.scheduler is not None:
            self.scheduler.hold_for_update = value

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Every block in memory at once (a memory spike: for rare paths such as loading a plain
        optimizer checkpoint whose master weights come from the parameters)."""
        assert self.residency is not None
        for block in self.blocks:
            self.residency.acquire(block, USER)
        try:
            yield
        finally:
            for block in self.blocks:
                self.residency.release(block, USER)

    # ---- state_dict / load_state_dict ---------------------------------------------------------------
    @property
    def active(self) -> bool:
        """The blocks' values live in the store (during fit, and after it with ``restore_params=False``)."""
        return self.residency is not None

    def referencing_base_files(self) -> AbstractContextManager[None]:
        return self.in_place_heads.referencing()

    def by_reference(self) -> AbstractContextManager[None]:
        """Inside, ``state_dict()`` holds a ``BesideWeight`` per block parameter (``BlockStateDicts``)."""
        return self.state_dicts.by_reference()

    def loading_from(self, readers: WeightReaders) -> AbstractContextManager[set[str]]:
        """Inside, ``load_state_dict`` reads block weights' references from ``readers`` (``BlockStateDicts``)."""
        return self.state_dicts.loading_from(readers)

    def issue_writes(self) -> None:
        """Issue every write-back still waiting (a fence after it then covers them: a checkpoint may clone)."""
        if self.residency is not None:
            self.residency.issue_writes()

    def in_store(self, source: BlockLayout | Tail) -> bool:
        """The store holds this block's current values (after ``issue_writes`` and a fence) laid out as the block (a
        snapshot may clone its region); a ``Tail`` is read, never cloned."""
        assert self.residency is not None
        return not isinstance(source, Tail) and self.residency.in_store(source)

    def read_block(self, source: BlockLayout | Tail) -> dict[str, torch.Tensor]:
        """One block's values by parameter name (one block of memory); of a ``Tail``, its trainable ones only."""
        assert self.residency is not None
        if isinstance(source, Tail):
            return read_tail(self.residency, source.block)
        return self.residency.read_values(source, copy=False)


def chunks_per_block(layout: ParamLayout, chunks: Iterable[Chunk]) -> int:
    """The most of these optimizer chunks that hold state of one block's parameters (0: none)."""
    return chunks_per_unit({pid: block.index for pid, block in layout.block_of().items()}, chunks)


def chunks_per_unit(unit_of: Mapping[int, int], chunks: Iterable[Chunk]) -> int:
    """The most of these optimizer chunks that hold state of one unit's parameters (``unit_of``: ``id(param)`` ->
    its unit, a block or a block's shard; 0: none)."""
    per_unit: dict[int, set[int]] = {}
    for chunk in chunks:
        for piece in chunk.pieces:
            unit = unit_of.get(id(piece.param))
            if unit is not None:
                per_unit.setdefault(unit, set()).add(chunk.index)
    return max((len(c) for c in per_unit.values()), default=0)
