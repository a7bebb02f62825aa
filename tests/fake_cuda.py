"""A fake CUDA for running the CUDA path's logic on CPU.

- ``FakeCudaRuntime``: host registration as CUDA does it: a range overlapping a live registration fails
  with ``cudaErrorHostMemoryAlreadyRegistered``, unregistering an unknown address with
  ``cudaErrorHostMemoryNotRegistered``; a failure stays CUDA's last error until ``cudaGetLastError`` reads
  it, and the next kernel launch (``launch``) raises it. It counts register/unregister pairs.
- ``install(monkeypatch)``: makes ``torch.cuda.is_available()`` true and routes both torch's
  ``cudart()`` bindings and ``lightning_nvme.store.pinned``'s runtime to one fake.
- ``fake_cuda_transfer(monkeypatch)``: ``install`` plus every ``CudaTransfer`` the parameter path makes built on a
  ``FakeOps`` and kept in the returned list, so a test can read their logs.
- ``fake_cuda_optimizer(monkeypatch)``: every ``OffloadedOptimizer`` made afterwards copies its state through a
  ``FakeOps`` (``optim.buffers.copy_ops_for``), so the device path of the update (copies to the device on the
  compute stream, back on a side stream, store writes after their event) runs on CPU; returns the list made.
- ``FakeOps``: streams and events recorded in a log (``CudaTransfer``'s ``ops`` seam); an event completes
  only when synchronized, so nothing may rely on a copy having run. Device buffers are CPU tensors it
  sees (``record_stream``) and can count while alive. It also keeps what PyTorch's caching allocator
  knows of each device buffer (the stream it was made on, the streams it was ``record_stream``-ed on)
  and which stream each copy ran on: ``unprotected_uses`` lists the copies that read or wrote a device
  buffer on a stream the allocator does not wait for before handing its memory to the next allocation.
- ``FakeDevice`` (``fake_device()``): a device whose tensors (``DeviceTensor``) report a non-CPU device and keep
  their data in a CPU tensor inside, so code that branches on ``t.device.type != "cpu"`` runs its device path,
  autograd included; it records every *synchronous* device -> host transfer (``syncs``): ``.cpu()`` /
  ``.to("cpu")`` without ``non_blocking``, ``copy_`` between the device and the host without ``non_blocking``
  (either way: a copy from pageable host memory blocks the host too), ``.item()`` / ``.tolist()``. On a GPU
  each of those stops the host until the device has run everything queued before it.
"""

from __future__ import annotations

import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

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


def _allocation(t: torch.Tensor) -> torch.Tensor:
    """The tensor owning ``t``'s memory (``t`` itself, or the base it is a view of)."""
    return t if t._base is None else t._base


def _is_of(t: torch.Tensor | None, buf: torch.Tensor) -> bool:
    """``t`` is ``buf`` or a view of it."""
    return t is not None and (t is buf or t._base is buf)


