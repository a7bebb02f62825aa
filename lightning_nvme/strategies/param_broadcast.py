"""``ParamBroadcast``: after a data-parallel update, the ranges each rank updated reach every other rank.

Why this shape (issue #14: this broadcast was the largest extra of ``nvme_offload_ddp`` over plain DDP,
see docs/performance.md):

* **No copies, no allocations per step.** A range of at least ``PACK_BELOW`` bytes is broadcast in place
  (a view of the parameter; ranges longer than ``bucket_bytes`` are cut). Smaller ranges (norms, biases)
  are packed into one buffer allocated once at setup (``bucket_bytes`` at most, shared by every
  source), so one broadcast carries many of them. Before, every multi-range bucket was a fresh
  concatenation (a new >8 MiB mmap, faulted in page by page, then copied out again on the receivers).
* **Early.** Each source rank broadcasts on its own process group, so its sends are issued as soon as the
  chunks holding those ranges are updated (while it still updates the rest, or during backward with
  ``overlap="backward"``), whatever the other ranks are doing. Receivers post their receives when their own
  update starts (never during backward: a receive must not overwrite weights backward still reads, nor
  before ``on_before_optimizer_step`` hooks and clipping have seen the old weights). Everything is waited
  for when the step ends, so the next forward sees identical replicas (bitwise: the bytes are the owner's).

Within a source's group the order of its broadcasts is fixed at setup and the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_nvme.constants import SLOT_ALIGN, align_up

# Ranges below this many bytes are packed (a copy of a few KiB costs less than a broadcast of its own);
# larger ones go in place (their transfer dominates the per-broadcast latency; a copy would double it).
PACK_BELOW = 256 << 10


@dataclass(frozen=True)
class Item:
    """One broadcast: ``ranges`` (param index, start, stop) of the ``src`` rank's parameters; ``packed`` is
    its (byte offset, bytes) in the packing buffer, ``None`` for one range broadcast in place."""

    src: int
    ranges: tuple[tuple[int, int, int], ...]
    packed: tuple[int, int] | None = None

    @property
    def params(self) -> frozenset[int]:
        return frozenset(i for i, _, _ in self.ranges)


def plan_items(owner_pieces: list[list[tuple[int, int, int]]], params: Sequence[torch.Tensor], bucket_bytes: int,
               reverse: bool = False) -> list[list[Item]]:
    """Per source rank, its broadcasts in issue order: in-place ranges in update order (param order, or
    reversed for ``overlap="backward"``), then its packed small ranges. Packing stops once the packing
    buffer (``bucket_bytes`` for all sources together) is full; the rest go in place."""
    left, offset = bucket_bytes, 0
    plan: list[list[Item]] = []
    for src, pieces in enumerate(owner_pieces):
        inplace: list[Item] = []
        packed: dict[torch.dtype, list[tuple[int, int, int]]] = {}
        for index, lo, hi in pieces:
            size = params[index].element_size()
            nbytes = (hi - lo) * size
            padded = align_up(nbytes, SLOT_ALIGN)
            if nbytes < PACK_BELOW and padded <= left:
                packed.setdefault(params[index].dtype, []).append((index, lo, hi))
                left -= padded
                continue
            step = max(1, bucket_bytes // size)
            inplace += [Item(src, ((index, a, min(a + step, hi)),)) for a in range(lo, hi, step)]
        if reverse:
            inplace.reverse()
        items = inplace
        for dtype, ranges in packed.items():
            nbytes = sum((hi - lo) for _, lo, hi in ranges) * torch.empty((), dtype=dtype).element_size()
            items.append(Item(src, tuple(ranges), (offset, nbytes)))
            offset += align_up(nbytes, SLOT_ALIGN)
        plan.append(items)
    return plan


def broadcast_groups(world_size: int, device: torch.device) -> list[dist.ProcessGroup]:
    """One process group per source rank (collective: every rank calls this, at setup), each used once here,
    in the same order on every rank.

    Why the first use here: NCCL creates a group's communicator lazily, at its first collective, and that
    creation is itself collective over the group's ranks. ``ParamBroadcast`` first uses a rank's *own* group
    (its sends go out as soon as its chunks are updated), so rank 0 would create group 0 while rank 1 creates
    group 1: each waits for the other, a hang. A one-element broadcast on each group, in index order, creates
    every communicator in the same order everywhere before any step."""
    groups = [dist.new_group(list(range(world_size))) for _ in range(world_size)]
    token = torch.zeros(1, device=device)
    for group in groups:
        dist.broadcast(token, 0, group=group)
    return groups


class ParamBroadcast:
    """The broadcasts of one optimizer's parameters, on ``groups[src]`` for source rank ``src``."""

    def __init__(self, params: Sequence[torch.Tensor], items: list[list[Item]], rank: int,
                 groups: Sequence[dist.ProcessGroup]) -> None:
        self.params = list(params)
        self.items = items
        self.rank = rank
        self.groups = groups
        packed = [it.packed for per in items for it in per if it.packed is not None]
        self.packing = torch.empty(max((o + n for o, n in packed), default=0), dtype=torch.uint8,
                                   device=self.params[0].device if self.params else None)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._waiting: list[set[int]] = []
        self._next = 0
        self._posted = False
        self._works: list[tuple[dist.Work, Item]] = []

    def __getstate__(self) -> dict:
        """A copy (deepcopy/pickle of the optimizer) has no process groups and nothing in flight."""
        return {**self.__dict__, "groups": [], "_works": []}

    def begin(self) -> None:
        """A step starts: none of this rank's ranges is updated yet, nothing is in flight."""
        self._waiting = [set(it.params) for it in self.items[self.rank]]
        self._next, self._posted, self._works = 0, False, []

    def finished(self, params: Sequence[torch.Tensor]) -> None:
        """Every range this rank owns of ``params`` is updated: send what is now complete, in order."""
        done = {self._index[id(p)] for p in params if id(p) in self._index}
        for waiting in self._waiting[self._next:]:
            waiting -= done
        self._send_ready()

    def post_receives(self) -> None:
        """Post every receive from the other ranks (they land as the owners send)."""
        if self._posted:
            return
        self._posted = True
        for src, items in enumerate(self.items):
            if src != self.rank:
                for it in items:
                    self._works.append((dist.broadcast(self._tensor(it), src, group=self.groups[src],
                                                       async_op=True), it))

    def finish(self) -> None:
        """The step's update is complete: send the rest, receive everything, unpack the packed ranges."""
        for waiting in self._waiting:
            waiting.clear()
        self._send_ready()
        self.post_receives()
        for work, it in self._works:
            work.wait()
            if it.src != self.rank and it.packed is not None:
                pos = 0
                flat = self._tensor(it)
                for view in self._views(it):
                    view.copy_(flat[pos:pos + view.numel()])
                    pos += view.numel()
        self._works = []

    def _send_ready(self) -> None:
        mine = self.items[self.rank]
        while self._next < len(mine) and not self._waiting[self._next]:
            it = mine[self._next]
            flat = self._tensor(it)
            if it.packed is not None:
                torch.cat(self._views(it), out=flat)
            self._works.append((dist.broadcast(flat, self.rank, group=self.groups[self.rank], async_op=True), it))
            self._next += 1

    def _views(self, it: Item) -> list[torch.Tensor]:
        return [self.params[i].detach().view(-1)[lo:hi] for i, lo, hi in it.ranges]

    def _tensor(self, it: Item) -> torch.Tensor:
        """What the broadcast carries: the range itself, or the item's slice of the packing buffer."""
        if it.packed is None:
            (i, lo, hi), = it.ranges
            return self.params[i].detach().view(-1)[lo:hi]
        offset, nbytes = it.packed
        return self.packing[offset:offset + nbytes].view(self.params[it.ranges[0][0]].dtype)
