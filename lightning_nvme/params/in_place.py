"""``InPlaceHeads``: what ``frozen_weights="in_place"`` changes in a ``ParamOffload``'s state dicts.

Why its own object: the reader (``frozen_files``) serves bytes; this decides, per block, which state-dict entries a
checkpoint holds as references to the base file (``FileWeight``) and through which source the rest of the block
(its trainable ``Tail``) is read, and, on a load, which references name the very file this run reads (the bound
head is then the value: nothing read again, nothing to check on write-back).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_nvme.checkpoint.base_file import FileWeight
from lightning_nvme.params.frozen_files import FrozenFiles, split_read, wait_io
from lightning_nvme.params.layout import BlockLayout


class Tail:
    """The trainable tail of a block whose frozen head is read in place: the source of its adapters' references in
    a checkpoint that references the head in the base file (``read_block`` reads only this tail; never cloned from
    the store region as a whole block, whose offsets start at the tail)."""

    def __init__(self, block: BlockLayout) -> None:
        self.block = block


class InPlaceHeads:
    def __init__(self, setting: str) -> None:
        self.setting = setting
        self.frozen: FrozenFiles | None = None  # the base files frozen heads are read from
        self._file_refs = False  # state_dict() gives base-file references for the parameters read in place
        self._tails: dict[int, Tail] = {}
        self._as_file: set[int] = set()  # blocks whose loaded head is the base file's own (nothing to check)

    def plan(self, source: Any, blocks: list[BlockLayout]) -> None:
        """The blocks whose frozen parameters the model's initial weights locate in their safetensors files
        (``HubWeights.locate``) are read from there; the others keep them in the store."""
        locate = getattr(source, "locate", None)
        if self.setting != "in_place" or self.frozen is not None or locate is None:
            return
        frozen = FrozenFiles()
        if frozen.plan(blocks, locate):
            self.frozen = frozen
        else:
            frozen.close()

    def serves(self, block: BlockLayout) -> bool:
        return self.frozen is not None and block.index in self.frozen.heads

    @contextmanager
    def referencing(self) -> Iterator[None]:
        """Inside, ``state_dict()`` holds a ``FileWeight`` (path, key, the file's recorded identity) for each
        parameter read in place: a checkpoint references the user's base file instead of copying it."""
        self._file_refs = True
        try:
            yield
        finally:
            self._file_refs = False

    def gather(self, block: BlockLayout, local: list[tuple[str, Any]], state_dict: dict[str, Any],
               prefix: str) -> tuple[list[tuple[str, Any]], BlockLayout | Tail]:
        """Put references for the block's parameters read in place into ``state_dict``; returns the others and
        the source to read them from (the block, or its ``Tail``)."""
        if not (self._file_refs and self.frozen is not None and self.serves(block)):
            return local, block
        refs = {name: self.frozen.reference(slot.name) for name, slot in local}
        for name, ref in refs.items():
            if ref is not None and prefix + name in state_dict:
                state_dict[prefix + name] = ref
        return [(n, s) for n, s in local if refs[n] is None], self._tails.setdefault(block.index, Tail(block))

    def load_bound(self, block: BlockLayout, local: list[tuple[str, Any]], state_dict: dict[str, Any],
                   prefix: str) -> None:
        """A reference to exactly the file this run reads the head from (same identity, same tensor): the bound
        head already holds those bytes, so it is the value (the block is acquired)."""
        self._as_file.discard(block.index)
        if self.frozen is None or not self.serves(block):
            return
        head = [(name, slot) for name, slot in local if slot.offset < block.writable_offset]
        same = [(name, slot) for name, slot in head
                if _same_reference(state_dict.get(prefix + name), self.frozen.reference(slot.name))]
        for name, slot in same:
            state_dict[prefix + name] = slot.param.detach()
        if len(same) == len(head):
            self._as_file.add(block.index)

    def loaded_as_file(self, block: BlockLayout) -> bool:
        return block.index in self._as_file

    def close(self) -> None:
        if self.frozen is not None:
            self.frozen.close()
            self.frozen = None


def _same_reference(value: Any, ours: FileWeight | None) -> bool:
    """``value`` references the very tensor this run reads in place, in the file as this run recorded it."""
    return (isinstance(value, FileWeight) and ours is not None and value.file_key == ours.file_key
            and value.identity == ours.identity)


def read_tail(residency: Any, block: BlockLayout) -> dict[str, torch.Tensor]:
    """The trainable parameters' values of a block whose head is read in place (``BlockResidency``): from memory
    if resident, else only the tail is read from the store (a checkpoint of its adapters references the head)."""
    w = block.writable_offset
    if residency.is_resident(block) or residency.kept(block):
        values = residency.read_values(block)
        return {s.name: values[s.name] for s in block.slots if s.offset >= w}
    residency.issue_writes()  # the read sees the block's last write-back
    buf = residency.transfer.caller_buffer(residency.store.region(block.region).capacity)
    wait_io(residency.store, split_read(residency.store, residency.frozen, block, buf, w))
    return {s.name: buf[s.offset - w:s.offset - w + s.nbytes].view(s.dtype).view(s.shape)
            for s in block.slots if s.offset >= w}
