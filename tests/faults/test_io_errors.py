"""An I/O error in a background write or read reaches the caller at the next wait/fence, stops the
store (no further requests accepted), and close() still drains, stops every worker and frees the lock."""

from __future__ import annotations

import contextlib
import errno

import pytest
import torch

from lightning_nvme.store import FlatStore, StoreError, StoreIOError

from .conftest import io_threads

MiB = 1 << 20


def _store(d, **kw) -> FlatStore:
    kw = {"io_chunk_bytes": 1 * MiB, "io_workers": 2, "staging_bytes": 4 * MiB, "io_timeout_s": 20.0} | kw
    store = FlatStore(d, **kw)
    store.add_regions([("alpha", 4 * MiB), ("beta", 4 * MiB)])
    return store


def _data(store: FlatStore, seed: int = 0) -> torch.Tensor:
    t = store.aligned_empty(4 * MiB)
    t.copy_(torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return t


def test_background_write_error_reaches_next_fence(tmp_path, faulty_disk):
    store = _store(tmp_path)
    faulty_disk.write_errno = errno.EIO
    h = store.write("alpha", _data(store))
    with pytest.raises(StoreIOError) as ei:
        store.fence(timeout=10)
    e = ei.value
    assert e.errno == errno.EIO and e.path == store.path and e.region == "alpha"
    assert store.path in str(e) and "alpha" in str(e)
    with pytest.raises(StoreIOError):
        h.wait(10)
    # the store is stopped: the next step's first request fails at once instead of piling up
    with pytest.raises(StoreIOError):
        store.write("beta", _data(store))
    with pytest.raises(StoreIOError):
        store.close()


def test_close_after_error_stops_workers_and_releases_lock(tmp_path, faulty_disk):
    before = set(io_threads())
    store = _store(tmp_path)
    faulty_disk.write_errno = errno.EIO
    store.write("alpha", _data(store))
    with contextlib.suppress(StoreIOError):  # refused at once if the first error already arrived
        store.write("beta", _data(store, 1))
    with pytest.raises(StoreIOError):
        store.close()
    assert store.dispatch.engine.alive_threads == 0
    assert set(io_threads()) <= before  # no zombie I/O threads
    faulty_disk.write_errno = None
    again = FlatStore(tmp_path, io_chunk_bytes=1 * MiB, staging_bytes=4 * MiB, reopen=True)  # lock was released
    assert "alpha" in again and "beta" in again
    again.close()


def test_read_error_reaches_waiter(tmp_path, faulty_disk):
    store = _store(tmp_path)
    src = _data(store)
    store.write("beta", src)
    store.fence(timeout=10)
    faulty_disk.read_errno = errno.EIO
    out = store.aligned_empty(4 * MiB)
    h = store.read("beta", out)
    with pytest.raises(StoreIOError) as ei:
        store.wait(h)
    assert ei.value.errno == errno.EIO and "read from" in str(ei.value) and "beta" in str(ei.value)
    with pytest.raises(StoreIOError):
        store.close()


def test_read_after_failed_write_is_not_run(tmp_path, faulty_disk):
    """A read must never return stale bytes because the write it depends on failed."""
    store = _store(tmp_path)
    beta = store.region("beta")
    faulty_disk.write_errno = errno.EIO
    faulty_disk.fail_offset = beta.offset + 2 * MiB  # only the third chunk of beta fails
    store.write("beta", _data(store))
    out = store.aligned_empty(4 * MiB)
    with pytest.raises(StoreError) as ei:
        # refused at submission if the write has already failed (a loaded machine), else failed at the wait;
        # tests/faults/test_ordering.py forces each interleaving
        store.read("beta", out).wait(10)
    msg = str(ei.value)
    assert "beta" in msg and ("depends on failed" in msg or "Input/output error" in msg)
    with pytest.raises(StoreError):
        store.close()


def test_unaligned_tensor_error_returns_staging_buffers(tmp_path, faulty_disk):
    """Errors on the staged (non page-aligned) path give their buffer back: the pool stays whole."""
    store = _store(tmp_path, staging_bytes=2 * MiB)
    faulty_disk.write_errno = errno.EIO
    src = torch.zeros(4 * MiB + 1, dtype=torch.uint8)[1:]  # misaligned -> staged copies
    store.write("alpha", src)
    with pytest.raises(StoreIOError):
        store.fence(timeout=10)
    assert store.dispatch.pool._free.qsize() == store.dispatch.pool.count
    with pytest.raises(StoreIOError):
        store.close()
