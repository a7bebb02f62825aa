"""Host memory for activations in flight, and the CUDA legs of their trip (device <-> pinned host).

Why a side stream and events: the copy of a saved CUDA tensor to host must not stall the compute
stream, and neither the device memory nor the pinned buffer may be reused while a copy still reads
or writes it. The device -> host copy runs on a side stream that first waits for the compute that
produced the tensor; an event recorded after it tells the offloader when the disk write may start.
The host -> device copy runs on the stream that asked for the tensor, so backward's kernels are
ordered after it; the pinned buffer is kept until that copy's event has completed.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable

import torch

from lightning_nvme.store import align_up, aligned_empty

_pinned_used = False  # a pinned buffer was handed out since the last ``release_pinned_cache``


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` whose storage is page-aligned and 4 KiB-padded, so the store
    reads into / writes from it with O_DIRECT and no staging copy. Pinned buffers come from torch's
    caching host allocator (reused across steps, and safe with async copies; ``release_pinned_cache``
    hands them back at the end of fit)."""
    global _pinned_used
    if not pinned:
        return aligned_empty(nbytes)
    _pinned_used = True
    return torch.empty(align_up(max(nbytes, 1)), dtype=torch.uint8, pin_memory=True)[:nbytes]


def release_pinned_cache() -> bool:
    """Give the pinned blocks torch's caching host allocator keeps for reuse back to the system (the end of
    fit). Why: they stay pinned (locked RAM, counted against the host) for the life of the process otherwise,
    sized by the largest step's activations. Returns whether anything had been handed out.

    ``torch.accelerator.empty_host_cache`` is recent; torch 2.5 to 2.11 have only the private
    ``torch._C._host_emptyCache`` (the first GPU run, torch 2.11: the public name raised ``AttributeError`` at the
    end of every fit with activation offload). Older torch has neither: the cache then stays for the process."""
    global _pinned_used
    if not _pinned_used:
        return False
    _pinned_used = False
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
    return True


class CudaCopies:
    """Device <-> pinned host copies ordered with events; one side stream per device."""

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        """One device <-> host copy on the current stream. A seam: ``benchmarks/gpu_check.py``'s stress case
        delays it on the device, so a missing wait on its event would read or reuse a buffer too early."""
        dst.copy_(src, non_blocking=True)

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def to_host(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start copying the uint8 device tensor ``data`` to a pinned buffer; the event marks its end."""
        side = self._side(data.device)
        host = host_buffer(data.numel(), pinned=True)
        side.wait_stream(torch.cuda.current_stream(data.device))
        with torch.cuda.stream(side):
            CudaCopies.copy(host, data)
            done = torch.cuda.Event()
            done.record(side)
        data.record_stream(side)  # the allocator must not hand this memory out before the copy ran
        return host, done

    @staticmethod
    def to_device(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Copy a host buffer to ``device`` on the current stream; keep ``host`` until the event completes."""
        out = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        CudaCopies.copy(out, host)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        return out, done


class ReadBufferPool:
    """Page-aligned host read buffers reused within a step.

    Why: a fresh buffer is an anonymous mmap the kernel must fault in and zero page by page when the
    read lands (about 10k faults for 40 MiB), once per activation per step. In backward the buffer
    of the block just finished is freed as the next reads are issued, so a handful of buffers serve
    the whole backward. A buffer returns to the pool when its storage is freed (autograd let go of
    it); idle buffers are bounded by ``max_idle_bytes``, counted by ``on_idle_change``, and dropped by
    ``clear`` at the end of the step so none sits in memory through the next forward.
    """

    def __init__(self, max_idle_bytes: int, on_idle_change: Callable[[int], None] | None = None) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._on_idle_change = on_idle_change or (lambda delta: None)

    def get(self, nbytes: int) -> torch.Tensor:
        size = align_up(max(nbytes, 1))
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._idle_bytes -= size
        if buf is not None:
            self._on_idle_change(-size)
        else:
            buf = mmap.mmap(-1, size)
        t = torch.frombuffer(buf, dtype=torch.uint8)
        weakref.finalize(t.untyped_storage(), self._put, buf)
        return t[:nbytes]

    def _put(self, buf: mmap.mmap) -> None:
        with self._lock:
            keep = self._idle_bytes + len(buf) <= self.max_idle_bytes
            if keep:
                self._free.setdefault(len(buf), []).append(buf)
                self._idle_bytes += len(buf)
        if keep:
            self._on_idle_change(len(buf))

    def clear(self) -> None:
        with self._lock:
            freed, self._idle_bytes, self._free = self._idle_bytes, 0, {}
        self._on_idle_change(-freed)
