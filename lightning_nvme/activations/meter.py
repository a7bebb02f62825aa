"""Exact accounting of the bytes that saved activations keep resident in memory.

Why storages and finalizers: a saved tensor costs memory through its storage, which several saved
views may share and which lives until its last user (the graph, the offloader, a read buffer handed
to backward) lets go. The meter counts each storage once, from the moment it is first seen until the
storage is actually freed (a ``weakref.finalize`` on the storage object), so "resident" means the
memory really is held, not merely that a reference was dropped somewhere.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks


class ResidencyMeter:
    """Bytes of tracked storages alive now, and the peak since ``reset_peak``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a finalizer may run (gc) while the lock is held
        self._tracked: dict[int, int] = {}  # id(storage) -> nbytes, for storages alive now
        self.current_bytes = 0
        self.peak_bytes = 0

    def track(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` until it is freed (a no-op if it is already counted)."""
        key = id(storage)
        with self._lock:
            if key in self._tracked:
                return
            nbytes = storage.nbytes()
            self._tracked[key] = nbytes
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._release, key)

    def add(self, nbytes: int) -> None:
        """Count memory that is not a storage (idle pooled buffers); negative to uncount."""
        with self._lock:
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _release(self, key: int) -> None:
        with self._lock:
            self.current_bytes -= self._tracked.pop(key, 0)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.current_bytes


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Data pointers of the storages of ``tensors`` (parameters and buffers: alive, so addresses are unique)."""
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}


class SavedActivationMeter:
    """Pass-through saved-tensor hooks that only measure: the baseline "everything stays in memory".

    Counts what :class:`~lightning_nvme.activations.ActivationOffloader` counts (every saved storage that
    is not a parameter or buffer), so the two peaks compare like for like.
    """

    def __init__(self, meter: ResidencyMeter | None = None) -> None:
        self.meter = meter or ResidencyMeter()
        self._exclude: set[int] = set()
        self._hooks: saved_tensors_hooks | None = None

    def begin(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = storage_ptrs(exclude)
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def end(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._exclude and storage.nbytes():
            self.meter.track(storage)
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t
