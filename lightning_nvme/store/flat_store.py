"""``FlatStore``: one preallocated file per rank (or one per directory, striped) holding named, 4 KiB-aligned regions.

Requests are asynchronous (``write``/``read`` return an ``IOHandle``), split into chunks served by a
small worker pool, and ordered by the store itself: a read always sees the last write issued before
it to the same bytes. ``fence`` waits for pending requests; ``fence(durable=True)`` also fdatasyncs,
which is what a checkpoint must do before it commits.

I/O mode: ``O_DIRECT`` where the filesystem accepts it, so offloaded data does not silently sit in
the page cache (which would spend the very RAM the offload meant to save). Otherwise buffered I/O
with ``posix_fadvise(DONTNEED)`` after each chunk. ``store.mode`` says which is active.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from lightning_nvme.constants import MiB
from lightning_nvme.store.aligned import aligned_empty
from lightning_nvme.store.digest import region_digests
from lightning_nvme.store.dispatch import IODispatch
from lightning_nvme.store.errors import StoreError, StoreIOError, StoreTimeoutError
from lightning_nvme.store.handle import IOHandle
from lightning_nvme.store.layout import ALIGN, Region
from lightning_nvme.store.lock import StoreLock
from lightning_nvme.store.opening import open_files
from lightning_nvme.store.regions import RegionTable
from lightning_nvme.store.shelf import Shelf
from lightning_nvme.store.stats import IOStats
from lightning_nvme.store.stripes import STRIPE_BYTES

log = logging.getLogger(__name__)

# Defaults of the strategies' arguments of the same names (lightning_nvme.settings reads them from here).
IO_CHUNK_BYTES = 8 * MiB
IO_WORKERS = 4
STAGING_BYTES = 64 * MiB


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, including bool and bf16)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class FlatStore:
    """A flat file of named regions with asynchronous, fenced, chunked I/O.

    Args:
        directory: where the store file lives (created if missing). Use a local SSD. A list of directories
            (one per disk) stripes the store over one file in each (``store/stripes.py``): the first holds
            the manifest; each file has its own I/O workers, lock and header.
        rank: the store file is ``store-rank{rank}.bin``; one store per process.
        io_chunk_bytes: requests are split into chunks of this size (multiple of 4 KiB, >= 1 MiB advised).
        io_workers: I/O threads per file; a few give each disk its queue depth.
        staging_bytes: the staging pool (used only when a tensor is not page-aligned); bounded.
        direct: force O_DIRECT on (True) or off (False); ``None`` probes the filesystem.
        reopen: open an existing store and check it against its manifest instead of creating one. The
            layout (like the data) is persisted by ``fence(durable=True)`` and ``close()``.
        io_timeout_s: no wait is unbounded; a stuck request raises with what was pending.
        min_free_bytes: safety margin kept free on the disk when the store grows.
        stripe_bytes: with several directories, bytes of one stripe unit (multiple of 4 KiB); a reopened
            store keeps the unit it was created with.
    """

    def __init__(self, directory: str | os.PathLike | Sequence[str | os.PathLike], rank: int = 0, *,
                 io_chunk_bytes: int = IO_CHUNK_BYTES, io_workers: int = IO_WORKERS,
                 staging_bytes: int = STAGING_BYTES, direct: bool | None = None, reopen: bool = False,
                 io_timeout_s: float = 600.0, min_free_bytes: int = 0, name: str | None = None,
                 stripe_bytes: int = STRIPE_BYTES) -> None:
        if io_chunk_bytes <= 0 or io_chunk_bytes % ALIGN:
            raise ValueError(f"io_chunk_bytes must be a positive multiple of {ALIGN}, got {io_chunk_bytes}")
        if staging_bytes < io_chunk_bytes:
            raise ValueError(f"staging_bytes ({staging_bytes}) must hold at least one chunk ({io_chunk_bytes})")
        dirs = [directory] if isinstance(directory, (str, os.PathLike)) else list(directory)
        self.directories = [os.path.abspath(os.fspath(d)) for d in dirs]
        if not self.directories or len(set(self.directories)) != len(self.directories):
            raise ValueError(f"a store needs one or more distinct directories, got {self.directories}")
        self.directory = self.directories[0]
        for d in self.directories:
            os.makedirs(d, exist_ok=True)
        base = name or f"store-rank{rank}"
        self.paths = [os.path.join(d, base + ".bin") for d in self.directories]
        self.path = self.paths[0]
        self._closing = False  # set by close(): no new requests while it drains
        self._closed = False
        self.shelf = Shelf()  # regions kept in memory (host_memory_budget); see shelve()
        # Called with a region's name before any write to it and before it is shelved (after which it changes in
        # place): a background checkpoint copies the region's saved bytes out first (checkpoint/copy/background.py).
        self.write_barrier: Callable[[str], None] | None = None
        opened = open_files(self.directories, base, reopen=reopen, direct=direct, stripe_bytes=stripe_bytes)
        self._locks, self._files = opened.locks, opened.files
        self.stripe_map, self.manifest_path = opened.stripe_map, opened.manifest_path
        try:
            self._regions = RegionTable(self._files, self.stripe_map, self.manifest_path, opened.stripes,
                                        opened.recorded, min_free_bytes)
            self.layout = self._regions.layout  # the regions, for lookups; changed only through add_regions
            # chunk jobs on one worker pool per file, ordered, counted (store/dispatch.py)
            self.dispatch = IODispatch(self.path, self._files, self.stripe_map, io_chunk_bytes=io_chunk_bytes,
                                       io_workers=io_workers, staging_bytes=staging_bytes, io_timeout_s=io_timeout_s)
        except BaseException:
            opened.release()
            raise
        log.info("FlatStore %s: mode=%s chunk=%d KiB workers=%d x %d file(s) pool=%d MiB", self.path, self.mode,
                 io_chunk_bytes // 1024, io_workers, len(self._files), self.staging_bytes // MiB)

    # ---- files (store/file_io.py) ------------------------------------------------------------------
    @property
    def fd(self) -> int:
        return self._files[0].fd

    @property
    def direct(self) -> bool:
        return all(f.direct for f in self._files)

    @property
    def mode(self) -> str:
        if self.direct:
            return "direct"
        return "buffered" if not any(f.direct for f in self._files) else "mixed"

    @property
    def _lock(self) -> StoreLock:
        return self._locks[0]

    @property
    def io_chunk_bytes(self) -> int:
        return self.dispatch.io_chunk_bytes

    @property
    def io_timeout_s(self) -> float:
        return self.dispatch.io_timeout_s

    # ---- regions (store/regions.py) ----------------------------------------------------------------
    def add_regions(self, specs: list[tuple[str, int]]) -> list[Region]:
        """Append regions ``(name, nbytes)`` to the layout and allocate their blocks in one go; all or nothing.
        The manifest is written at once and made durable by the next ``fence(durable=True)`` or ``close()``."""
        self._check_usable()
        return self._regions.add(specs)

    def add_region(self, name: str, nbytes: int) -> Region:
        return self.add_regions([(name, nbytes)])[0]

    def region(self, name: str) -> Region:
        return self.layout[name]

    def __contains__(self, name: str) -> bool:
        return name in self.layout

    @property
    def size_bytes(self) -> int:
        return self.layout.end

    def extents(self, name: str) -> list[tuple[str, int, int, int]]:
        """Where region ``name``'s bytes (its whole capacity) are on disk: ``(file path, file offset, offset in
        region, length)`` pieces, one per stripe unit (one unstriped). For whoever addresses the files directly
        (a reflink snapshot clones them)."""
        return self._regions.extents(name)

    # ---- public async API ---------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed or self._closing:
            raise StoreIOError(f"store {self.path} is closed", path=self.path)
        if self.dispatch.first_error is not None:
            raise self.dispatch.first_error

    def _submit(self, kind: str, name: str, t: torch.Tensor, offset: int,
                after: tuple[IOHandle, ...] = ()) -> IOHandle:
        self._check_usable()
        barrier = self.write_barrier
        if kind == "write" and barrier is not None:
            barrier(name)
        region = self.layout[name]
        if offset % ALIGN:
            raise ValueError(f"offset within region {name!r} must be a multiple of {ALIGN}, got {offset}")
        if not t.is_contiguous():
            if kind == "read":
                raise ValueError(f"read into region {name!r}: `out` must be contiguous")
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if offset + nbytes > region.capacity:
            raise ValueError(f"{kind} of {nbytes} bytes at offset {offset} does not fit region {name!r} "
                             f"({region.capacity} bytes)")
        if self.shelf.get(name) is not None:  # in memory: copied now, never touches the disk
            for h in after:
                self.wait(h)
            self.shelf.transfer(name, _as_bytes(t), offset, kind == "write")
            return IOHandle(kind, name, region.offset + offset, nbytes, 0, [], default_timeout=self.io_timeout_s)
        return self.dispatch.submit(kind, name, t, _as_bytes(t), region.offset + offset, nbytes, after)

    def write(self, name: str, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Asynchronously write ``tensor``'s bytes into region ``name`` at byte ``offset``. The tensor must
        not be modified until the handle completes (the store keeps a reference to it, not a copy; a
        non-contiguous tensor is made contiguous once and that copy is held until then)."""
        return self._submit("write", name, tensor, offset)

    def read(self, name: str, out: torch.Tensor, offset: int = 0, after: tuple[IOHandle, ...] = ()) -> IOHandle:
        """Asynchronously fill ``out`` from region ``name`` at byte ``offset``. Sees every write issued
        before it to the same bytes. ``after``: requests that must complete before ``out`` is filled, e.g. a
        write still reading from ``out`` (a buffer being reused): the I/O worker waits for them, not the caller."""
        return self._submit("read", name, out, offset, after)

    def shelve(self, names: list[str], *, load: bool = True) -> None:
        """Keep these regions in host memory from now on (``lightning_nvme.store.shelf``): their bytes are read
        from the disk once (``load``; ``False`` for regions nothing was written to yet) and every later request
        is served from memory, until ``close`` writes them back."""
        self._check_usable()
        names = [n for n in names if self.shelf.get(n) is None]
        if not names:
            return
        self.fence(names)
        for name in names:
            if self.write_barrier is not None:
                self.write_barrier(name)
            data = self.aligned_empty(self.layout[name].capacity)
            if load:
                self.wait(self.read(name, data))
            self.shelf.hold(name, data)

    def discard_shelved(self, names: list[str]) -> None:
        """Stop holding these regions without writing them back: for a caller that never reads them again (their
        disk copy stays stale)."""
        self.shelf.drop(names)

    def shelved(self, name: str) -> torch.Tensor | None:
        """The memory holding region ``name`` if it is shelved (uint8, its capacity): callers may work in it in
        place; a write of that same tensor is then free."""
        return self.shelf.get(name)

    def fence(self, regions: list[str] | None = None, *, durable: bool = False, timeout: float | None = None) -> None:
        """Wait until every pending request (or those touching ``regions``) has completed on the disk;
        re-raise the first I/O error. ``durable=True`` also fdatasyncs the file."""
        engine = self.dispatch.engine
        if regions is None:
            pending = engine.pending()
        else:
            pending = [h for name in regions for h in engine.pending(self.layout[name].offset, self.layout[name].end)]
        self.dispatch.wait_all(pending, self.io_timeout_s if timeout is None else timeout)
        if durable:
            self._regions.sync()
            for file in self._files:
                file.fdatasync()
            self.dispatch.stats.add(fsyncs=1)

    def wait(self, handle: IOHandle) -> None:
        """``handle.wait`` with the store's timeout, counting the blocked time as fence wait."""
        self.dispatch.wait(handle)

    def digest(self, regions: list[str] | None = None) -> dict[str, str]:
        """BLAKE2b of each region's bytes as they are on disk (``store/digest.py`` says why)."""
        return region_digests(self, regions)

    def aligned_empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype = torch.uint8, *,
                      pin: bool = False) -> torch.Tensor:
        """A page-aligned tensor the store moves without a staging copy (``pin``: a device copies it too)."""
        return aligned_empty(shape, dtype, pin=pin)

    @property
    def closed(self) -> bool:
        """Whether ``close`` has run (the file, lock and I/O threads are released)."""
        return self._closed

    @property
    def stats(self) -> IOStats:
        return self.dispatch.stats.read()

    @property
    def staging_bytes(self) -> int:
        return self.dispatch.pool.total_bytes

    def close(self, *, delete: bool = False) -> None:
        """Drain pending I/O, stop the workers, release the lock; then raise any error still pending.

        If a worker stays blocked in the kernel (a stalled disk), the file and its lock are kept, since
        that thread may still write to the file, and ``StoreTimeoutError`` says so; call ``close``
        again once the disk answers, or exit the process (the kernel then drops the lock)."""
        if self._closed:
            return
        error: BaseException | None = None
        if not delete and self.dispatch.first_error is None:
            try:  # the disk copy of shelved regions is stale: a reopened store must read the true bytes
                for name, data in self.shelf.take_all().items():
                    self.write(name, data)
            except BaseException as e:  # noqa: BLE001 - re-raised after cleanup
                error = e
        self._closing = True
        try:
            if not delete:
                self._regions.sync()
            self.fence(timeout=self.io_timeout_s)
        except BaseException as e:  # noqa: BLE001 - re-raised after cleanup
            error = error or e
        busy = self.dispatch.shutdown(min(self.io_timeout_s, 30.0))
        if busy:
            # A worker is stuck in a read/write on this fd. Closing it would let the number be reused by
            # another file, which that worker would then write into; releasing the lock would let another
            # store truncate the file under it.
            log.error("FlatStore %s: %d I/O thread(s) still blocked at close; the file and its lock stay held",
                      self.path, busy)
            pending = f" Pending: {error}" if error is not None else ""
            raise StoreTimeoutError(f"store {self.path}: {busy} I/O thread(s) are still blocked in the kernel; the "
                                    f"file and its lock stay held until they return (call close() again) or this "
                                    f"process exits.{pending}") from error
        self._closed = True
        for file in self._files:
            file.close()
        if delete:
            for p in (*self.paths, self.manifest_path):
                if os.path.exists(p):
                    os.remove(p)
        for lock in self._locks:
            lock.release()
        if error is not None:
            raise error

    def __enter__(self) -> FlatStore:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already propagating: clean up, but do not mask it with a store error
            self.close()
        except StoreError as e:
            log.error("FlatStore %s: error while closing after %s: %s", self.path, exc_type.__name__, e)

    def __repr__(self) -> str:
        where = self.path if len(self.paths) == 1 else self.paths
        return f"FlatStore({where!r}, mode={self.mode}, regions={len(self.layout.regions)}, bytes={self.size_bytes})"
