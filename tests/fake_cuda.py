"""A fake CUDA for running the CUDA path's logic on CPU.

- ``FakeCudaRuntime``: host registration as CUDA does it: a range overlapping a live registration fails
  with ``cudaErrorHostMemoryAlreadyRegistered``, unregistering an unknown address with
  ``cudaErrorHostMemoryNotRegistered``; a failure stays CUDA's last error until ``cudaGetLastError`` reads
  it, and the next kernel launch (``launch``) raises it. It counts register/unregister pairs.
- ``install(monkeypatch)``: makes ``torch.cuda.is_available()`` true and routes both torch's
  ``cudart()`` bindings and ``lightning_nvme.store.pinned``'s runtime to one fake.
- ``fake_cuda_staging(monkeypatch)``: ``install`` plus every ``CudaStaging`` the parameter path makes built on a
  ``FakeOps`` and kept in the returned list, so a test can read their logs.
- ``fake_cuda_optimizer(monkeypatch)``: every ``OffloadedOptimizer`` made afterwards copies its state through a
  ``FakeOps`` (``optim.buffers.copy_ops_for``), so the device path of the update (copies to the device on the
  compute stream, back on a side stream, store writes after their event) runs on CPU; returns the list made.
- ``FakeOps``: streams and events recorded in a log (``CudaStaging``'s ``ops`` seam); an event completes
  only when synchronized, so nothing may rely on a copy having run. Device buffers are CPU tensors it
  sees (``record_stream``) and can count while alive. It also keeps what PyTorch's caching allocator
  knows of each device buffer (the stream it was made on, the streams it was ``record_stream``-ed on)
  and which stream each copy ran on: ``unprotected_uses`` lists the copies that read or wrote a device
  buffer on a stream the allocator does not wait for before handing its memory to the next allocation.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

SUCCESS = 0
ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation (e.g. RLIMIT_MEMLOCK)
ERROR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
ERROR_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered


class CudaError(RuntimeError):
    pass


class FakeCudaRuntime:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse  # every registration fails (a locked-memory limit)
        self.live: dict[int, int] = {}  # address -> bytes
        self.last_error = SUCCESS
        self.registers = 0
        self.unregisters = 0
        self.failures: list[int] = []
        self.flags: list[int] = []

    # the protocol of lightning_nvme.store.pinned.Runtime
    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        self.flags.append(flags)
        if any(ptr < p + n and p < ptr + nbytes for p, n in self.live.items()):
            return self._fail(ERROR_ALREADY_REGISTERED)
        if self.refuse:
            return self._fail(ERROR_MEMORY_ALLOCATION)
        self.live[ptr] = nbytes
        self.registers += 1
        return SUCCESS

    def unregister(self, ptr: int) -> int:
        if self.live.pop(ptr, None) is None:
            return self._fail(ERROR_NOT_REGISTERED)
        self.unregisters += 1
        return SUCCESS

    def get_last_error(self) -> int:
        err, self.last_error = self.last_error, SUCCESS
        return err

    def _fail(self, err: int) -> int:
        self.failures.append(err)
        self.last_error = err
        return err

    def launch(self) -> None:
        """A kernel launch: torch checks ``cudaGetLastError`` after it and raises what it finds."""
        err = self.get_last_error()
        if err != SUCCESS:
            raise CudaError(f"CUDA error {err} at an unrelated kernel launch")

    def binding(self) -> _Binding:
        return _Binding(self)


class _Binding:
    """What ``torch.cuda.cudart()`` returns, over the fake."""

    def __init__(self, rt: FakeCudaRuntime) -> None:
        self.rt = rt

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        return self.rt.register(ptr, nbytes, flags)

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return self.rt.unregister(ptr)


def install(monkeypatch, rt: FakeCudaRuntime | None = None) -> FakeCudaRuntime:
    rt = rt or FakeCudaRuntime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", rt.binding)
    try:
        from lightning_nvme.store import pinned
    except ImportError:  # before the registration owner existed
        return rt
    monkeypatch.setattr(pinned, "_runtime", rt)
    return rt


class FakeEvent:
    """A CUDA event that completes only when synchronized (so nothing may rely on it having run)."""

    def __init__(self, log: list, n: int) -> None:
        self.log, self.n, self.done = log, n, False

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.n, stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.log.append(("sync", self.n))
            self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.0  # ms


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.n))


def _is_of(t: torch.Tensor | None, buf: torch.Tensor) -> bool:
    """``t`` is ``buf`` or a view of it."""
    return t is not None and (t is buf or t._base is buf)


class FakeOps:
    """Records the CUDA calls of ``CudaStaging``; the copies themselves run on CPU tensors. ``delay_s``:
    sleep before each copy (as ``gpu_check``'s injected delay does on a real device)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.log: list = []
        self.events = 0
        self.compute = FakeStream(self.log, "compute")
        self.streams: list[FakeStream] = []
        self.device_buffers: list[torch.Tensor] = []
        self.delay_s = delay_s
        self._on: list[FakeStream] = []  # the streams entered with ``on`` (innermost last)
        self.copies: list[tuple[str, weakref.ref, weakref.ref]] = []  # (stream, dst, src) of every copy
        self.recorded: dict[int, set[str]] = {}  # id of a device buffer -> streams it was record_stream-ed on

    def stream(self, device: torch.device) -> FakeStream:
        self.streams.append(FakeStream(self.log, f"side{len(self.streams)}"))  # in the order made
        return self.streams[-1]

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.compute

    @contextmanager
    def on(self, stream: FakeStream) -> Iterator[FakeStream]:
        self._on.append(stream)
        try:
            yield stream
        finally:
            self._on.pop()

    def current(self) -> FakeStream:
        """The stream work is queued on now (``on``'s, else the compute stream)."""
        return self._on[-1] if self._on else self.compute

    def event(self, timing: bool = False) -> FakeEvent:
        self.events += 1
        return FakeEvent(self.log, self.events)

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        """``CudaStaging`` records each device copy on the compute stream: that is where it is seen."""
        self.log.append(("record_stream", stream.name))
        t = t if t._base is None else t._base  # a view records its whole allocation, as the allocator does
        if not any(t is d for d in self.device_buffers):
            self.device_buffers.append(t)
        self.recorded.setdefault(id(t), set()).add(stream.name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        self.copies.append((self.current().name, weakref.ref(dst), weakref.ref(src)))
        dst.copy_(src, non_blocking=True)

    def unprotected_uses(self) -> list[tuple[int, str]]:
        """(device buffer index, stream) of each copy that used a device buffer on a stream its memory is not
        protected on. The caching allocator protects a buffer on the stream it was allocated on (the stream of
        its first copy: ``CudaStaging.upload`` allocates and fills it on the upload stream) and on every stream
        it was ``record_stream``-ed on; once the last reference goes, the memory may be handed to the next
        allocation as soon as *those* streams reach that point, while a copy queued on another stream may
        still be reading or writing it."""
        found = []
        for i, buf in enumerate(self.device_buffers):
            uses = [s for s, *ends in self.copies for end in ends if _is_of(end(), buf)]
            known = set(uses[:1]) | self.recorded.get(id(buf), set())
            found += [(i, s) for s in uses if s not in known]
        return found

    def live_device_buffers(self) -> int:
        """Device buffers something besides this list still references (autograd's saved tensors count). A
        storage's use count is 2 for a tensor of this list alone (its own and the ``untyped_storage()`` asked)."""
        return sum(torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2 for t in self.device_buffers)


def fake_cuda_staging(monkeypatch) -> tuple[FakeCudaRuntime, list]:
    """``install`` the fake runtime and route ``staging_for`` to ``CudaStaging`` on a ``FakeOps``: the
    parameter path runs its CUDA logic on CPU. Returns the runtime and the list of stagings made."""
    from lightning_nvme.params import staging

    rt = install(monkeypatch)
    made: list[staging.CudaStaging] = []

    def fake(device, buffer_bytes, pool_size):
        made.append(staging.CudaStaging(device, buffer_bytes, pool_size, ops=FakeOps()))
        return made[-1]

    monkeypatch.setattr(staging, "staging_for", fake)
    return rt, made


def fake_cuda_optimizer(monkeypatch, delay_s: float = 0.0) -> list[FakeOps]:
    """Route ``optim.buffers.copy_ops_for`` to a ``FakeOps`` (``delay_s`` before each copy) for every offloaded
    optimizer made afterwards: its update runs the device path (state copied to the "device" and back through
    the ops) on CPU tensors. Returns the list of ops made, one per optimizer. ``raising=False``: on code without
    the seam, nothing is routed and a test sees no copy at all."""
    from lightning_nvme.optim import buffers

    made: list[FakeOps] = []

    def fake(params):
        made.append(FakeOps(delay_s=delay_s))
        return made[-1]

    monkeypatch.setattr(buffers, "copy_ops_for", fake, raising=False)
    return made
