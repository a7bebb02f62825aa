"""FlatStore failure handling: I/O errors and short transfers reach the caller, waits are bounded,
space is checked up front, and O_DIRECT falls back to buffered I/O where the filesystem refuses it."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
from collections import namedtuple

import pytest
import torch

from lightning_nvme.store import (
    FlatStore,
    StoreError,
    StoreIOError,
    StoreLockedError,
    StoreSpaceError,
    StoreTimeoutError,
    aligned_empty,
)

KiB = 1024
CHUNK = 64 * KiB


@pytest.fixture
def store(tmp_path):
    s = FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=4 * CHUNK, io_workers=2, io_timeout_s=30)
    yield s
    try:
        s.close()
    except StoreError:
        pass  # tests that inject errors leave one pending; close re-raises it


def _fail_pwrite_in(monkeypatch, store: FlatStore, region: str, err: int, gate: threading.Event | None = None):
    r = store.region(region)
    real = os.pwrite

    def pwrite(fd, buf, offset):
        if fd == store.fd and r.offset <= offset < r.end:
            if gate is not None:
                gate.wait(10)
            raise OSError(err, os.strerror(err))
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_background_write_error_reaches_waiter_and_next_fence(store, monkeypatch, err):
    store.add_regions([("ok", CHUNK), ("bad", 4 * CHUNK)])
    _fail_pwrite_in(monkeypatch, store, "bad", err)
    store.write("ok", torch.ones(CHUNK, dtype=torch.uint8)).wait()
    h = store.write("bad", torch.ones(3 * CHUNK, dtype=torch.uint8), offset=CHUNK)
    with pytest.raises(StoreIOError) as info:
        h.wait()
    e = info.value
    assert e.errno == err and e.region == "bad" and e.path == store.path
    bad = store.region("bad")
    assert bad.offset + CHUNK <= e.offset < bad.end
    msg = str(e)
    assert store.path in msg and "'bad'" in msg and f"offset {e.offset}" in msg and os.strerror(err) in msg
    with pytest.raises(StoreIOError, match="bad"):
        store.fence()
    with pytest.raises(StoreIOError):  # the store refuses new work once its file is in an unknown state
        store.write("ok", torch.ones(CHUNK, dtype=torch.uint8))


def test_short_write_is_an_error(store, monkeypatch):
    store.add_region("r", CHUNK)
    monkeypatch.setattr(os, "pwrite", lambda fd, buf, off: 0)  # the disk accepted nothing
    with pytest.raises(StoreIOError, match="short write") as info:
        store.write("r", torch.ones(CHUNK, dtype=torch.uint8)).wait()
    assert info.value.region == "r" and store.path in str(info.value)


def test_partial_writes_are_completed(store, monkeypatch):
    """pwrite may legally move fewer bytes than asked; the store must loop, not drop the rest."""
    store.add_region("r", CHUNK)
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, buf, off: real(fd, memoryview(buf)[:min(len(buf), 4096)], off))
    src = torch.randint(0, 255, (CHUNK,), dtype=torch.uint8)
    store.write("r", src).wait()
    monkeypatch.undo()
    out = torch.empty_like(src)
    store.read("r", out).wait()
    assert torch.equal(out, src)


def test_short_read_of_truncated_file_is_an_error(store):
    store.add_regions([("a", CHUNK), ("b", 2 * CHUNK)])
    store.write("b", torch.ones(2 * CHUNK, dtype=torch.uint8)).wait()
    os.truncate(store.path, store.region("b").offset + CHUNK // 2)  # someone truncated the file
    with pytest.raises(StoreIOError, match="short read") as info:
        store.read("b", torch.empty(2 * CHUNK, dtype=torch.uint8)).wait()
    assert info.value.region == "b" and "truncated" in str(info.value)


def test_read_depending_on_failed_write_fails(store, monkeypatch):
    store.add_region("r", 2 * CHUNK)
    store.write("r", torch.full((2 * CHUNK,), 5, dtype=torch.uint8)).wait()
    gate = threading.Event()
    _fail_pwrite_in(monkeypatch, store, "r", errno.EIO, gate)
    hw = store.write("r", torch.ones(2 * CHUNK, dtype=torch.uint8))
    out = torch.zeros(2 * CHUNK, dtype=torch.uint8)
    hr = store.read("r", out)  # issued while the write is still pending
    gate.set()
    with pytest.raises(StoreIOError):
        hw.wait()
    with pytest.raises(StoreError, match="depends on failed") as info:
        hr.wait()
    assert "'r'" in str(info.value)
    assert bool((out == 0).all()), "a read after a failed write must not deliver stale data"


def test_stuck_request_times_out_listing_pending(store, monkeypatch):
    store.add_regions([("fast", CHUNK), ("stuck", CHUNK)])
    gate = threading.Event()
    real = os.pwrite
    r = store.region("stuck")

    def blocking(fd, buf, offset):
        if r.offset <= offset < r.end:
            gate.wait(30)
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", blocking)
    h = store.write("stuck", torch.ones(CHUNK, dtype=torch.uint8))
    with pytest.raises(StoreTimeoutError) as info:
        store.fence(timeout=0.2)
    assert "'stuck'" in str(info.value) and "pending" in str(info.value)
    with pytest.raises(StoreTimeoutError, match="stuck"):
        h.wait(0.05)
    gate.set()
    store.fence()
    assert h.done() and h.error is None


def test_handle_wait_without_timeout_uses_store_limit(tmp_path, monkeypatch):
    with FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=CHUNK, io_timeout_s=0.2) as store:
        store.add_region("r", CHUNK)
        gate = threading.Event()
        real = os.pwrite
        monkeypatch.setattr(os, "pwrite", lambda fd, b, o: (gate.wait(30), real(fd, b, o))[1])
        h = store.write("r", torch.ones(CHUNK, dtype=torch.uint8))
        with pytest.raises(StoreTimeoutError):
            h.wait()  # no timeout given: the store's io_timeout_s applies, never an unbounded wait
        gate.set()


def test_space_error_names_bytes_and_path(store, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 << 30, (10 << 30) - (1 << 20), 1 << 20))
    before = store.size_bytes
    with pytest.raises(StoreSpaceError) as info:
        store.add_regions([("a", 1 << 20), ("b", 2 << 20)])
    msg = str(info.value)
    assert str(3 << 20) in msg and str(1 << 20) in msg and store.path in msg
    assert "a" not in store and store.size_bytes == before  # the layout is rolled back
    monkeypatch.undo()
    store.add_region("a", CHUNK)  # the name is free again


def test_min_free_bytes_margin(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 << 30, 6 << 30, 4 << 30))
    with FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=CHUNK, min_free_bytes=(4 << 30) - (1 << 20)) as store:
        store.add_region("fits", 512 << 10)
        with pytest.raises(StoreSpaceError, match="safety margin"):
            store.add_region("r", 2 << 20)


# ---- I/O mode -------------------------------------------------------------------------------------
def _roundtrip_ok(store: FlatStore) -> bool:
    store.add_region("r", 10_000)
    src = torch.randn(2500)
    store.write("r", src).wait()
    out = torch.empty_like(src)
    store.read("r", out).wait()
    return torch.equal(out, src)


def test_buffered_mode_when_asked(tmp_path):
    with FlatStore(tmp_path, direct=False, io_chunk_bytes=CHUNK, staging_bytes=CHUNK) as store:
        assert store.mode == "buffered" and not fcntl.fcntl(store.fd, fcntl.F_GETFL) & os.O_DIRECT
        assert _roundtrip_ok(store)


def _refuse_o_direct_open(monkeypatch):
    real = os.open

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)


def test_auto_mode_falls_back_when_open_refuses_o_direct(tmp_path, monkeypatch):
    _refuse_o_direct_open(monkeypatch)
    with FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=CHUNK) as store:
        assert store.mode == "buffered"
        assert _roundtrip_ok(store)


def test_forced_direct_on_refusing_filesystem_is_an_actionable_error(tmp_path, monkeypatch):
    _refuse_o_direct_open(monkeypatch)
    with pytest.raises(StoreIOError, match="O_DIRECT was requested") as info:
        FlatStore(tmp_path, direct=True, io_chunk_bytes=CHUNK, staging_bytes=CHUNK)
    assert str(tmp_path) in str(info.value)
    monkeypatch.undo()
    FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=CHUNK).close()  # the failed attempt left no lock behind


def test_auto_mode_falls_back_when_direct_writes_are_refused(tmp_path, monkeypatch):
    """Some filesystems accept O_DIRECT at open and refuse it at the first write (EINVAL)."""
    real = os.pwrite

    def refuse_direct(fd, buf, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, off)

    monkeypatch.setattr(os, "pwrite", refuse_direct)
    with FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=CHUNK) as store:
        assert store.mode == "buffered"
        assert _roundtrip_ok(store)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_tmpfs_auto_mode_roundtrips(tmp_path):
    """tmpfs refuses O_DIRECT on older kernels and accepts it on newer ones: auto mode works on both."""
    d = f"/dev/shm/lightning-nvme-test-{os.getpid()}"
    try:
        probe = os.path.join(d, "probe")
        os.makedirs(d)
        try:
            os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT))
            expected = "direct"
        except OSError:
            expected = "buffered"
        with FlatStore(d, io_chunk_bytes=CHUNK, staging_bytes=CHUNK) as store:
            assert store.mode == expected
            assert _roundtrip_ok(store)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_exit_after_an_exception_does_not_mask_it(tmp_path, monkeypatch):
    with pytest.raises(KeyError, match="user bug"):
        with FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=CHUNK) as store:
            store.add_region("r", CHUNK)
            monkeypatch.setattr(os, "pwrite", lambda fd, b, o: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
            store.write("r", torch.ones(CHUNK, dtype=torch.uint8))
            raise KeyError("user bug")
    assert store._closed


def test_close_with_a_stuck_worker_keeps_fd_and_lock(tmp_path, monkeypatch, caplog):
    """A worker blocked in pwrite at close must not be left holding a closed (reusable) fd number."""
    store = FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=CHUNK, io_workers=1, io_timeout_s=0.2)
    store.add_region("r", CHUNK)
    gate = threading.Event()
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, b, o: (gate.wait(30), real(fd, b, o))[1])
    store.write("r", torch.ones(CHUNK, dtype=torch.uint8))
    with pytest.raises(StoreTimeoutError, match="'r'"):
        store.close()
    assert "still blocked" in caplog.text
    os.fstat(store.fd)  # still open: the stuck write cannot land in some other file
    with pytest.raises(StoreLockedError):
        FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=CHUNK)
    gate.set()
    for t in store.dispatch.engine._threads:
        t.join(10)
    assert store.dispatch.engine.alive_threads == 0
    out = aligned_empty(CHUNK)
    assert os.preadv(store.fd, [out.numpy()], store.region("r").offset) == CHUNK and bool((out == 1).all())
    store.close()  # as its error says: close again once the disk answered; now fd and lock are released
    assert store._closed
    FlatStore(tmp_path, io_chunk_bytes=CHUNK, staging_bytes=CHUNK).close()
