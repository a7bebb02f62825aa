"""Gradient sums across ranks in one fixed order: rank 0's part + rank 1's + ... + rank N-1's, left to right.

Why: a float sum depends on the order of its terms. A backend's reduce-scatter or all-reduce adds the N partial
gradients in an order of its own (Gloo's ring: it depends on the element's position in its buffer and on which
rank owns that piece), so a sharded reduction and DDP's bucketed all-reduce of the same gradients differ in the last
bits from 3 ranks on, and AdamW amplifies a last-bit difference of a near-zero gradient into a full step. Here every
element's sum is ``((g0 + g1) + g2) + ... + g(N-1)`` whatever the buffer, the bucket or the backend, so
``nvme_offload_fsdp`` (``reduce_order="rank"``) equals plain DDP bitwise at any N when DDP uses
``ordered_allreduce_hook`` (torch's ``register_comm_hook``, Lightning's ``DDPStrategy(ddp_comm_hook=...)``).

How: an ``all_to_all`` hands each rank the N partial pieces it owns (the same bytes per rank as a ring
reduce-scatter: (N - 1)/N of the buffer), which it then adds in rank order; the hook follows it with an
``all_gather`` of the sums (the same bytes as a ring all-reduce). Each ``g_r`` is the rank's gradient already
multiplied by 1/N, as DDP's reducer does before its all-reduce.
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_nvme.params.comm import BackendComm, Comm
from lightning_nvme.params.spare import SpareBuffers


def ordered_sum(parts: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``parts[0] + parts[1] + ... + parts[-1]``, added left to right (``parts.sum(0)`` may pair terms otherwise),
    into ``out`` if given (a new tensor otherwise)."""
    if len(parts) == 1:
        return parts[0].clone() if out is None else out.copy_(parts[0])
    out = torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)
    return out


class ScatterSum:
    """An asynchronous reduce-scatter whose sum runs in rank order: rank r receives the piece ``counts[r]`` of every
    rank's ``flat`` (``flat`` is cut into consecutive pieces of ``counts``, one per rank) and ``wait()`` returns
    their sum, added in rank order. ``flat`` must not change until ``wait()`` returns. ``comm`` moves the pieces
    (``params.comm``: the backend's all-to-all, or shared memory); ``spare``: where its receive buffer comes from
    and goes back to (``params.spare``)."""

    def __init__(self, flat: torch.Tensor, counts: Sequence[int], rank: int, comm: Comm,
                 spare: SpareBuffers | None = None) -> None:
        self.world, self.count, self._spare = len(counts), counts[rank], spare
        n = self.world * self.count
        self._recv = spare.take(n, flat.dtype, flat.device) if spare else torch.empty(n, dtype=flat.dtype, device=flat.device)
        self._work = comm.all_to_all(self._recv, flat, counts)

    def wait(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum (``count`` elements), written into ``out`` if given (where the caller wants it: no copy)."""
        self._work.wait()
        total = ordered_sum(self._recv.view(self.world, self.count), out)
        if self._spare is not None:
            self._spare.give(self._recv)
        return total


# no ``from __future__ import annotations`` here: torch's ``register_comm_hook`` checks the hook's annotations as objects
def ordered_allreduce_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the bucket's gradients averaged as DDP averages (multiplied by 1/N, then summed),
    the sum added in rank order on every element (``ScatterSum``, then an ``all_gather`` of the sums). ``group``: the
    process group (``None``: the default one). Synchronous (the returned future is complete): it is a reference for
    bitwise comparisons, not a fast path."""
    buf = bucket.buffer()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    piece = -(-buf.numel() // world)
    flat = torch.zeros(piece * world, dtype=buf.dtype, device=buf.device)
    flat[:buf.numel()].copy_(buf).mul_(1.0 / world)
    comm = BackendComm(group)
    mine = ScatterSum(flat, [piece] * world, rank, comm).wait()
    comm.all_gather(flat, mine).wait()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(flat[:buf.numel()].view_as(buf))
    return fut
