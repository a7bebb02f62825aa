"""No wait is unbounded: a stuck write raises StoreTimeoutError listing what was pending, and a
store whose worker is still blocked in the kernel keeps its lock until that worker returns."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from lightning_nvme.store import FlatStore, StoreLockedError, StoreTimeoutError

from .conftest import io_threads

MiB = 1 << 20


def _stuck_store(tmp_path, faulty_disk, timeout_s=0.5) -> tuple[FlatStore, list]:
    store = FlatStore(tmp_path, io_chunk_bytes=1 * MiB, io_workers=2, staging_bytes=2 * MiB, io_timeout_s=timeout_s)
    store.add_regions([("alpha", MiB), ("beta", MiB)])
    faulty_disk.hang.set()
    a, b = store.aligned_empty(MiB), store.aligned_empty(MiB)
    handles = [store.write("alpha", a), store.write("beta", b)]
    assert faulty_disk.blocked.wait(10)
    return store, handles


def test_stuck_write_times_out_listing_pending(tmp_path, faulty_disk):
    store, handles = _stuck_store(tmp_path, faulty_disk)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as ei:
        store.fence()
    assert time.monotonic() - t0 < 15  # bounded: io_timeout_s, not forever
    msg = str(ei.value)
    assert store.path in msg and "'alpha'" in msg and "'beta'" in msg and "pending" in msg
    with pytest.raises(StoreTimeoutError, match="alpha"):
        store.wait(handles[0])
    faulty_disk.release()
    store.fence(timeout=10)  # the disk answered: the same requests complete normally
    store.close()


def test_close_while_stuck_keeps_lock_until_worker_returns(tmp_path, faulty_disk):
    before = set(io_threads())
    store, _ = _stuck_store(tmp_path, faulty_disk)
    with pytest.raises(StoreTimeoutError, match="still blocked"):
        store.close()
    # a blocked worker may still write the file, so no second store may take it yet
    with pytest.raises(StoreLockedError):
        FlatStore(tmp_path, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB)
    faulty_disk.release()
    store.close()
    assert store.dispatch.engine.alive_threads == 0 and set(io_threads()) <= before
    FlatStore(tmp_path, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB, reopen=True).close()


def test_close_cancels_requests_that_never_started(tmp_path, faulty_disk):
    """With one worker stuck, queued requests are cancelled, not run after the store let go of the file."""
    store = FlatStore(tmp_path, io_chunk_bytes=1 * MiB, io_workers=1, staging_bytes=2 * MiB, io_timeout_s=0.3)
    store.add_regions([("alpha", MiB), ("beta", 4 * MiB)])
    faulty_disk.hang.set()
    store.write("alpha", store.aligned_empty(MiB))
    queued = store.write("beta", torch.ones(4 * MiB, dtype=torch.uint8))
    assert faulty_disk.blocked.wait(10)
    with pytest.raises(StoreTimeoutError):
        store.close()
    written_before = faulty_disk.bytes_written
    faulty_disk.release()
    with pytest.raises(Exception, match="cancelled"):
        store.close()
    with pytest.raises(Exception, match="cancelled"):
        queued.wait(1)
    assert faulty_disk.bytes_written - written_before <= MiB  # only the one stuck chunk finished


def test_handle_wait_and_await_are_bounded_by_default(tmp_path, faulty_disk):
    """``h.wait()`` and ``await h`` without a timeout use the store's io_timeout_s, never forever."""
    store, handles = _stuck_store(tmp_path, faulty_disk, timeout_s=0.3)
    with pytest.raises(StoreTimeoutError, match="alpha"):
        handles[0].wait()

    async def waiter():
        await handles[1]

    with pytest.raises(StoreTimeoutError, match="beta"):
        asyncio.run(waiter())
    faulty_disk.release()
    store.close()
