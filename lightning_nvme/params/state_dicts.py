"""``BlockStateDicts``: a ``ParamOffload``'s blocks in ``state_dict`` / ``load_state_dict``.

Why its own object: the module's state dict must always show the true values (gathered from the store, or loaded
into it), or, for a checkpoint, references instead of values: ``BesideWeight`` for weights streamed beside the file
block by block, ``FileWeight`` for frozen weights read in place from the user's base file (``in_place``). These
hooks are that translation; ``ParamOffload`` owns the residency they read and write through.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from lightning_nvme.checkpoint.base_file import FileWeight
from lightning_nvme.checkpoint.weights import BesideWeight, WeightReaders
from lightning_nvme.params.in_place import Tail
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.params.schedule import USER
from lightning_nvme.store import StoreIOError


class BlockStateDicts:
    def __init__(self, owner: Any) -> None:
        self.owner = owner  # the ParamOffload
        self._referencing = False  # state_dict() gives references to block weights, not their values
        self._readers: WeightReaders | None = None  # load_state_dict() reads references from these

    @contextmanager
    def by_reference(self) -> Iterator[None]:
        """Inside, ``state_dict()`` holds a ``BesideWeight`` for each block parameter (with its block as the
        source) instead of reading it: a checkpoint streams them later, block by block (``read_block``)."""
        self._referencing = True
        try:
            yield
        finally:
            self._referencing = False

    @contextmanager
    def loading_from(self, readers: WeightReaders) -> Iterator[set[str]]:
        """Inside, ``load_state_dict`` reads each block's ``BesideWeight`` entries from ``readers`` as it loads
        that block (one block in memory at a time). Yields the state-dict keys of the block parameters."""
        self._readers = readers
        try:
            yield {name for name, p in self.owner.model.named_parameters(remove_duplicate=False) if id(p) in self.owner._block_of}
        finally:
            self._readers = None
    def _local_slots(self, block: BlockLayout) -> list[tuple[str, Any]]:
        """(name inside the block module, slot) for every name the module registers a block parameter under."""
        slots = {id(s.param): s for s in block.slots}
        return [(name, slots[id(p)]) for name, p in block.module.named_parameters(remove_duplicate=False)
                if id(p) in slots]

    def gather_hook(self, block: BlockLayout) -> Any:
        local = self._local_slots(block)

        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
            if self.owner.residency is None:
                return
            local_left, source = self.owner.in_place_heads.gather(block, local, state_dict, prefix)
            if not local_left:
                return
            if self._referencing:
                for name, slot in local_left:
                    if prefix + name in state_dict:
                        state_dict[prefix + name] = BesideWeight.of(prefix + name, slot.param, (source, slot.name))
                return
            try:
                values = (self.owner.read_block(source) if isinstance(source, Tail)
                          else self.owner.residency.read_values(block))
            except StoreIOError as e:
                raise RuntimeError(f"the parameters of {block.name} live only in the store "
                                   f"{self.owner.residency.store.path} and could not be read ({e}). After fit the store "
                                   "is closed: export them with trainer.strategy.export_weights('model.safetensors') "
                                   "(streamed, one block in memory at a time) or trainer.save_checkpoint(...), or "
                                   "keep restore_params=True so the weights return to the module at the end of "
                                   "fit.") from e
            for name, slot in local_left:
                key = prefix + name
                if key in state_dict:
                    state_dict[key] = values[slot.name]
        return hook

    def load_pre_hook(self, block: BlockLayout) -> Any:
        local = self._local_slots(block)

        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
            if self.owner.residency is None:
                return
            self.owner.residency.acquire(block, USER)
            self.owner.in_place_heads.load_bound(block, local, state_dict, prefix)
            for key, value in state_dict.items():  # ``state_dict`` is this block's own copy: the values go with it
                if isinstance(value, FileWeight):  # read in place by the run saved: its base file, checked
                    state_dict[key] = value.read()
                elif isinstance(value, BesideWeight) and self._readers is not None:
                    state_dict[key] = self._readers.read(value)
        return hook

    def load_post_hook(self, block: BlockLayout) -> Any:
        def hook(module: nn.Module, incompatible: Any) -> None:
            if self.owner.residency is not None:
                # frozen parameters were loaded too (unless they are the base file's, read in place)
                self.owner.residency.mark_dirty(block, whole=not self.owner.in_place_heads.loaded_as_file(block))
                self.owner.residency.release(block, USER)
        return hook
