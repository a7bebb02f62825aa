"""Full disk: preflight refuses a store that does not fit, saying bytes needed and free; a disk that
fills mid-run surfaces as an error naming the path at the next fence, and nothing hangs.

Real small filesystems (a loop-mounted ext4 image and a size-limited tmpfs) are used where this
sandbox permits mounting (skipped otherwise); the injected-ENOSPC variant always runs."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess

import pytest
import torch

from lightning_nvme.preflight.resources import ConfigError, PreflightWarning, check_store_dir
from lightning_nvme.store import FlatStore, StoreIOError, StoreSpaceError

from .conftest import io_threads, small_fs

MiB = 1 << 20


def _fill(directory: str) -> int:
    """Write a filler file until the disk is full (what a runaway log or checkpoint does)."""
    block = b"\xff" * MiB
    written = 0
    with open(os.path.join(directory, "filler"), "wb") as f:
        try:
            while True:
                written += f.write(block)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
        try:
            os.fsync(f.fileno())
        except OSError:
            pass
    while True:  # the last partial MiB: fill to the final block
        try:
            with open(os.path.join(directory, f"filler-{written}"), "wb") as f:
                written += f.write(b"\xff" * 4096)
        except OSError:
            return written


def _pattern(store: FlatStore, nbytes: int) -> torch.Tensor:
    t = store.aligned_empty(nbytes)
    t.copy_(torch.arange(nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8))
    return t


# ---- injected ENOSPC: always runs ----------------------------------------------------------------
def test_injected_enospc_mid_run_surfaces_at_fence(tmp_path, faulty_disk):
    before = set(io_threads())
    store = FlatStore(tmp_path, io_chunk_bytes=1 * MiB, io_workers=2, staging_bytes=2 * MiB, io_timeout_s=20)
    store.add_region("state", 8 * MiB)
    faulty_disk.written_budget = faulty_disk.bytes_written + 3 * MiB  # the disk fills after 3 MiB
    store.write("state", _pattern(store, 8 * MiB))
    with pytest.raises(StoreIOError) as ei:
        store.fence(timeout=10)
    e = ei.value
    assert e.errno == errno.ENOSPC and e.path == store.path
    assert store.path in str(e) and "disk is full" in str(e) and "store_dir" in str(e)
    with pytest.raises(StoreIOError):
        store.close()
    assert set(io_threads()) <= before
    FlatStore(tmp_path, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB, reopen=True).close()  # lock released


# ---- real small filesystems ------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::lightning_nvme.preflight.resources.PreflightWarning")
def test_preflight_refuses_store_that_does_not_fit(tiny_fs):
    free = shutil.disk_usage(tiny_fs).free
    with pytest.raises(ConfigError) as ei:
        check_store_dir(os.path.join(tiny_fs, "store"), 64 * MiB)
    msg = str(ei.value)
    assert ei.value.key == "store_dir" and os.path.join(tiny_fs, "store") in msg
    assert f"needs {64 * MiB} bytes" in msg
    reported_free = int(re.search(r"only (\d+) bytes", msg).group(1))
    assert free - MiB <= reported_free <= free  # preflight's own mkdir/probe may take a block
    assert re.search(r"free at least \d+ bytes", msg)


@pytest.mark.filterwarnings("ignore::lightning_nvme.preflight.resources.PreflightWarning")
def test_preflight_margin_on_real_disk(tiny_fs):
    free = shutil.disk_usage(tiny_fs).free
    check_store_dir(tiny_fs, free // 2)
    with pytest.raises(ConfigError, match="min_free_bytes"):
        check_store_dir(tiny_fs, free // 2, min_free_bytes=free // 2 + MiB)


def test_store_refuses_region_that_does_not_fit_and_stays_usable(tiny_fs):
    store = FlatStore(tiny_fs, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB, io_timeout_s=20)
    store.add_region("small", 4 * MiB)
    with pytest.raises(StoreSpaceError) as ei:
        store.add_region("huge", 64 * MiB)
    assert store.path in str(ei.value) and "bytes" in str(ei.value)
    assert "huge" not in store  # the layout was rolled back
    data = _pattern(store, 4 * MiB)
    store.write("small", data)
    out = store.aligned_empty(4 * MiB)
    store.fence(durable=True, timeout=10)
    store.wait(store.read("small", out))
    assert torch.equal(out, data)
    store.close()


def test_preallocated_store_survives_disk_filling_up(tiny_fs):
    """The store's blocks are reserved up front (fallocate), so other writers filling the disk
    mid-run cannot make a store write fail."""
    store = FlatStore(tiny_fs, io_chunk_bytes=1 * MiB, io_workers=2, staging_bytes=2 * MiB, io_timeout_s=20)
    store.add_region("state", 8 * MiB)
    _fill(tiny_fs)
    data = _pattern(store, 8 * MiB)
    store.write("state", data)
    store.fence(durable=True, timeout=10)
    out = store.aligned_empty(8 * MiB)
    store.wait(store.read("state", out))
    assert torch.equal(out, data)
    store.close()


def test_real_enospc_on_unpreallocated_store_surfaces_at_fence(tiny_fs, monkeypatch):
    """On a filesystem without fallocate the store file is sparse; when the disk then fills, the
    kernel's ENOSPC from a background write reaches the next fence with the path, and close() frees
    the workers and the lock."""
    def no_fallocate(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    before = set(io_threads())
    store = FlatStore(tiny_fs, io_chunk_bytes=1 * MiB, io_workers=2, staging_bytes=2 * MiB, io_timeout_s=20)
    store.add_region("state", 16 * MiB)
    _fill(tiny_fs)
    store.write("state", _pattern(store, 16 * MiB))
    with pytest.raises(StoreIOError) as ei:
        store.fence(durable=True, timeout=10)
    assert ei.value.errno == errno.ENOSPC and store.path in str(ei.value) and "disk is full" in str(ei.value)
    with pytest.raises(StoreIOError):
        store.close()
    assert set(io_threads()) <= before
    os.remove(os.path.join(tiny_fs, "filler"))
    FlatStore(tiny_fs, io_chunk_bytes=1 * MiB, staging_bytes=2 * MiB).close()  # the lock was released


def test_preflight_warns_on_real_tmpfs(tmp_path):
    with small_fs("tmpfs", 8 * MiB, str(tmp_path)) as mnt:
        with pytest.warns(PreflightWarning, match="saves no memory"):
            report = check_store_dir(mnt, MiB)
    assert report.fs_type == "tmpfs"


def test_preflight_refuses_read_only_mount(tmp_path):
    """Root ignores permission bits, so a read-only mount is the honest test of an unwritable dir."""
    with small_fs("tmpfs", 8 * MiB, str(tmp_path)) as mnt:
        if subprocess.run(["mount", "-o", "remount,ro", mnt], capture_output=True, timeout=60).returncode:
            pytest.skip("remount read-only not permitted")
        with pytest.raises(ConfigError, match="not writable") as ei:
            check_store_dir(mnt, MiB)
        assert mnt in str(ei.value) and "Read-only" in str(ei.value)


# ---- a striped store: the full disk is named ----------------------------------------------------------------
def test_injected_enospc_on_one_stripe_names_that_file(tmp_path, monkeypatch):
    from .conftest import FaultyDisk

    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    full = os.path.join(dirs[1], "store-rank0.bin")
    disk = FaultyDisk(monkeypatch, suffix=full)  # only the second disk fills up
    store = FlatStore(dirs, io_chunk_bytes=1 * MiB, io_workers=2, staging_bytes=2 * MiB, io_timeout_s=20,
                      stripe_bytes=1 * MiB)
    store.add_region("state", 8 * MiB)
    disk.write_errno = errno.ENOSPC
    h = store.write("state", _pattern(store, 8 * MiB))
    with pytest.raises(StoreIOError, match=f"write to {re.escape(full)} failed.*The disk is full") as info:
        h.wait()
    assert info.value.path == full and info.value.errno == errno.ENOSPC
    with pytest.raises(StoreIOError, match=re.escape(full)):
        store.close()


def test_real_full_stripe_refused_at_allocation_naming_it(tmp_path):
    with small_fs("ext4", 32 << 20, str(tmp_path)) as mnt:
        dirs = [str(tmp_path / "big"), mnt]
        with FlatStore(dirs, stripe_bytes=1 * MiB) as store:
            with pytest.raises(StoreSpaceError, match=f"store {re.escape(os.path.join(mnt, 'store-rank0.bin'))}"):
                store.add_region("state", 96 * MiB)  # 48 MiB per stripe: more than the small disk holds
            assert "state" not in store
            store.add_region("fits", 8 * MiB)  # the refused request left the store usable
            store.write("fits", _pattern(store, 8 * MiB)).wait()
            store.close(delete=True)
