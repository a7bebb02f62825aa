"""``IODispatch``: a store request's way to the disks: chunk jobs on each file's workers, ordered, counted, waited for.

Why its own object: ``FlatStore`` owns the names (regions, the shelf, the files' lifetime) and checks a request
against them; this object, composed into it with explicit arguments (FSDP2-style state objects, not a mixin),
turns a checked request into chunk jobs (``store/file_io.py``) on one worker pool per file (``store/engine.py``),
orders it after the requests it overlaps, keeps the first I/O error, counts the bytes and seconds
(``store/stats.py``) and bounds every wait by ``io_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from lightning_nvme.store.aligned import StagingPool, is_direct_capable
from lightning_nvme.store.engine import IOEngine
from lightning_nvme.store.errors import StoreTimeoutError
from lightning_nvme.store.file_io import StoreFile, chunk_job
from lightning_nvme.store.handle import IOHandle, wait_all
from lightning_nvme.store.layout import align_up
from lightning_nvme.store.stats import StatsRecorder
from lightning_nvme.store.stripes import StripeMap


class IODispatch:
    """Chunked, ordered asynchronous requests on a store's files.

    Args:
        path: the store's (first) file, for messages.
        files: the store's open files, one per directory (disk).
        stripe_map: logical byte ranges -> (file, file offset) pieces.
        io_chunk_bytes: requests are split into chunks of this size.
        io_workers: I/O threads per file.
        staging_bytes: the staging pool (a tensor that is not page-aligned goes through it); bounded.
        io_timeout_s: the bound of every wait.
    """

    def __init__(self, path: str, files: list[StoreFile], stripe_map: StripeMap, *, io_chunk_bytes: int,
                 io_workers: int, staging_bytes: int, io_timeout_s: float) -> None:
        self.path = path
        self.files = files
        self.stripe_map = stripe_map
        self.io_chunk_bytes = io_chunk_bytes
        self.io_timeout_s = io_timeout_s
        self.first_error: BaseException | None = None
        self.stats = StatsRecorder()
        self.pool = StagingPool(max(1, staging_bytes // io_chunk_bytes), io_chunk_bytes)
        multi = len(files) > 1
        # one queue and worker pool per file (disk); the first also orders all requests (logical byte ranges)
        self.engines = [IOEngine(io_workers, name=f"lightning-nvme-io-s{i}" if multi else "lightning-nvme-io")
                        for i in range(len(files))]
        self.engine = self.engines[0]
        self._submit_lock = threading.Lock()

    @property
    def direct(self) -> bool:
        return all(f.direct for f in self.files)

    def chunk_job(self, tensor: torch.Tensor, a: int, n: int, file: StoreFile, file_off: int, region: str,
                  zero_copy: bool, write: bool) -> Callable[[], None]:
        return chunk_job(self.pool, tensor, a, n, file, file_off, region, zero_copy=zero_copy, write=write)

    def _on_done(self, h: IOHandle) -> None:
        if h.error is not None and self.first_error is None:
            self.first_error = h.error
        seconds = (h.t_done or h.t_submit) - h.t_submit
        if h.kind == "write":
            self.stats.add(bytes_written=h.nbytes, writes=1, write_seconds=seconds)
        else:
            self.stats.add(bytes_read=h.nbytes, reads=1, read_seconds=seconds)

    def submit(self, kind: str, name: str, t: torch.Tensor, data: torch.Tensor, start: int, nbytes: int,
               after: tuple[IOHandle, ...] = ()) -> IOHandle:
        """Move ``nbytes`` of contiguous ``t`` (``data``: its flat uint8 view) to or from the store's logical bytes
        from ``start`` (region ``name``'s, checked by the store), once the requests it conflicts with and those
        in ``after`` (still pending ones) have completed."""
        if t.device.type != "cpu":
            zero_copy = False
        else:
            zero_copy = not self.direct or is_direct_capable(t, nbytes, for_read=kind == "read")
        pieces = self.stripe_map.pieces(start, nbytes, self.io_chunk_bytes)
        jobs: list[list[Callable[[], None]]] = [[] for _ in self.files]
        for i, a, file_off, n in pieces:
            jobs[i].append(self.chunk_job(data if not zero_copy else t, a, n, self.files[i], file_off, name,
                                          zero_copy, kind == "write"))
        # Finding the dependencies, registering the request and queueing its chunks is one step, so two
        # threads submitting at once cannot both miss each other (or queue out of dependency order).
        with self._submit_lock:
            deps = self.engine.conflicts(kind, start, start + align_up(nbytes))
            deps += [h for h in after if not h.done() and h not in deps]
            handle = IOHandle(kind, name, start, nbytes, len(pieces), deps, keepalive=t, on_done=self._on_done,
                              default_timeout=self.io_timeout_s)
            self.engine.track(handle)
            for engine, file_jobs in zip(self.engines, jobs):
                if file_jobs:
                    engine.submit(handle, file_jobs)
        return handle

    def wait_all(self, pending: list[IOHandle], limit: float) -> None:
        """Wait for ``pending`` (at most ``limit`` s: then a timeout naming what is stuck); re-raise the first error."""
        t0 = time.perf_counter()
        try:
            wait_all(pending, limit)
        except StoreTimeoutError:
            stuck = [h.describe() for h in pending if not h.done()]
            shown = "; ".join(stuck[:20]) + (f"; ... {len(stuck) - 20} more" if len(stuck) > 20 else "")
            raise StoreTimeoutError(
                f"fence on {self.path} timed out after {limit:g}s with {len(stuck)} request(s) pending: {shown}. "
                f"The disk may be stalled or failing; raise io_timeout_s only if it is just slow.") from None
        finally:
            self.stats.add(wait_seconds=time.perf_counter() - t0)
        if self.first_error is not None:
            raise self.first_error

    def wait(self, handle: IOHandle) -> None:
        """``handle.wait`` with the store's timeout, counting the blocked time as fence wait."""
        t0 = time.perf_counter()
        try:
            handle.wait(self.io_timeout_s)
        except StoreTimeoutError as e:
            raise StoreTimeoutError(f"store {self.path}: {e}") from None
        finally:
            self.stats.add(wait_seconds=time.perf_counter() - t0)

    def shutdown(self, timeout: float) -> int:
        """Stop every file's workers; returns how many threads are still blocked in the kernel."""
        deadline = time.monotonic() + timeout
        return sum(e.shutdown(timeout=max(0.0, deadline - time.monotonic())) for e in self.engines)
