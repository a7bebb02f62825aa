"""``Partition``: which elements of which parameters each data-parallel rank owns the optimizer state of.

Why by bytes: each rank's store file and update time scale with the state bytes it owns, so the
shards are balanced by state bytes (a half-precision param with fp32 master weights costs more per
element than an fp32 one). Greedy by size: params are taken largest first and given to the rank with
the least load; a param that would push that rank past its fair share (total / N) is cut into element
ranges, the rest going to the next least-loaded rank (unless its update is not element-wise: then it
stays whole). Every rank computes the same partition from the
same optimizer, so no communication is needed to agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.optim import Optimizer

from lightning_nvme.optim.formats.state_format import EXACT, StateFormat
from lightning_nvme.optim.plan import bytes_per_element, describe_params

Ranges = dict[int, list[tuple[int, int]]]  # param index -> sorted element ranges [start, stop)


@dataclass(frozen=True)
class Partition:
    world_size: int
    ranges: list[Ranges]  # per rank
    state_bytes: list[int]  # per rank

    def owned(self, rank: int) -> Ranges:
        return self.ranges[rank]

    def owner_pieces(self) -> list[list[tuple[int, int, int]]]:
        """Per rank, its ``(param index, start, stop)`` ranges in param order (what it broadcasts)."""
        return [sorted((i, lo, hi) for i, rs in r.items() for lo, hi in rs) for r in self.ranges]

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "state_bytes": list(self.state_bytes),
                "ranges": [{i: [list(x) for x in rs] for i, rs in r.items()} for r in self.ranges]}


def partition_by_bytes(optimizer: Optimizer, world_size: int, master_weights: bool = True,
                       fmt: StateFormat = EXACT) -> Partition:
    """Split the optimizer's per-element state into ``world_size`` shards of about equal stored bytes
    (in format ``fmt``; cuts fall on multiples of ``fmt.align`` elements)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    infos, _ = describe_params(optimizer, master_weights, fmt=fmt)
    items = [(int(i.param.numel() * bytes_per_element(i.keys, fmt)), i.index, i.param.numel(),
              bytes_per_element(i.keys, fmt), i.splittable) for i in infos if i.keys]
    total = sum(nbytes for nbytes, *_ in items)
    share = -(-total // world_size)
    load = [0] * world_size
    ranges: list[Ranges] = [{} for _ in range(world_size)]
    for _, index, numel, per_elem, splittable in sorted(items, key=lambda t: (-t[0], t[1])):
        start = 0
        while True:
            rank = min(range(world_size), key=lambda r: (load[r], r))
            room = int((share - load[rank]) // per_elem) // fmt.align * fmt.align
            whole = numel - start <= room or room <= 0 or not splittable  # never cut a non-element-wise update
            stop = numel if whole else start + room
            ranges[rank].setdefault(index, []).append((start, stop))
            load[rank] += int((stop - start) * per_elem)
            start = stop
            if start >= numel:
                break
    for r in ranges:
        for rs in r.values():
            rs.sort()
    return Partition(world_size, ranges, load)
