"""Where each offloaded parameter lives: one store region per block, parameters packed in it.

Frozen parameters come first in a block's region and are never written back: an update rewrites
only the page-aligned tail holding the trainable ones (the LoRA case writes adapters only).

A parameter belongs to a block only if every module that registers it is inside that one block;
tied or shared parameters (GPT-2's token embedding and LM head, a weight used by two blocks) and
parameters outside every block stay in memory (``ParamLayout.outside_blocks``), never streamed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_nvme.constants import ALIGN, align_up

# bytes: a parameter view inside a block buffer starts where the CUDA caching allocator would put it
# (cuBLASLt picks kernels by pointer alignment); coarser than constants.SLOT_ALIGN, the SIMD alignment
PARAM_SLOT_ALIGN = 256


@dataclass
class ParamSlot:
    """One parameter's bytes ``[offset, offset + nbytes)`` inside its block's region."""

    name: str
    param: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


@dataclass
class BlockLayout:
    index: int
    name: str
    module: nn.Module
    region: str
    slots: list[ParamSlot] = field(default_factory=list)
    nbytes: int = 0
    writable_offset: int = 0  # frozen parameters first; an update writes back only [writable_offset, end)

    @property
    def trainable(self) -> bool:
        return any(s.trainable for s in self.slots)


@dataclass
class ParamLayout:
    blocks: list[BlockLayout]
    outside_blocks: list[tuple[str, nn.Parameter]]  # kept in memory: outside every block, shared, tied

    @property
    def offloaded_bytes(self) -> int:
        return sum(s.nbytes for b in self.blocks for s in b.slots)

    @property
    def outside_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.outside_blocks)

    def block_of(self) -> dict[int, BlockLayout]:
        """``id(param)`` -> its block."""
        return {id(s.param): b for b in self.blocks for s in b.slots}


def plan_layout(model: nn.Module, blocks: list[tuple[str, nn.Module]], region_prefix: str = "params") -> ParamLayout:
    owners: dict[int, set[int]] = defaultdict(set)  # id(param) -> block indices (-1: outside every block)
    params: dict[int, tuple[str, nn.Parameter]] = {}
    block_prefixes = [(i, name + ".") for i, (name, _) in enumerate(blocks)]
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), (name, p))
        owner = next((i for i, prefix in block_prefixes if name.startswith(prefix)), -1)
        owners[id(p)].add(owner)
    layouts = [BlockLayout(i, name, module, f"{region_prefix}/block{i}") for i, (name, module) in enumerate(blocks)]
    outside: list[tuple[str, nn.Parameter]] = []
    members: dict[int, list[tuple[str, nn.Parameter]]] = defaultdict(list)
    for pid, (name, p) in params.items():
        where = owners[pid]
        if len(where) != 1 or -1 in where:
            outside.append((name, p))
        else:
            members[next(iter(where))].append((name, p))
    for index, named in members.items():
        block = layouts[index]
        frozen = [(n, p) for n, p in named if not p.requires_grad]
        trainable = [(n, p) for n, p in named if p.requires_grad]
        for group in (frozen, trainable):
            if group is trainable and frozen:
                block.nbytes = align_up(block.nbytes, ALIGN)  # write-backs start on a page: frozen bytes stay put
            if group is trainable:
                block.writable_offset = block.nbytes
            for name, p in group:
                nbytes = p.numel() * p.element_size()
                block.slots.append(ParamSlot(name, p, p.shape, p.dtype, block.nbytes, nbytes))
                block.nbytes = align_up(block.nbytes + nbytes, PARAM_SLOT_ALIGN)
        if not trainable:
            block.writable_offset = block.nbytes  # read-only block: never written back
    kept = [b for b in layouts if b.slots]
    for i, b in enumerate(kept):
        b.index = i  # position in forward order; the region name keeps the module's position
    return ParamLayout(kept, outside)
