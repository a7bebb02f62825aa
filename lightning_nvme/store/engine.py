"""The I/O engine: a small pool of worker threads serving chunk jobs, and the ordering rule that
makes the store safe to use asynchronously.

Ordering: a request depends on every earlier, still-pending request whose byte range overlaps it
and that conflicts with it (read-after-write, write-after-read, write-after-write). A chunk job
waits for its request's dependencies before touching the disk.

Two lanes: reads with no dependency go first, everything else FIFO after them. Why: compute waits on
reads, while a write only has to finish before its buffer is reused; queued FIFO behind a step's
write-backs, the next chunk's read made the update wait (``store.wait_seconds`` of an offloaded
optimizer step, ``benchmarks/optimizer_offload.py --profile``). No deadlock: a job's dependencies were
submitted before it and are dequeued before it (a dependency-free read jumps only ahead of requests
submitted later, and those may depend on it, never the reverse).

Failed writes: a write that failed stays a dependency of every later request overlapping it, so such a
request fails with it without touching the disk, even if it was submitted after the write had already
finished (the store refuses new requests after an error, but a request whose submission raced with the
failure got past that check: it read the stale bytes as valid, issue #20).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable

from lightning_nvme.store.errors import StoreError
from lightning_nvme.store.handle import IOHandle


class IOEngine:
    def __init__(self, io_workers: int, name: str = "lightning-nvme-io") -> None:
        if io_workers < 1:
            raise ValueError(f"io_workers must be >= 1, got {io_workers}")
        self._queue: queue.PriorityQueue = queue.PriorityQueue()  # (lane, seq, handle, job)
        self._seq = itertools.count()
        self._pending: list[IOHandle] = []
        self._failed_writes: list[IOHandle] = []  # done with an error: later overlapping requests fail with them
        self._lock = threading.Lock()
        # Test hook: called as observer(event, handle) by the worker: "deps" before waiting for a chunk's
        # dependencies, "run" before touching the disk. Lets tests force and check interleavings without sleeps.
        self.observer: Callable[[str, IOHandle], None] | None = None
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(io_workers)]
        for t in self._threads:
            t.start()

    # ---- ordering -------------------------------------------------------------------------
    def conflicts(self, kind: str, start: int, end: int) -> list[IOHandle]:
        """Pending requests a new ``kind`` request on [start, end) must wait for; also prunes done ones."""
        with self._lock:
            self._prune()
            return [h for h in self._failed_writes + self._pending
                    if h.start < end and start < h.end and (kind == "write" or h.kind == "write")]

    def _prune(self) -> None:
        """Drop completed requests from the pending list, keeping failed writes (call with the lock held)."""
        keep = []
        for h in self._pending:
            if not h.done():
                keep.append(h)
            elif h.error is not None and h.kind == "write":
                self._failed_writes.append(h)
        self._pending = keep

    def track(self, handle: IOHandle) -> None:
        with self._lock:
            if not handle.done():
                self._pending.append(handle)

    def pending(self, start: int | None = None, end: int | None = None) -> list[IOHandle]:
        with self._lock:
            self._prune()
            if start is None or end is None:
                return list(self._pending)
            return [h for h in self._pending if h.start < end and start < h.end]

    # ---- execution ------------------------------------------------------------------------
    def submit(self, handle: IOHandle, chunk_jobs: list[Callable[[], None]]) -> None:
        """Queue a request's chunk jobs (call with the submitter's lock held, after ``conflicts``)."""
        lane = 0 if handle.kind == "read" and not handle.deps else 1
        for job in chunk_jobs:
            self._queue.put((lane, next(self._seq), handle, job))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            _, _, handle, job = item
            del item
            if handle is None:
                return
            if self._stopping:  # close() gave up waiting: never touch the file after it is released
                del job
                handle.chunk_finished(StoreError(f"{handle.kind} of region {handle.region!r} was cancelled: the "
                                                 f"store was closed before it ran"))
                del handle
                continue
            error: BaseException | None = None
            observer = self.observer
            try:
                if observer is not None:
                    observer("deps", handle)
                for dep in handle.deps:
                    dep.settle()
                    if dep.error is not None:
                        raise StoreError(f"{handle.kind} of region {handle.region!r} was not run: an earlier "
                                         f"{dep.kind} of region {dep.region!r} it depends on failed: {dep.error}")
                if observer is not None:
                    observer("run", handle)
                job()
            except BaseException as e:  # noqa: BLE001 - every error goes to the waiter
                error = e
            # The job holds the tensor it moved: drop it before the waiter is woken, not at the next job,
            # so a caller that frees its tensor once the handle is done really frees the memory.
            del job
            handle.chunk_finished(error)
            del handle, error

    def shutdown(self, timeout: float = 30.0) -> int:
        """Stop the workers within ``timeout`` (one deadline for all); jobs not yet started are
        cancelled. Returns how many threads are still busy (blocked in the kernel)."""
        self._stopping = True
        for _ in self._threads:
            self._queue.put((2, next(self._seq), None, None))  # after every queued job
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return self.alive_threads

    @property
    def alive_threads(self) -> int:
        return sum(t.is_alive() for t in self._threads)
