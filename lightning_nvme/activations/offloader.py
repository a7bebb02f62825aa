"""``ActivationOffloader``: the tensors a training step's forward saves for backward go to the flat
store, and come back in backward read ahead of need.

Why this shape (prior art: torch ``save_on_cpu``, torchtune ``OffloadActivations``, SSDTrain):
- Only what is worth it leaves memory: by default the inputs of ``torch.utils.checkpoint`` regions
  (what checkpointing keeps through the whole step), at least ``min_bytes``, never a parameter or
  buffer (recognised by storage, so ``weight.t()`` counts as the weight).
- The unit moved is a *storage*, keyed by a record object, never by address (``records``).
- The last ``keep_last`` storages saved are the first backward needs: they stay in memory (and are
  written behind, after their first use, so ``retain_graph=True`` can read them again).
- A write's tensor is released only after the write completed (``writer``); reads are issued
  ``prefetch_depth`` records ahead in reverse save order, within a byte budget (``prefetcher``).
- All of it is undone at ``end_step`` (or ``abort`` after an exception): no I/O left pending, no
  buffer held, no hook left installed (``hooks``).

Lifecycle: ``begin`` (hooks on) -> forward -> ``end_forward`` (hooks off, prefetch starts) ->
backward -> ``end_step``. Independent of Lightning; the callback calls these from its hooks. This module
decides *what* is offloaded and when each piece acts; one lock covers the pieces, since unpack runs on
autograd's device threads for CUDA.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from lightning_nvme.activations.arena import ActivationArena
from lightning_nvme.activations.boundary import DETECTION_AVAILABLE, saved_at_checkpoint_boundary
from lightning_nvme.activations.hooks import HookStack
from lightning_nvme.activations.meter import ResidencyMeter, storage_ptrs
from lightning_nvme.activations.prefetcher import Prefetcher
from lightning_nvme.activations.records import OffloadStats, Packed, Record, busy_seconds
from lightning_nvme.activations.settings import ActivationSettings
from lightning_nvme.activations.writer import WriteBehind
from lightning_nvme.store import FlatStore, IOHandle

log = logging.getLogger(__name__)

class ActivationOffloader:
    """Saved-tensor hooks that move a step's activations through ``store``.

    Args:
        store: the flat store; the offloader adds its own regions (``region_prefix.N``) to it.
        config: what is offloaded and the budgets (``ActivationSettings``; its defaults if not given).
        grow_fraction: with ``config.min_segment_bytes``, how the activation area grows (``ActivationArena``).
        meter: counts resident saved-activation bytes (a fresh one if not given).
    """

    def __init__(self, store: FlatStore, config: ActivationSettings | None = None, *,
                 region_prefix: str = "activations", grow_fraction: float = 0.5,
                 meter: ResidencyMeter | None = None) -> None:
        self.config = config = config or ActivationSettings()
        self.store = store
        self.arena = ActivationArena(store, region_prefix, min_segment_bytes=config.min_segment_bytes,
                                     grow_fraction=grow_fraction)
        self.meter = meter or ResidencyMeter()
        self.stats = OffloadStats()  # the step in progress
        self.last_step_stats = OffloadStats()
        self.total_stats = OffloadStats()
        self._lock = threading.RLock()  # unpack runs on autograd's device threads for CUDA
        self._handles: list[IOHandle] = []  # every request of the step, in issue order
        self._writer = WriteBehind(store, self.arena, config.write_inflight_bytes, self._handles)
        self._reader = Prefetcher(store, self.meter, config.prefetch_depth, config.prefetch_bytes, self._handles)
        self._hooks = HookStack(self._pack, self._unpack)
        self._phase = "idle"  # idle | forward | backward
        self._step = 0
        self._exclude: set[int] = set()
        self._warned_no_boundary = False
        self._reset_step_state()

    def _reset_step_state(self) -> None:
        self._order: list[Record] = []
        self._by_storage: dict[int, Record] = {}
        self._window: deque[Record] = deque()
        self._handles.clear()
        self._writer.reset()
        self._reader.reset()

    def _reap(self) -> None:
        self._writer.reap(self.stats)
        self._reader.reap()

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._hooks.installed

    @property
    def phase(self) -> str:
        return self._phase

    def begin(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        """Install the hooks for a step's forward. ``exclude``: parameters and buffers (never offloaded)."""
        if self._phase != "idle":
            self.end_step()
        self._hooks.pop_orphan()
        self._step += 1
        self._exclude = storage_ptrs(exclude)
        self.arena.reset()
        self.stats = OffloadStats()
        self._hooks.push()
        self._phase = "forward"

    def end_forward(self) -> None:
        """Forward is over: remove the hooks (recomputation in backward is never offloaded again) and
        start reading ahead."""
        if self._phase != "forward":
            return
        self._hooks.pop()
        with self._lock:
            for s in self._window:
                s.state = "kept"
            self._window.clear()
            self._phase = "backward"
            self._reader.start(self._order)
            self._reap()
            self._reader.fill()
        if (self.config.scope == "checkpoint" and not self._order and self.stats.saved_tensors
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
        self._hooks.pop_orphan()
        if self._phase == "idle":
            return
        first_error: BaseException | None = None
        try:
            self._hooks.pop_after(exc, strict=raise_errors)
        except BaseException as e:  # noqa: BLE001
            first_error = e
        with self._lock:
            # CUDA copies first (a finished copy may still start its disk write in the reap below), then
            # every disk request of the step.
            self._writer.sync_copies()
            self._reader.sync_copies()
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
                s.release()
            self._reader.clear()
            self.stats.io_busy_s = busy_seconds(self._handles)
            self.last_step_stats = self.stats
            self.total_stats.add(self.stats)
            self._reset_step_state()
            self._phase = "idle"
        if first_error is not None:
            if raise_errors:
                raise first_error
            log.warning("NVMe activation offload: I/O error while cleaning up after an exception: %r", first_error)

    # ---- pack (forward) -----------------------------------------------------------------------
    def _offloadable(self, t: torch.Tensor) -> bool:
        if self._phase != "forward" or torch._C._current_graph_task_id() != -1:
            return False  # backward (e.g. a reentrant checkpoint recomputing) is never offloaded again
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            return False
        if t.device.type not in ("cpu", "cuda") or (t.requires_grad and t.grad_fn is None):
            return False  # leaves (parameters, user inputs) are held by their owner anyway
        storage = t.untyped_storage()
        if storage.nbytes() < max(self.config.min_bytes, 1) or storage.data_ptr() in self._exclude:
            return False
        return self.config.scope == "all" or saved_at_checkpoint_boundary()

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
            record = self._by_storage.get(id(storage))
            if record is None or record.version != t._version or record.state == "released":
                record = self._record(storage, t._version)
            self.stats.offloaded_tensors += 1
            return Packed(record, t)

    def _record(self, storage: torch.UntypedStorage, version: int) -> Record:
        with torch.no_grad():
            data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        record = Record(len(self._order), data, self._step, version)
        key = id(storage)
        self._order.append(record)
        self._by_storage[key] = record
        weakref.finalize(storage, self._forget, key, weakref.ref(record))
        self.meter.track(storage)
        self.stats.storages += 1
        self._window.append(record)
        while len(self._window) > self.config.keep_last:
            self._writer.start(self._window.popleft(), self.stats)
        self._reap()
        return record

    def _forget(self, key: int, ref: weakref.ref[Record]) -> None:
        """The storage died: its id may be reused by a new storage, which must not match this record.

        Lock-free on purpose: this runs on whichever thread drops the storage last, e.g. an I/O worker
        finishing a write while the main thread holds the lock and waits for that very write. No new
        object can take ``key`` while the dying one is being finalized, so the check cannot race."""
        if self._by_storage.get(key) is ref():
            self._by_storage.pop(key, None)

    # ---- unpack (backward) --------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        s: Record = packed.record
        with self._lock:
            if s.state == "released":
                raise RuntimeError(
                    f"NVMe activation offload: a saved activation of step {s.step} was unpacked after that step "
                    f"ended (its store space is reused by the next step). Graphs cannot be kept across training "
                    f"steps with NVMeActivationOffload; finish backward within the step.")
            self._reap()
            buf = self._take(s)
            self._reader.unpacked(s)
            if buf.device != s.device:  # a CUDA tensor read back into pinned host memory
                buf = self._reader.to_device(buf, s.device)
        return packed.rebuild(buf)

    def _take(self, s: Record) -> torch.Tensor:
        """The bytes of ``s``: from memory, from its prefetch, or (a miss) read now."""
        if s.data is not None:
            buf = s.data
            self.stats.memory_hits += 1
            s.pinned = False
            if s.state == "kept":  # written behind its first use, so a second unpack can still read it
                self._writer.start(s, self.stats)
            elif s.state == "stored":
                s.data = None
            return buf
        t0 = time.perf_counter()
        handle, buf, prefetched = self._reader.claim(s)
        if prefetched:
            self.stats.prefetch_hits += 1
        else:
            self.stats.misses += 1
        self.store.wait(handle)
        self.stats.read_wait_s += time.perf_counter() - t0
        self.stats.bytes_read += s.nbytes
        return buf
