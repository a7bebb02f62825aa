"""Where a resident block's parameters point: its host buffer (CPU) or a copy on the accelerator (CUDA).

Why one object with two implementations: ``BlockResidency`` makes the same calls on every device
(``host_buffer`` -> store read -> ``to_device`` at acquire -> ``to_host`` before a write-back ->
``recycle``); only what they move differs, so the CPU tests exercise the accelerator's call sequence.

- ``HostTransfer`` (CPU): the page-aligned buffer the store reads into *is* the parameters' storage.
  ``to_device`` returns it, ``to_host`` has nothing to copy: no copy at all.
- ``CudaTransfer``: the host buffer is pinned. Once its read has completed (or at acquire at the
  latest) it is copied to a device buffer on a side stream ("up"); at acquire the compute stream waits on
  the copy's event before the parameters point at the device buffer (which is then the source of truth).
  Before a dirty block's write-back, another stream ("down") waits on an event recorded on the compute
  stream (after the update), copies device -> host and records an event; the residency issues the store
  write once that event has completed (it polls ``query`` and synchronizes only when it must: the compute
  stream never waits for the disk). The device buffer is ``record_stream``-ed on each stream that uses it
  (compute, down), so the allocator does not reuse it while a copy back still reads it. A block on the shelf
  (``host_memory_budget``) comes back the same way, into a pool buffer (pinned), never into the shelf's
  pageable memory (a synchronous copy); the store write into the shelf follows the event. Bound blocks, and
  the blocks read ahead whose upload started early (at most ``prefetch``), have a device copy.

Host buffers on CUDA: a pool of ``pool_size`` page-aligned buffers (anonymous mmap, as the store's own,
so O_DIRECT moves them without a staging copy), each registered once with CUDA (``store.pinned``: portable,
errors cleared, unregistered by ``close`` or at the latest before its memory is freed). Why not pin each
fresh buffer: registration pins the pages at every block load (slow); why not
``torch.empty(pin_memory=True)``: its allocator rounds sizes up to a power of two and does not promise page
alignment. Needs beyond the pool get pageable buffers (correct, copies synchronous; counted in
``TransferStats.pageable_buffers``). The CPU transfer pins nothing (no device copy: no CUDA context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightning_nvme.optim.buffers import CudaOps  # one home for the CUDA calls both device paths make
from lightning_nvme.store import aligned_empty
from lightning_nvme.store.pinned import pinned_empty, unpin


class Ready(Protocol):
    """Completion of a copy (a CUDA event, or ``DONE``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE: Ready = _Done()


@dataclass
class TransferStats:
    h2d_bytes: int = 0  # host -> device copies whose timing is known (completed)
    d2h_bytes: int = 0
    h2d_s: float = 0.0  # their summed duration on the side streams (CUDA events)
    d2h_s: float = 0.0
    pinned_buffers: int = 0  # host buffers registered with CUDA (the pool)
    pageable_buffers: int = 0  # host buffers handed out beyond the pool (or when registration failed)
    pool_buffers: int = 0  # CPU: block buffers made for the pool (at most its size, unless some were retained)
    pool_buffers_held: int = 0  # CPU: times a free pool buffer was passed over, still held elsewhere (autograd)


class BlockTransfer(Protocol):
    stats: TransferStats
    reuses_buffers: bool  # host buffers return to a pool (values handed out must be copies)
    device_copies: bool  # bound parameters are copies in device memory (not the host buffer itself)

    def host_buffer(self, nbytes: int) -> torch.Tensor: ...

    def caller_buffer(self, nbytes: int) -> torch.Tensor: ...

    def recycle(self, host: torch.Tensor) -> None: ...

    def upload(self, host: torch.Tensor) -> Any: ...

    def to_device(self, host: torch.Tensor, uploaded: Any = None) -> torch.Tensor: ...

    def to_host(self, device: torch.Tensor, host: torch.Tensor) -> Ready: ...

    def retained(self, device: torch.Tensor) -> bool: ...

    def finish_step(self) -> None: ...

    def close(self) -> None: ...


class HostTransfer:
    """CPU: the host buffer is the parameters' storage; every call but the allocation is a no-op.

    Block buffers come from a pool of at most ``pool_size`` page-aligned buffers of ``buffer_bytes`` (made on
    first need, kept for the run), recycled when a block leaves memory or its write-back completes. Why: a fresh
    anonymous mapping per block read is faulted and zeroed page by page inside the I/O worker's read and unmapped
    again at eviction, twice per block and step; on a CPU busy with the model's compute that work delayed the
    compute (docs/performance.md, #38). Peak memory is unchanged: the pool holds what was in use at once. A buffer
    something else still holds when it would be reused (autograd keeps ``weight.t()``, a view, when a block ran
    without activation checkpointing) is passed over until its holder lets go, and a fresh mapping serves
    meanwhile, as before the pool: a read never overwrites memory a saved tensor points at. Values handed out as
    views of a resident block (``read_values(copy=False)``) are safe by the same rule. A request below half a
    buffer (a LoRA update's trainable tail) gets its own small mapping, as before."""

    reuses_buffers = False  # a pooled buffer is reused only once nothing else holds it (``host_buffer``)
    device_copies = False

    def __init__(self, buffer_bytes: int = 0, pool_size: int = 0) -> None:
        self.buffer_bytes = buffer_bytes
        self.pool_size = pool_size
        self.stats = TransferStats()
        self._pool: dict[int, tuple[torch.Tensor, int]] = {}  # data_ptr -> (buffer, its storage's use count alone)
        self._free: list[torch.Tensor] = []

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Page-aligned and padded: the store moves it with O_DIRECT, no staging copy (as ``FlatStore.aligned_empty``)."""
        if not self.buffer_bytes // 2 <= nbytes <= self.buffer_bytes:
            return aligned_empty(nbytes)
        for i, base in enumerate(self._free):
            if storage_uses(base) <= self._pool[base.data_ptr()][1]:
                return self._free.pop(i)[:nbytes]
            self.stats.pool_buffers_held += 1  # still held elsewhere: it waits in the pool until its holder lets go
        if len(self._pool) >= self.pool_size:
            return aligned_empty(nbytes)
        fresh = aligned_empty(self.buffer_bytes)
        self._pool[fresh.data_ptr()] = (fresh, storage_uses(fresh))
        self.stats.pool_buffers += 1
        return fresh[:nbytes]

    def caller_buffer(self, nbytes: int) -> torch.Tensor:
        """A buffer the caller keeps (values read for a checkpoint): not from the pool."""
        return aligned_empty(nbytes)

    def recycle(self, host: torch.Tensor) -> None:
        """``host`` (from ``host_buffer``) is no longer used by the residency or the store."""
        held = self._pool.get(host.data_ptr())
        if held is not None and all(b is not held[0] for b in self._free):
            self._free.append(held[0])

    def upload(self, host: torch.Tensor) -> Any:
        return None  # nothing to copy

    def to_device(self, host: torch.Tensor, uploaded: Any = None) -> torch.Tensor:
        return host

    def to_host(self, device: torch.Tensor, host: torch.Tensor) -> Ready:
        if device.data_ptr() != host.data_ptr():  # a block kept bound (``device_memory_budget``) read for a caller
            host.copy_(device)
        return DONE

    def retained(self, device: torch.Tensor) -> bool:
        return False  # the host buffer: host memory, bounded by the store's reads only with checkpointing too

    def finish_step(self) -> None:
        pass

    def close(self) -> None:
        """The pool's buffers go (freed once nothing holds them); later needs get fresh ones."""
        self._pool, self._free, self.pool_size = {}, [], 0


def storage_uses(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (views, autograd's saved tensors; plus the query's own)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return 0 if use_count is None else int(use_count(t.untyped_storage()._cdata))


class CudaTransfer:
    """Args:
        device: the accelerator the parameters are bound on.
        buffer_bytes: the largest block region (every pool buffer holds any block).
        pool_size: pinned host buffers (the blocks resident at once plus write-backs in flight).
    """

    reuses_buffers = True
    device_copies = True

    def __init__(self, device: torch.device, buffer_bytes: int, pool_size: int, ops: Any = None) -> None:
        self.device = device
        self.buffer_bytes = buffer_bytes
        self.pool_size = pool_size
        self.ops = ops if ops is not None else CudaOps()
        # Two side streams: a write-back's copy waits for the compute stream's update; on one stream with the
        # uploads, the next block's upload would queue behind it.
        self.up = self.ops.stream(device)
        self.down = self.ops.stream(device)
        self.stats = TransferStats()
        self._pinned: dict[int, torch.Tensor] = {}  # data_ptr -> pool buffer
        self._free: list[tuple[torch.Tensor, Ready]] = []  # with the copy that may still read it
        self._reading: dict[int, Ready] = {}  # pool buffer -> its last host -> device copy
        self._timed: list[tuple[str, Any, Any, int]] = []  # copies whose duration is not collected yet

    # ---- host buffers --------------------------------------------------------------------------------
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.buffer_bytes:
            raise ValueError(f"block of {nbytes} bytes exceeds the pool's buffers ({self.buffer_bytes} bytes; a bug)")
        if self._free:
            base, busy = self._free.pop()
            busy.synchronize()  # a host -> device copy may still read it; the store is about to overwrite it
            return base[:nbytes]
        if len(self._pinned) < self.pool_size:
            fresh = pinned_empty(self.buffer_bytes)
            if fresh is not None:
                self._pinned[fresh.data_ptr()] = fresh
                self.stats.pinned_buffers += 1
                return fresh[:nbytes]
            self.pool_size = len(self._pinned)  # registration refused (e.g. a locked-memory limit): stop asking
        self.stats.pageable_buffers += 1
        return aligned_empty(nbytes)

    def caller_buffer(self, nbytes: int) -> torch.Tensor:
        """A buffer the caller keeps (values read for a checkpoint): not from the pool."""
        return aligned_empty(nbytes)

    def recycle(self, host: torch.Tensor) -> None:
        """``host`` (from ``host_buffer``) is no longer used by the residency or the store."""
        base = self._pinned.get(host.data_ptr())
        if base is not None:
            self._free.append((base, self._reading.pop(base.data_ptr(), DONE)))

    # ---- copies --------------------------------------------------------------------------------------
    def upload(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` to a new device buffer (a block read ahead, before it is needed: the copy
        overlaps the compute of the blocks before it). Nothing waits for it until ``to_device``."""
        with self.ops.on(self.up):
            dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            done = self._copy("h2d", self.up, dev, host)
        if host.data_ptr() in self._pinned:
            self._reading[host.data_ptr()] = done
        return dev, done

    def to_device(self, host: torch.Tensor, uploaded: Any = None) -> torch.Tensor:
        """A device copy of ``host`` (the one ``upload`` started, if given), usable on the current stream as
        soon as this returns."""
        dev, done = uploaded if uploaded is not None else self.upload(host)
        compute = self.ops.current_stream(self.device)
        compute.wait_event(done)
        self.ops.record_stream(dev, compute)  # freed after the compute stream's last use, not the side stream's
        return dev

    def to_host(self, device: torch.Tensor, host: torch.Tensor) -> Ready:
        """Start copying ``device`` back into ``host`` after the compute stream's work so far (the update).

        ``device`` is ``record_stream``-ed on the download stream: the residency drops its last reference
        right after this call, and the caching allocator only waits for the streams it knows (the upload
        stream it was made on, the compute stream) before handing the memory to the next allocation; without
        this the next block's upload could overwrite it while this copy still reads it, and the store would
        receive another block's bytes."""
        updated = self.ops.event()
        updated.record(self.ops.current_stream(self.device))
        self.down.wait_event(updated)
        with self.ops.on(self.down):
            done = self._copy("d2h", self.down, host, device)
        self.ops.record_stream(device, self.down)
        return done

    def retained(self, device: torch.Tensor) -> bool:
        """Whether anything besides ``device`` itself still holds its memory once the parameters no longer
        point into it: autograd's saved tensors (``F.linear`` saves ``weight.t()``, a view, not the Parameter)."""
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None:
            return False
        return int(use_count(device.untyped_storage()._cdata)) > 2  # ``device`` and the storage object asked for

    def _copy(self, kind: str, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        start, done = self.ops.event(timing=True), self.ops.event(timing=True)
        start.record(stream)
        self.ops.copy(dst, src)
        done.record(stream)
        self._timed.append((kind, start, done, src.numel()))
        return done

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def collect(self, wait: bool = False) -> None:
        """Add the durations of completed copies to ``stats`` (with ``wait``, of all of them)."""
        pending = []
        for kind, start, done, nbytes in self._timed:
            if not wait and not done.query():
                pending.append((kind, start, done, nbytes))
                continue
            done.synchronize()
            seconds = start.elapsed_time(done) / 1000
            if kind == "h2d":
                self.stats.h2d_bytes += nbytes
                self.stats.h2d_s += seconds
            else:
                self.stats.d2h_bytes += nbytes
                self.stats.d2h_s += seconds
        self._timed = pending

    def finish_step(self) -> None:
        self.collect()

    def close(self) -> None:
        """Unregister the pool (after the residency drained its I/O); later buffers are pageable."""
        self.collect(wait=True)  # every copy has completed
        for base in self._pinned.values():
            unpin(base)  # now, even if a caller still holds a view of it
        self._pinned, self._free, self._reading, self.pool_size = {}, [], {}, 0


def transfer_for(device: torch.device, buffer_bytes: int, pool_size: int) -> BlockTransfer:
    """The transfer for parameters bound on ``device`` (the strategy refuses other device types first)."""
    if device.type == "cpu":
        return HostTransfer(buffer_bytes, pool_size)
    if device.type == "cuda":
        return CudaTransfer(device, buffer_bytes, pool_size)
    raise ValueError(f"offload_params=True supports cpu and cuda devices, not {device}")
