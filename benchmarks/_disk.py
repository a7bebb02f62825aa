"""Raw-disk baselines and measurement helpers shared by the benchmarks.

Why a raw baseline in every benchmark: this disk's speed drifts up to 3x over minutes, so a figure
is only meaningful as a ratio to a plain sequential loop measured on the same disk in the same run,
alternating with the subject (A B A B ...). The baseline is what a careful C programmer would write:
8 MiB ``pwrite``/``pread`` at consecutive offsets from a few threads (queue depth), ``O_DIRECT``
where the filesystem allows it, writes timed through ``fdatasync``.
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30
ALIGN = 4096


def direct_supported(directory: str) -> bool:
    """True when files in ``directory`` can be opened and written with ``O_DIRECT``."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".odirect-probe-{os.getpid()}")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            os.pwrite(fd, buf, 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.remove(path)


def drop_file_cache(path: str) -> None:
    """Evict ``path`` from the page cache so the next buffered read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def preallocate(path: str, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` of allocated blocks (as the store does), outside any timing."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


_buffers: dict[int, list[mmap.mmap]] = {}


def io_buffers(count: int, block: int) -> list[mmap.mmap]:
    """Page-aligned, already-touched buffers, made once and reused, so that page faults and filling
    them are never inside a timed region."""
    bufs = _buffers.setdefault(block, [])
    while len(bufs) < count:
        buf = mmap.mmap(-1, block)
        buf.write(os.urandom(ALIGN) * (block // ALIGN))
        bufs.append(buf)
    return bufs[:count]


Memory = Callable[[int, int], memoryview]  # (offset from the start, length) -> the memory to write from / read into


def _parallel_blocks(fd: int, nbytes: int, block: int, threads: int, op, base: int = 0,
                     memory: Memory | None = None) -> None:
    """Run ``op(fd, buf, offset)`` over consecutive ``block``-sized offsets from ``base``, ``threads`` at a
    time. ``buf`` is ``memory(offset, n)`` when given (so a baseline moves the very bytes, from and to the
    very memory, the subject does), else the thread's own buffer."""
    lock = threading.Lock()
    next_off = [0]
    errors: list[BaseException] = []

    def worker(buf: mmap.mmap | None) -> None:
        view = memoryview(buf) if buf is not None else None
        try:
            while True:
                with lock:
                    off = next_off[0]
                    next_off[0] += block
                if off >= nbytes:
                    return
                n = min(block, nbytes - off)
                done = op(fd, view[:n] if memory is None else memory(off, n), base + off)
                if done != n:
                    raise OSError(f"short I/O at offset {base + off}: {done} of {n} bytes")
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
        finally:
            if view is not None:
                view.release()

    bufs = io_buffers(threads, block) if memory is None else [None] * threads
    pool = [threading.Thread(target=worker, args=(buf,)) for buf in bufs]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def raw_write(path: str, nbytes: int, *, block: int = 8 * MiB, threads: int = 4, direct: bool = True,
              offset: int = 0, memory: Memory | None = None) -> float:
    """Seconds to write ``nbytes`` sequentially to a preallocated ``path`` from ``offset``, through ``fdatasync``.

    For an honest ratio, pass the subject's own file, offset and source memory (``memory``): on a
    virtual or thin-provisioned disk, speed can depend on where the blocks are and on what they hold
    (host-side caching, deduplication), and on the memory footprint, not only on the software."""
    if memory is None:
        io_buffers(threads, block)  # made before the clock starts
    fd = os.open(path, os.O_RDWR | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        _parallel_blocks(fd, nbytes, block, threads, os.pwrite, offset, memory)
        os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def raw_read(path: str, nbytes: int, *, block: int = 8 * MiB, threads: int = 4, direct: bool = True,
             offset: int = 0, memory: Memory | None = None) -> float:
    """Seconds to read ``nbytes`` sequentially from ``path`` at ``offset``, cold (O_DIRECT, or cache dropped first)."""
    if not direct:
        drop_file_cache(path)
    if memory is None:
        io_buffers(threads, block)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        t0 = time.perf_counter()
        _parallel_blocks(fd, nbytes, block, threads, lambda f, b, o: os.preadv(f, [b], o), offset, memory)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def raw_disk(directory: str, nbytes: int) -> tuple[float, float]:
    """This run's raw disk speed in GB/s: write (through fdatasync), then cold read, ``nbytes`` of a
    preallocated scratch file in ``directory`` (the store's disk) with the loops above."""
    path = os.path.join(directory, "raw-baseline.bin")
    preallocate(path, nbytes)
    try:
        return gbps(nbytes, raw_write(path, nbytes)), gbps(nbytes, raw_read(path, nbytes))
    finally:
        os.remove(path)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def median_ratio(subject: list[float], baseline: list[float]) -> float:
    """Median of per-pair ratios subject[i] / baseline[i] (pairs measured back to back)."""
    return statistics.median(s / b for s, b in zip(subject, baseline, strict=True))


def spread(ratios: list[float], digits: int = 3) -> dict[str, float | list[float]]:
    """Median, min and max of per-pair ratios, and the pairs themselves: what a figure in docs/performance.md quotes
    as "median (min-max)" so a reader sees how far one run can move it."""
    return {"median": round(statistics.median(ratios), digits), "min": round(min(ratios), digits),
            "max": round(max(ratios), digits), "pairs": [round(r, digits) for r in ratios]}


def peak_rss_mib() -> float:
    """The process's peak resident set size so far (``lightning_nvme.memory.peak_rss_bytes``)."""
    from lightning_nvme.memory import peak_rss_bytes

    return peak_rss_bytes() / MiB


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


@dataclass
class Pairs:
    """Per-pair throughputs (GB/s) of a subject and its baseline, in measurement order."""

    subject: list[float]
    baseline: list[float]

    @property
    def ratio(self) -> float:
        return median_ratio(self.subject, self.baseline)

    @property
    def subject_median(self) -> float:
        return statistics.median(self.subject)

    @property
    def baseline_median(self) -> float:
        return statistics.median(self.baseline)
