"""``SpareBuffers``: block-sized CPU work buffers (gathered blocks, flat gradients, all-to-all receive buffers) reused
across blocks and steps instead of freed and allocated again.

Why: glibc serves an allocation above its mmap threshold (32 MiB at most) with a fresh anonymous mapping, faulted
and zeroed page by page at first touch and unmapped at free. ``nvme_offload_fsdp`` makes several block-sized
buffers per block and step (a 2.56 B GPT's block is 315 MB at width 2560: filling a fresh one took 0.166 s on this
machine's core, a reused one 0.014 s), each on the core its rank computes on. The same cure as the block buffers'
pool of ``offload_params`` (``params.transfer.HostTransfer``, #38).

A buffer is handed out again only once nothing else holds its storage (views bound as parameters, autograd's saved
tensors, a collective's input): its storage's use count is back to what it was when the pool made it. At most
``per_size`` buffers of each size and dtype are pooled (made on first need, kept for the run), so the pool holds
what was in use at once, not more; needs beyond it get ordinary tensors, freed as before.
"""

from __future__ import annotations

from collections import Counter

import torch

from lightning_nvme.params.transfer import storage_uses


class SpareBuffers:
    """``take(numel, dtype, device)`` a 1-D tensor (its values are garbage), ``give(t)`` it back when done."""

    def __init__(self, per_size: int) -> None:
        self.per_size = per_size
        self._baseline: dict[int, int] = {}  # data_ptr of a pooled buffer -> its storage's use count alone
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._made: Counter[tuple[int, torch.dtype]] = Counter()
        self.reused = 0  # takes served by a pooled buffer (the page faults saved)
        self.held = 0  # times a free buffer was passed over, its storage still held elsewhere

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu" or self.per_size <= 0:  # device memory has its own caching allocator
            return torch.empty(numel, dtype=dtype, device=device)
        key = (numel, dtype)
        free = self._free.get(key, [])
        for i, t in enumerate(free):
            if storage_uses(t) <= self._baseline[t.data_ptr()]:
                self.reused += 1
                return free.pop(i)
            self.held += 1
        t = torch.empty(numel, dtype=dtype)
        if self._made[key] < self.per_size:
            self._made[key] += 1
            self._baseline[t.data_ptr()] = storage_uses(t)
        return t

    def give(self, t: torch.Tensor | None) -> None:
        """``t`` (from ``take``, whole) is no longer used by its taker; others may still hold views of it."""
        if t is None or t.data_ptr() not in self._baseline or t.numel() != t.untyped_storage().nbytes() // t.itemsize:
            return
        free = self._free.setdefault((t.numel(), t.dtype), [])
        if all(b.data_ptr() != t.data_ptr() for b in free):
            free.append(t)

    def close(self) -> None:
        self._baseline, self._free, self._made = {}, {}, Counter()
