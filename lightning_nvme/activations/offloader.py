"""``ActivationOffloader``: the tensors a training step's forward saves for backward go to the flat
store, and come back in backward read ahead of need.

Why this shape (prior art: torch ``save_on_cpu``, torchtune ``OffloadActivations``, SSDTrain):
- Only what is worth it leaves memory: by default the inputs of ``torch.utils.checkpoint`` regions
  (what checkpointing keeps through the whole step), at least ``min_bytes``, never a parameter or
  buffer (recognised by storage, so ``weight.t()`` counts as the weight).
- The unit moved is a *storage*: views, non-contiguous tensors and several views of one buffer
  (q, k, v of one projection) are written once and rebuilt with their own size/stride/offset.
- Saved tensors are keyed by a record object, never by address (addresses are reused).
- The last ``keep_last`` storages saved are the first backward needs: they stay in memory (and are
  written behind, after their first use, so ``retain_graph=True`` can read them again).
- A write's tensor is released only after the write completed (the handle is fenced first); reads
  are issued ``prefetch_depth`` records ahead in reverse save order, within a byte budget.
- All of it is undone at ``end_step`` (or ``abort`` after an exception): no I/O left pending, no
  buffer held, no hook left installed.

Lifecycle: ``begin`` (hooks on) -> forward -> ``end_forward`` (hooks off, prefetch starts) ->
backward -> ``end_step``. Independent of Lightning; the callback calls these from its hooks.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_nvme.activations.arena import ActivationArena
from lightning_nvme.activations.boundary import DETECTION_AVAILABLE, close_abandoned_checkpoints, saved_at_checkpoint_boundary
from lightning_nvme.activations.device import CudaStaging, ReadBufferPool, host_buffer
from lightning_nvme.activations.meter import ResidencyMeter, storage_ptrs
from lightning_nvme.constants import MiB
from lightning_nvme.store import FlatStore, IOHandle

log = logging.getLogger(__name__)

SCOPES = ("checkpoint", "all")


@dataclass
class OffloadStats:
    """What one step (or the sum of steps) did. ``*_wait_s``: time compute was blocked on the disk."""

    saved_tensors: int = 0  # pack calls seen
    offloaded_tensors: int = 0  # pack calls answered with a store record
    storages: int = 0  # distinct storages recorded
    bytes_written: int = 0
    bytes_read: int = 0
    memory_hits: int = 0  # unpacked while still in memory (kept, or write not finished)
    prefetch_hits: int = 0  # unpacked from a read issued ahead
    misses: int = 0  # unpacked with a synchronous read
    read_wait_s: float = 0.0
    write_wait_s: float = 0.0  # forward blocked by the in-flight write budget
    io_busy_s: float = 0.0  # wall time during which any of the step's I/O was in flight

    def add(self, other: OffloadStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class _Stored:
    """One storage saved this step: in memory, on its way to disk, on disk, or released."""

    __slots__ = ("index", "nbytes", "device", "step", "version", "data", "state", "region", "offset", "write",
                 "host", "copy_event", "prefetch", "pinned", "__weakref__")

    def __init__(self, index: int, data: torch.Tensor, step: int, version: int) -> None:
        self.index = index  # position in save order
        self.nbytes = data.numel()
        self.device = data.device
        self.step = step
        self.version = version
        self.data: torch.Tensor | None = data  # uint8 over the whole storage while it is held
        self.state = "held"  # held | kept | copying | writing | stored | released
        self.region = ""
        self.offset = 0
        self.write: IOHandle | None = None
        self.host: torch.Tensor | None = None  # CUDA: pinned copy being written
        self.copy_event: Any = None
        self.prefetch: tuple[IOHandle, torch.Tensor] | None = None
        self.pinned = False  # needed soon in backward: do not drop ``data`` when its write completes


class _Packed:
    """What the autograd graph holds instead of a tensor: the record and the view to rebuild."""

    __slots__ = ("stored", "dtype", "size", "stride", "storage_offset")

    def __init__(self, stored: _Stored, t: torch.Tensor) -> None:
        self.stored = stored
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.storage_offset = t.storage_offset()


def _busy_seconds(handles: list[IOHandle]) -> float:
    """Length of the union of [submit, done] over ``handles``."""
    spans = sorted((h.t_submit, h.t_done) for h in handles if h.t_done is not None)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class ActivationOffloader:
    """Saved-tensor hooks that move a step's activations through ``store``.

    Args:
        store: the flat store; the offloader adds its own regions (``region_prefix.N``) to it.
        scope: ``"checkpoint"`` offloads only the inputs saved by ``torch.utils.checkpoint`` regions;
            ``"all"`` offloads any saved tensor of at least ``min_bytes``.
        min_bytes: storages smaller than this stay in memory (the I/O would cost more than it saves).
        keep_last: the last N storages saved stay in memory: backward needs them first.
        prefetch_depth: reads issued ahead of backward, in reverse save order.
        max_write_inflight_bytes: bytes of tensors waiting for their write; forward blocks above it.
        max_prefetch_bytes: bytes of read-ahead buffers (at least one read is always allowed).
        min_segment_bytes / grow_fraction: how the activation area of the store grows (see ``ActivationArena``).
        meter: counts resident saved-activation bytes (a fresh one if not given).
    """

    def __init__(self, store: FlatStore, *, region_prefix: str = "activations", scope: str = "checkpoint",
                 min_bytes: int = 1 * MiB, keep_last: int = 1, prefetch_depth: int = 2,
                 max_write_inflight_bytes: int = 256 * MiB, max_prefetch_bytes: int = 512 * MiB,
                 min_segment_bytes: int = 256 * MiB, grow_fraction: float = 0.5,
                 meter: ResidencyMeter | None = None) -> None:
        self.check_args(scope=scope, min_bytes=min_bytes, keep_last=keep_last, prefetch_depth=prefetch_depth,
                        max_write_inflight_bytes=max_write_inflight_bytes, max_prefetch_bytes=max_prefetch_bytes,
                        min_segment_bytes=min_segment_bytes)
        self.store = store
        self.scope = scope
        self.min_bytes = min_bytes
        self.keep_last = keep_last
        self.prefetch_depth = prefetch_depth
        self.max_write_inflight_bytes = max_write_inflight_bytes
        self.max_prefetch_bytes = max_prefetch_bytes
        self.arena = ActivationArena(store, region_prefix, min_segment_bytes=min_segment_bytes,
                                     grow_fraction=grow_fraction)
        self.meter = meter or ResidencyMeter()
        self.stats = OffloadStats()  # the step in progress
        self.last_step_stats = OffloadStats()
        self.total_stats = OffloadStats()
        self._lock = threading.RLock()  # unpack runs on autograd's device threads for CUDA
        self._staging: CudaStaging | None = None
        self._read_pool = ReadBufferPool(max_prefetch_bytes, on_idle_change=self.meter.add)
        self._hooks: saved_tensors_hooks | None = None
        self._orphan: saved_tensors_hooks | None = None  # ours, left under someone else's after an exception
        self._phase = "idle"  # idle | forward | backward
        self._step = 0
        self._exclude: set[int] = set()
        self._warned_no_boundary = False
        self._reset_step_state()

    @staticmethod
    def check_args(*, scope: str, min_bytes: int, keep_last: int, prefetch_depth: int, max_write_inflight_bytes: int,
                   max_prefetch_bytes: int, min_segment_bytes: int) -> None:
        """Reject bad settings at construction, naming the argument."""
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        for name, value in (("min_bytes", min_bytes), ("keep_last", keep_last), ("prefetch_depth", prefetch_depth)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name, value in (("max_write_inflight_bytes", max_write_inflight_bytes),
                            ("max_prefetch_bytes", max_prefetch_bytes), ("min_segment_bytes", min_segment_bytes)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def _reset_step_state(self) -> None:
        self._order: list[_Stored] = []
        self._by_storage: dict[int, _Stored] = {}
        self._window: deque[_Stored] = deque()
        self._writes: list[_Stored] = []  # copying or writing, oldest first
        self._reads: list[_Stored] = []  # with a prefetch in flight or ready
        self._h2d: list[tuple[torch.Tensor, Any]] = []  # CUDA: host buffers until their copy ran
        self._handles: list[IOHandle] = []
        self._inflight_write_bytes = 0
        self._prefetch_bytes = 0
        self._cursor = -1

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._hooks is not None

    @property
    def phase(self) -> str:
        return self._phase

    def begin(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        """Install the hooks for a step's forward. ``exclude``: parameters and buffers (never offloaded)."""
        if self._phase != "idle":
            self.end_step()
        self._pop_orphan()
        self._step += 1
        self._exclude = storage_ptrs(exclude)
        self.arena.reset()
        self.stats = OffloadStats()
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._phase = "forward"

    def end_forward(self) -> None:
        """Forward is over: remove the hooks (recomputation in backward is never offloaded again) and
        start reading ahead."""
        if self._phase != "forward":
            return
        self._pop_hooks()
        with self._lock:
            for s in self._window:
                s.state = "kept"
            self._window.clear()
            self._phase = "backward"
            self._cursor = len(self._order) - 1
            self._reap()
            self._fill_prefetch()
        if (self.scope == "checkpoint" and not self._order and self.stats.saved_tensors
                and not self._warned_no_boundary):
            self._warned_no_boundary = True
            log.warning("NVMe activation offload: no tensor was saved at a torch.utils.checkpoint boundary in this "
                        "step (detection available: %s). Wrap blocks in torch.utils.checkpoint.checkpoint, or use "
                        "scope='all' to offload any saved tensor >= min_bytes.", DETECTION_AVAILABLE)

    def end_step(self) -> None:
        """The step is over: wait for its I/O, release every buffer. Saved tensors of this step can no
        longer be unpacked."""
        self._finish(raise_errors=True)

    def abort(self, exc: BaseException | None = None) -> None:
        """Like ``end_step`` after an exception (default: the one being handled): never raises, logs
        the I/O errors it finds."""
        self._finish(raise_errors=False, exc=exc if exc is not None else sys.exc_info()[1])

    def _finish(self, *, raise_errors: bool, exc: BaseException | None = None) -> None:
        self._pop_orphan()
        if self._phase == "idle":
            return
        first_error: BaseException | None = None
        try:
            if self._hooks is not None:
                if not self._hooks_on_top():
                    close_abandoned_checkpoints(exc)
                self._pop_hooks(strict=raise_errors)
        except BaseException as e:  # noqa: BLE001
            first_error = e
        with self._lock:
            # CUDA copies first (a finished copy may still start its disk write in the reap below), then
            # every disk request of the step.
            for s in self._writes:
                if s.copy_event is not None:
                    s.copy_event.synchronize()
            for _, event in self._h2d:
                event.synchronize()
            if first_error is None and raise_errors:
                try:
                    self._reap()
                except BaseException as e:  # noqa: BLE001
                    first_error = e
            for h in list(self._handles):
                try:
                    self.store.wait(h)
                except BaseException as e:  # noqa: BLE001 - drain everything, then report the first
                    first_error = first_error or e
            if first_error is None:
                try:
                    self._reap()
                except BaseException as e:  # noqa: BLE001
                    first_error = e
            for s in self._order:
                s.data = s.host = s.prefetch = s.copy_event = None
                s.state = "released"
            self._read_pool.clear()
            self.stats.io_busy_s = _busy_seconds(self._handles)
            self.last_step_stats = self.stats
            self.total_stats.add(self.stats)
            self._reset_step_state()
            self._phase = "idle"
        if first_error is not None:
            if raise_errors:
                raise first_error
            log.warning("NVMe activation offload: I/O error while cleaning up after an exception: %r", first_error)

    def _hooks_on_top(self, hooks: saved_tensors_hooks | None = None) -> bool:
        hooks = hooks or self._hooks
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return hooks is not None and top is not None and top[0] is hooks.pack_hook

    def _pop_hooks(self, strict: bool = True) -> None:
        hooks = self._hooks
        if hooks is None:
            return
        if not self._hooks_on_top(hooks):
            if strict:  # ours stay recorded, so abort() can still remove them
                raise RuntimeError("NVMe activation offload: the innermost saved_tensors_hooks are not ours; a "
                                   "saved_tensors_hooks context entered during forward was not exited before backward")
            # Someone else's hooks sit above ours. Ours now pass everything through (phase "idle");
            # they are removed as soon as they are on top again (next step or cleanup).
            self._orphan, self._hooks = hooks, None
            log.warning("NVMe activation offload: other saved_tensors_hooks are still active above ours after an "
                        "exception; ours pass tensors through until they can be removed")
            return
        self._hooks = None
        hooks.__exit__(None, None, None)

    def _pop_orphan(self) -> None:
        if self._orphan is not None and self._hooks_on_top(self._orphan):
            self._orphan.__exit__(None, None, None)
            self._orphan = None

    @property
    def pending_io(self) -> int:
        """Requests of the current step not completed yet (0 once the step has ended)."""
        return sum(not h.done() for h in self._handles)

    @property
    def held_bytes(self) -> int:
        """Bytes of activation memory the offloader itself references right now."""
        total = 0
        for s in self._order:
            total += s.nbytes * ((s.data is not None) + (s.host is not None) + (s.prefetch is not None))
        return total

    # ---- pack (forward) -----------------------------------------------------------------------
    def _offloadable(self, t: torch.Tensor) -> bool:
        if self._phase != "forward" or torch._C._current_graph_task_id() != -1:
            return False  # backward (e.g. a reentrant checkpoint recomputing) is never offloaded again
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return False
        if t.device.type not in ("cpu", "cuda") or (t.requires_grad and t.grad_fn is None):
            return False  # leaves (parameters, user inputs) are held by their owner anyway
        storage = t.untyped_storage()
        if storage.nbytes() < max(self.min_bytes, 1) or storage.data_ptr() in self._exclude:
            return False
        return self.scope == "all" or saved_at_checkpoint_boundary()

    def _pack(self, t: torch.Tensor) -> Any:
        with self._lock:
            self.stats.saved_tensors += 1
            if not self._offloadable(t):
                if t.layout == torch.strided and t.device.type in ("cpu", "cuda"):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in self._exclude and storage.nbytes():
                        self.meter.track(storage)
                return t.detach()
            storage = t.untyped_storage()
            stored = self._by_storage.get(id(storage))
            if stored is None or stored.version != t._version or stored.state == "released":
                stored = self._record(storage, t._version)
            self.stats.offloaded_tensors += 1
            return _Packed(stored, t)

    def _record(self, storage: torch.UntypedStorage, version: int) -> _Stored:
        with torch.no_grad():
            data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        stored = _Stored(len(self._order), data, self._step, version)
        key = id(storage)
        self._order.append(stored)
        self._by_storage[key] = stored
        weakref.finalize(storage, self._forget, key, weakref.ref(stored))
        self.meter.track(storage)
        self.stats.storages += 1
        self._window.append(stored)
        while len(self._window) > self.keep_last:
            self._start_write(self._window.popleft())
        self._reap()
        return stored

    def _forget(self, key: int, ref: weakref.ref[_Stored]) -> None:
        """The storage died: its id may be reused by a new storage, which must not match this record.

        Lock-free on purpose: this runs on whichever thread drops the storage last, e.g. an I/O worker
        finishing a write while the main thread holds the lock and waits for that very write. No new
        object can take ``key`` while the dying one is being finalized, so the check cannot race."""
        if self._by_storage.get(key) is ref():
            self._by_storage.pop(key, None)

    def _start_write(self, s: _Stored) -> None:
        t0 = time.perf_counter()
        blocked = False
        while self._writes and self._inflight_write_bytes + s.nbytes > self.max_write_inflight_bytes:
            blocked = True
            self._complete(self._writes[0])
        if blocked:
            self.stats.write_wait_s += time.perf_counter() - t0
        s.region, s.offset = self.arena.alloc(s.nbytes)
        assert s.data is not None
        if s.device.type == "cuda":
            if self._staging is None:
                self._staging = CudaStaging()
            s.host, s.copy_event = self._staging.to_host(s.data)
            s.state = "copying"
        else:
            self._submit_write(s, s.data)
        self._writes.append(s)
        self._inflight_write_bytes += s.nbytes

    def _submit_write(self, s: _Stored, src: torch.Tensor) -> None:
        s.write = self.store.write(s.region, src, s.offset)
        self._handles.append(s.write)
        s.state = "writing"

    def _complete(self, s: _Stored) -> None:
        """Block until ``s``'s write is on disk, then release its memory."""
        if s.state == "copying":
            s.copy_event.synchronize()
        self._reap()
        if s.state == "writing":
            self.store.wait(s.write)
        self._reap()

    def _reap(self) -> None:
        """Advance writes that finished a leg: copy done -> start the disk write; write done -> release."""
        for s in list(self._writes):
            if s.state == "copying":
                if not s.copy_event.query():
                    continue
                s.copy_event = None
                self._submit_write(s, s.host)
                if not s.pinned:
                    s.data = None  # the device memory is no longer needed
            if s.state == "writing":
                if not s.write.done():
                    continue
                self.store.wait(s.write)  # raises the write's error, if any, before its source is freed
                s.state = "stored"
                s.host = None
                if not s.pinned:
                    s.data = None
                self._writes.remove(s)
                self._inflight_write_bytes -= s.nbytes
                self.stats.bytes_written += s.nbytes
        self._h2d = [(buf, ev) for buf, ev in self._h2d if not ev.query()]

    # ---- unpack (backward) --------------------------------------------------------------------
    def _fill_prefetch(self) -> None:
        """Issue reads for the records backward needs next (reverse save order), within depth and budget."""
        while self._cursor >= 0 and len(self._reads) < self.prefetch_depth:
            s = self._order[self._cursor]
            if s.state in ("held", "kept", "released") or s.prefetch is not None:
                self._cursor -= 1
                continue
            if s.data is not None:  # its write is still running: keep it in memory instead of reading it back
                s.pinned = True
                self._cursor -= 1
                continue
            if self._reads and self._prefetch_bytes + s.nbytes > self.max_prefetch_bytes:
                return
            buf = self._read_buffer(s)
            handle = self.store.read(s.region, buf, s.offset)
            self._handles.append(handle)
            s.prefetch = (handle, buf)
            self._reads.append(s)
            self._prefetch_bytes += s.nbytes
            self._cursor -= 1

    def _read_buffer(self, s: _Stored) -> torch.Tensor:
        """Pinned memory for a CUDA tensor (torch's host allocator recycles it), else a pooled buffer."""
        if s.device.type == "cuda":
            buf = host_buffer(s.nbytes, pinned=True)
        else:
            buf = self._read_pool.get(s.nbytes)
        self.meter.track(buf.untyped_storage())
        return buf

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        s: _Stored = packed.stored
        with self._lock:
            if s.state == "released":
                raise RuntimeError(
                    f"NVMe activation offload: a saved activation of step {s.step} was unpacked after that step "
                    f"ended (its store space is reused by the next step). Graphs cannot be kept across training "
                    f"steps with NVMeActivationOffload; finish backward within the step.")
            self._reap()
            buf = self._take(s)
            self._cursor = min(self._cursor, s.index - 1)
            self._fill_prefetch()
            if buf.device != s.device:  # a CUDA tensor read back into pinned host memory
                host = buf
                buf, event = CudaStaging.to_device(host, s.device)
                self._h2d.append((host, event))
        out = torch.empty(0, dtype=packed.dtype, device=s.device)
        return out.set_(buf.untyped_storage(), packed.storage_offset, packed.size, packed.stride)

    def _take(self, s: _Stored) -> torch.Tensor:
        """The bytes of ``s``: from memory, from its prefetch, or (a miss) read now."""
        if s.data is not None:
            buf = s.data
            self.stats.memory_hits += 1
            s.pinned = False
            if s.state == "kept":  # written behind its first use, so a second unpack can still read it
                self._start_write(s)
            elif s.state == "stored":
                s.data = None
            return buf
        t0 = time.perf_counter()
        if s.prefetch is not None:
            handle, buf = s.prefetch
            s.prefetch = None
            self._reads.remove(s)
            self._prefetch_bytes -= s.nbytes
            self.stats.prefetch_hits += 1
        else:
            buf = self._read_buffer(s)
            handle = self.store.read(s.region, buf, s.offset)
            self._handles.append(handle)
            self.stats.misses += 1
        self.store.wait(handle)
        self.stats.read_wait_s += time.perf_counter() - t0
        self.stats.bytes_read += s.nbytes
        return buf
