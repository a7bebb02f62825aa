"""Keep freed host memory from staying in the process: a bounded-memory feature, not a tweak.

glibc raises its mmap threshold dynamically (up to 32 MiB) each time a large block is freed, after
which tensors below that size come from the heap, whose freed pages it keeps. An offloaded optimizer
allocates and frees chunk-sized temporaries every step, and measured on this machine the heap kept
~0.9x the parameter bytes resident (a 672 MiB saving shrank to 254 MiB). Fixing the threshold hands
blocks at least that large back to the OS when freed. Measured on a 151 M-param AdamW training step
(benchmarks/optimizer_offload.py shapes, peak RSS / step time): glibc default 2473 MiB / 4.75 s;
1 MiB 2036 MiB / 5.45 s (every activation is then a fresh mmap: page faults); 8 MiB 2187 MiB /
4.55 s. 8 MiB keeps activation-sized blocks on the fast heap and releases chunk temporaries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


HEAP_MMAP_THRESHOLD_MAX = 32 << 20  # the largest M_MMAP_THRESHOLD glibc accepts on 64-bit

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
    and unmapped again: ~100 K page faults per step for 50 M params (``benchmarks/optimizer_offload.py
    --profile``). Wrap only the update (not forward/backward, whose blocks the fixed threshold keeps
    releasing), inside ``keep_freed_heap`` so the next update reuses the pages."""
    threshold = _fixed_threshold
    libc = _libc() if threshold is not None else None
    if libc is None or threshold is None:
        yield
        return
    _set(libc, M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD_MAX)
    try:
        yield
    finally:
        _set(libc, M_MMAP_THRESHOLD, threshold)


@contextmanager
def temporaries_off_heap(threshold: int = 8 << 20) -> Iterator[None]:
    """Within the block, allocations of ``threshold`` bytes or more are fresh mappings, returned when freed.

    Why: an update that runs inside backward (``overlap="backward"``) interleaves its temporaries with
    backward's own allocations; on the heap, backward's blocks land above the freed temporaries, so the heap
    can neither reuse nor shrink them and grows with every chunk (3 GiB at 2.5 B params). Off the heap they
    cost page faults, but only the update's, not forward's and backward's. A no-op unless
    ``release_freed_memory`` fixed the thresholds."""
    fixed = _fixed_threshold
    libc = _libc() if fixed is not None else None
    if libc is None or fixed is None or threshold >= fixed:
        yield
        return
    _set(libc, M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        _set(libc, M_MMAP_THRESHOLD, fixed)
