"""Keep freed host memory from staying in the process: a bounded-memory feature, not a tweak.

glibc raises its mmap threshold dynamically (up to 32 MiB) each time a large block is freed, after
which tensors below that size come from the heap, whose freed pages it keeps. An offloaded optimizer
allocates and frees chunk-sized temporaries every step, so the heap ends up keeping much of what the
offload saved. Fixing the threshold hands blocks at least that large back to the OS when freed.

The value trades memory for page faults: too low and every activation is a fresh mapping, faulted in
page by page each step; too high and freed blocks stay on the heap. The default is 32 MiB (glibc's own
maximum, still fixed), with chunk updates inside backward pushed off the heap (``temporaries_off_heap``)
and updates after backward kept on a trimmed heap region. With ``offload_params`` (the model does not
fit: memory first) it is 8 MiB, since gradients and update temporaries of 8-32 MiB would otherwise stay on
the heap. The measurements behind each choice: docs/performance.md, "The malloc mmap threshold".

Also the host memory's other two facts the package reads: the process's peak RSS (``peak_rss_bytes``) and what the
host can still give (``available_host_memory``, for the ``host_memory_budget`` plan and its preflight check).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


HEAP_MMAP_THRESHOLD_MAX = 32 << 20  # the largest M_MMAP_THRESHOLD glibc accepts on 64-bit
# Updates inside backward, and every allocation with offload_params ("auto"): lower peak RSS with parameters
# offloaded (docs/performance.md, "The malloc mmap threshold").
OFF_HEAP_THRESHOLD = 8 << 20
# A chunk's first update inside backward (the optimizer creates its state there): lower still, so the new state and
# the temporaries of pieces below 8 MiB (a chunk_bytes of 8 MiB holds 4 MiB moments) leave the heap too. Measured with
# nvme_offload_fsdp (2 ranks, width 2560, chunk_bytes 8 MiB): at 8 MiB the first backward's RSS grew ~50 MiB a block
# and stayed (0.7-1.0 B/param from 4 to 16 layers); at 1 MiB for every update in backward it grew 0.16-0.18 B/param
# but each step paid fresh mappings for its temporaries (docs/performance.md): so only the first update.
FIRST_UPDATE_OFF_HEAP_THRESHOLD = 1 << 20

_fixed_threshold: int | None = None  # what release_freed_memory set in this process, if anything


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


def _set(libc, option: int, value: int) -> bool:
    return bool(libc.mallopt(option, int(value)))


def release_freed_memory(mmap_threshold: int) -> bool:
    """Fix glibc's mmap threshold (and trim threshold) at ``mmap_threshold`` bytes for this process.
    Returns False where the C library is not glibc (nothing is changed there)."""
    global _fixed_threshold
    libc = _libc()
    if libc is None:
        return False
    ok = _set(libc, M_MMAP_THRESHOLD, mmap_threshold) and _set(libc, M_TRIM_THRESHOLD, mmap_threshold)
    if ok:
        _fixed_threshold = int(mmap_threshold)
    log.debug("mallopt(M_MMAP_THRESHOLD=%d): %s", mmap_threshold, ok)
    return ok


@contextmanager
def keep_freed_heap(*, trim: bool = True) -> Iterator[None]:
    """Within the block, freed heap memory stays in the process (for reuse by the next allocation);
    on exit it is returned to the OS (``malloc_trim``; with ``trim=False`` only the free space at the
    heap's top, at the next ``free`` there). Wraps an optimizer step's update loop, so the pages of one
    chunk's update temporaries (see ``temporaries_on_heap``) serve the next chunk instead of being
    faulted in again, and nothing is kept across steps. Inside backward (``overlap="backward"``) use
    ``trim=False`` around one chunk: a full trim there would also return backward's own free heap.
    A no-op unless ``release_freed_memory`` fixed
    the thresholds (glibc's dynamic threshold already keeps such blocks)."""
    threshold = _fixed_threshold
    libc = _libc() if threshold is not None else None
    if libc is None or threshold is None:
        yield
        return
    _set(libc, M_TRIM_THRESHOLD, (1 << 31) - 1)  # mallopt takes a C int
    try:
        yield
    finally:
        _set(libc, M_TRIM_THRESHOLD, threshold)
        if trim:
            libc.malloc_trim(0)


@contextmanager
def temporaries_on_heap() -> Iterator[None]:
    """Within the block, allocations up to 32 MiB come from the heap instead of a fresh ``mmap`` each.

    Why: with the threshold fixed (``release_freed_memory``), every temporary an optimizer update
    allocates (AdamW's ``sqrt``/``div`` of a 16 MiB piece) was a new mapping, faulted in page by page
    and unmapped again, every chunk of every step (``benchmarks/optimizer_offload.py --profile`` counts
    them). Wrap only the update (not forward/backward, whose blocks the fixed threshold keeps
    releasing), inside ``keep_freed_heap`` so the next update reuses the pages."""
    with _mmap_threshold_within(HEAP_MMAP_THRESHOLD_MAX):
        yield


@contextmanager
def temporaries_off_heap(threshold: int = OFF_HEAP_THRESHOLD) -> Iterator[None]:
    """Within the block, allocations of ``threshold`` bytes or more are fresh mappings, returned when freed.

    Why: an update that runs inside backward (``overlap="backward"``) interleaves its temporaries with
    backward's own allocations; on the heap, backward's blocks land above the freed temporaries, so the heap
    can neither reuse nor shrink them and grows with every chunk, i.e. with the model. Off the heap they
    cost page faults, but only the update's, not forward's and backward's. A no-op unless
    ``release_freed_memory`` fixed the thresholds."""
    if _fixed_threshold is not None and threshold >= _fixed_threshold:
        yield  # already at least that low
        return
    with _mmap_threshold_within(threshold):
        yield


@contextmanager
def _mmap_threshold_within(threshold: int) -> Iterator[None]:
    """M_MMAP_THRESHOLD = ``threshold`` within the block, back to the fixed one after; a no-op unless
    ``release_freed_memory`` fixed it (glibc only)."""
    fixed = _fixed_threshold
    libc = _libc() if fixed is not None else None
    if libc is None or fixed is None:
        yield
        return
    _set(libc, M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        _set(libc, M_MMAP_THRESHOLD, fixed)


def _proc_kib(file: str, field: str) -> int | None:
    """Bytes of a ``field: N kB`` line of a /proc file; None where the file or the line is missing."""
    try:
        with open(file) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (``VmHWM``). Not ``ru_maxrss``: Linux carries that across fork
    and exec, so a process started by a large parent reports at least the parent's RSS at the fork."""
    peak = _proc_kib("/proc/self/status", "VmHWM:")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: the best there is


def available_host_memory() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` (what can be allocated without swapping), in bytes; where
    that file is missing, the physical memory."""
    available = _proc_kib("/proc/meminfo", "MemAvailable:")
    if available is not None:
        return available
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