class FakeOps:
    """Records the CUDA calls of ``CudaTransfer``; the copies themselves run on CPU tensors. ``delay_s``:
    sleep before each copy (as ``gpu_check``'s injected delay does on a real device)."""

    def __init__(self, delay_s: float = 0.0, runtime: FakeCudaRuntime | None = None) -> None:
        self.log: list = []
        self.runtime = runtime
        self.host_ends: list[tuple[str, bool]] = []  # (stream, host end pinned) of every copy, given ``runtime``
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
        """``CudaTransfer`` records each device copy on the compute stream: that is where it is seen."""
        self.log.append(("record_stream", stream.name))
        t = t if t._base is None else t._base  # a view records its whole allocation, as the allocator does
        if not any(t is d for d in self.device_buffers):
            self.device_buffers.append(t)
        self.recorded.setdefault(id(t), set()).add(stream.name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        # the allocations, not the views: a view made for the call (``device[lo:]``) is gone right after it
        self.copies.append((self.current().name, weakref.ref(_allocation(dst)), weakref.ref(_allocation(src))))
        if self.runtime is not None:
            self.host_ends.append((self.current().name, any(self._pinned(t) for t in (dst, src))))
        dst.copy_(src, non_blocking=True)

    def _pinned(self, t: torch.Tensor) -> bool:
        """``t`` lies in a live registration (device buffers never do: a copy with neither end pinned is a
        copy from or into pageable host memory)."""
        assert self.runtime is not None
        ptr = t.data_ptr()
        return any(p <= ptr and ptr + t.numel() * t.element_size() <= p + n for p, n in self.runtime.live.items())

    def pageable_copies(self, stream: str | None = None) -> list[int]:
        """Indexes of the copies (on ``stream``, or any) whose host end was pageable memory when they ran."""
        return [i for i, (s, pinned) in enumerate(self.host_ends) if not pinned and stream in (None, s)]

    def unprotected_uses(self) -> list[tuple[int, str]]:
        """(device buffer index, stream) of each copy that used a device buffer on a stream its memory is not
        protected on. The caching allocator protects a buffer on the stream it was allocated on (the stream of
        its first copy: ``CudaTransfer.upload`` allocates and fills it on the upload stream) and on every stream
        it was ``record_stream``-ed on; once the last reference goes, the memory may be handed to the next
        allocation as soon as *those* streams reach that point, while a copy queued on another stream may
        still be reading or writing it."""
        found = []
        for i, buf in enumerate(self.device_buffers):
            uses = self.streams_using(i)
            known = set(uses[:1]) | self.recorded.get(id(buf), set())
            found += [(i, s) for s in uses if s not in known]
        return found

    def streams_using(self, i: int) -> list[str]:
        """The stream of each copy that read or wrote device buffer ``i`` (or a view of it), in order."""
        buf = self.device_buffers[i]
        return [s for s, *ends in self.copies for end in ends if _is_of(end(), buf)]

    def live_device_buffers(self) -> int:
        """Device buffers something besides this list still references (autograd's saved tensors count). A
        storage's use count is 2 for a tensor of this list alone (its own and the ``untyped_storage()`` asked)."""
        return sum(torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2 for t in self.device_buffers)


def fake_cuda_transfer(monkeypatch) -> tuple[FakeCudaRuntime, list]:
    """``install`` the fake runtime and route ``transfer_for`` to ``CudaTransfer`` on a ``FakeOps``: the
    parameter path runs its CUDA logic on CPU. Returns the runtime and the list of transfers made."""
    from lightning_nvme.params import transfer

    rt = install(monkeypatch)
    made: list[transfer.CudaTransfer] = []

    def fake(device, buffer_bytes, pool_size):
        made.append(transfer.CudaTransfer(device, buffer_bytes, pool_size, ops=FakeOps(runtime=rt)))
        return made[-1]

    monkeypatch.setattr(transfer, "transfer_for", fake)
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


# ---- a fake device whose synchronous copies are recorded ------------------------------------------------------
# The device type the fake device's tensors report. "meta" is the one non-CPU device type a CPU build of torch has a
# device guard for, so autograd runs on it; the data itself lives in a CPU tensor inside each ``DeviceTensor``.
FAKE_DEVICE = torch.device("meta")
aten = torch.ops.aten


class DeviceTensor(torch.Tensor):
    """A tensor on the fake device: its metadata says ``FAKE_DEVICE``, its values are ``inner`` (a CPU tensor)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> DeviceTensor:
        r = torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),  # type: ignore[attr-defined]
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                device=FAKE_DEVICE, requires_grad=inner.requires_grad)
        r.inner = inner
        return r

    def __repr__(self) -> str:  # type: ignore[override]
        return f"DeviceTensor({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # outside ``FakeDevice`` (e.g. a test's check)
        return _dispatch(None, func, args, kwargs or {})


def _unwrap(t: Any) -> Any:
    return t.inner if isinstance(t, DeviceTensor) else t


def _is_fake(device: Any) -> bool:
    return device is not None and torch.device(device).type == FAKE_DEVICE.type


def _dispatch(rec: FakeDevice | None, func, args, kwargs) -> Any:
    flat, _ = tree_flatten((args, kwargs))
    on_device = any(isinstance(t, DeviceTensor) for t in flat)
    target = kwargs.get("device")
    kwargs = {**kwargs, "device": torch.device("cpu")} if _is_fake(target) else kwargs
    if rec is not None:
        rec.classify(func, args, kwargs, on_device, target)
    originals = {id(_unwrap(t)): t for t in flat if isinstance(t, torch.Tensor)}
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    wrap = _is_fake(target) or (on_device and target is None)

    def back(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) in originals:  # in place / out=: the argument itself
            return originals[id(t)]
        return DeviceTensor(t) if wrap else t

    return tree_map(back, out)


class FakeDevice(TorchDispatchMode):
    """While entered, tensors made with ``device=FAKE_DEVICE`` (or moved there) are ``DeviceTensor``s, and every
    synchronous transfer between them and the host is appended to ``syncs`` as ``(kind, where)``: ``kind`` one of
    ``"to_host"`` (``.cpu()``, ``.to("cpu")``), ``"copy_to_host"`` / ``"copy_to_device"`` (``copy_`` without
    ``non_blocking``), ``"item"`` (``.item()``, ``.tolist()``, ``bool()``); ``where`` the innermost frames of
    ``lightning_nvme`` that made it. ``recording``: set to False to ignore what a test itself does."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[tuple[str, str]] = []
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(self, func, args, kwargs or {})

    def classify(self, func, args, kwargs, on_device: bool, target: Any) -> None:
        if not self.recording:
            return
        if func is aten._to_copy.default and isinstance(args[0], DeviceTensor) and target is not None \
                and torch.device(target).type == "cpu" and not kwargs.get("non_blocking", False):
            self._record("to_host")
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if blocking and isinstance(src, DeviceTensor) and not isinstance(dst, DeviceTensor):
                self._record("copy_to_host")
            elif blocking and isinstance(dst, DeviceTensor) and isinstance(src, torch.Tensor) \
                    and not isinstance(src, DeviceTensor) and src.dim() > 0:  # a 0-dim CPU tensor is a scalar
                self._record("copy_to_device")
        elif func is aten._local_scalar_dense.default and on_device:
            self._record("item")

    def _record(self, kind: str) -> None:
        frames = [f for f in traceback.extract_stack() if "lightning_nvme" in f.filename and "tests" not in f.filename]
        where = " < ".join(f"{f.filename.rsplit('lightning_nvme/', 1)[-1]}:{f.lineno}" for f in reversed(frames[-3:]))
        self.syncs.append((kind, where))


@contextmanager
def fake_device() -> Iterator[FakeDevice]:
    """A ``FakeDevice`` entered for the block."""
    mode = FakeDevice()
    with mode:
        yield mode


def to_fake_device(module: torch.nn.Module) -> torch.nn.Module:
    """``module``'s parameters moved to the fake device (as ``module.to("cuda")`` would), in place."""
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            setattr(m, name, torch.nn.Parameter(DeviceTensor(p.detach().clone()), requires_grad=p.requires_grad))
    return module


def on_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``t``'s values (a test's own check: not recorded)."""
    return t.inner.clone() if isinstance(t, DeviceTensor) else t.detach().clone()
