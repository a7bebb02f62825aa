"""Host memory registered with CUDA ("pinned") for exactly as long as it lives.

Why an owner that unregisters: memory freed while registered is undefined behaviour, its pages stay
pinned, and a later buffer at the same address fails to register (``cudaErrorHostMemoryAlreadyRegistered``).
The registration belongs to the mapping itself (``_RegisteredMap``): it is undone before the pages are
unmapped, whoever dropped the last reference. Why check and clear: torch's ``cudart()`` binding returns
``cudaHostRegister``'s error but leaves it as CUDA's last error, so the next kernel launch would raise it
as its own ("part or all of the requested memory range is already mapped"). Why ``Portable``: flag 0
registers the pages for the calling thread's context only.

Only code that copies between a buffer and a device asks for pinned memory (``pinned_empty``): a
CPU-only run never registers anything, so it never creates a CUDA context.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import warnings
import weakref
from typing import Protocol

import torch

from lightning_nvme.store.layout import align_up

SUCCESS = 0
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class Runtime(Protocol):
    """The three CUDA runtime calls registration makes (tests substitute a fake that behaves like CUDA)."""

    def register(self, ptr: int, nbytes: int, flags: int) -> int: ...

    def unregister(self, ptr: int) -> int: ...

    def get_last_error(self) -> int: ...


class CudaRuntime:
    """The process's CUDA runtime: torch's bindings, plus ``cudaGetLastError`` from the libcudart torch loaded
    (torch binds no way to clear the last error)."""

    def __init__(self) -> None:
        self._lib: ctypes.CDLL | None = None
        self._device: dict[int, int] = {}  # address -> the device current when it was registered

    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags))
        if err == SUCCESS:
            self._device[ptr] = torch.cuda.current_device()
        return err

    def unregister(self, ptr: int) -> int:
        """Under the device that registered it. Why: the last reference may go on any thread (an I/O worker,
        the garbage collector's), and a thread that never set a device makes device 0 current: on a rank
        bound to another GPU that creates a context (hundreds of MiB) on a device it does not own."""
        with torch.cuda.device(self._device.pop(ptr, torch.cuda.current_device())):
            return int(torch.cuda.cudart().cudaHostUnregister(ptr))

    def get_last_error(self) -> int:
        if self._lib is None:
            self._lib = _loaded_cudart()
        if self._lib is None:
            warnings.warn("no libcudart loaded in this process to clear CUDA's last error with; the next kernel "
                          "launch may report the refused host registration", RuntimeWarning, stacklevel=3)
            return SUCCESS
        return int(self._lib.cudaGetLastError())


def _loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart already in the process (``RTLD_NOLOAD``: never a second copy with its own error state)."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "/libcudart" in line})
    for name in paths + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
    return None


_runtime: Runtime | None = None
_live: dict[int, int] = {}  # address -> bytes of every registration not yet undone
_lock = threading.Lock()
_owners: weakref.WeakValueDictionary[int, _RegisteredMap] = weakref.WeakValueDictionary()  # address -> mapping


def runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        _runtime = CudaRuntime()
    return _runtime


def live_registrations() -> int:
    """Host ranges registered by this module and not yet unregistered (0 after a clean shutdown)."""
    with _lock:
        return len(_live)


class _RegisteredMap(mmap.mmap):
    """Anonymous page-aligned memory, registered with CUDA until it is released or freed."""

    ptr = 0
    registered = False
    rt: Runtime | None = None  # the runtime that registered it (unregisters it too)

    def register(self) -> int:
        """Register the whole mapping; on failure clear CUDA's last error and return the error code."""
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self))
        rt = runtime()
        err = rt.register(self.ptr, len(self), HOST_REGISTER_PORTABLE)
        if err != SUCCESS:
            rt.get_last_error()  # the failure must not surface at the next, unrelated kernel launch
            return err
        with _lock:
            _live[self.ptr] = len(self)
            _owners[self.ptr] = self
        self.registered, self.rt = True, rt
        return SUCCESS

    def unregister(self) -> None:
        if not self.registered:
            return
        self.registered = False
        with _lock:
            _live.pop(self.ptr, None)
        rt = self.rt or runtime()
        err = rt.unregister(self.ptr)
        if err != SUCCESS:
            rt.get_last_error()
            warnings.warn(f"cudaHostUnregister({self.ptr:#x}) failed with CUDA error {err}", RuntimeWarning,
                          stacklevel=2)

    def __del__(self) -> None:  # runs before the base type unmaps the pages
        self.unregister()


def pinned_empty(nbytes: int) -> torch.Tensor | None:
    """A page-aligned uint8 tensor of ``nbytes`` (padded to 4 KiB) registered with CUDA, or ``None`` when
    registration is refused (e.g. a locked-memory limit; CUDA's last error is cleared): use pageable memory."""
    buf = _RegisteredMap(-1, align_up(max(nbytes, 1)))
    if buf.register() != SUCCESS:
        return None
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]  # the tensor keeps the mapping alive


def unpin(t: torch.Tensor) -> None:
    """Unregister ``t``'s mapping now (before its memory is freed: at the latest when it is). No-op for
    memory that is not from ``pinned_empty``."""
    owner = _owners.get(t.untyped_storage().data_ptr())
    if owner is not None:
        owner.unregister()

