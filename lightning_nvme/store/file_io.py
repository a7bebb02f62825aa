"""``StoreFile``: the store's file descriptor and its checked I/O (whole buffers, errors that name the place).

Why apart from ``FlatStore``: the store's logic (regions, ordering, fences) never sees a raw ``os`` call;
every read, write, allocation and sync goes through here and fails with a ``StoreError`` that names the
file, region and offset, and says what to do.
"""

from __future__ import annotations

import errno as errno_mod
import os
import shutil
from collections.abc import Callable

import torch

from lightning_nvme.store.aligned import StagingPool, copy_bytes, memview
from lightning_nvme.store.errors import StoreFormatError, StoreIOError, StoreSpaceError
from lightning_nvme.store.layout import align_up


class StoreFile:
    """``path`` opened read-write (created and truncated unless ``reopen``), with ``O_DIRECT`` where the
    filesystem accepts it: ``direct=None`` probes, ``True`` requires it, ``False`` never uses it."""

    def __init__(self, path: str, *, reopen: bool, direct: bool | None) -> None:
        self.path = path
        if reopen and not os.path.exists(path):
            raise StoreFormatError(f"cannot reopen store {path}: the file does not exist")
        self.fd = os.open(path, os.O_RDWR | (0 if reopen else os.O_CREAT | os.O_TRUNC), 0o644)
        self.direct = False
        if direct is not False and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError as e:
                if direct:
                    os.close(self.fd)
                    raise StoreIOError(f"O_DIRECT was requested but {path} does not support it ({e.strerror}). "
                                       f"Use a local ext4/xfs SSD, or set direct=None to fall back to buffered I/O.",
                                       path=path, errno=e.errno) from e
            else:
                os.close(self.fd)
                self.fd, self.direct = dfd, True

    def fall_back_to_buffered(self) -> None:
        """O_DIRECT was accepted at open but refused at write time (EINVAL): reopen without it."""
        os.close(self.fd)
        self.fd, self.direct = os.open(self.path, os.O_RDWR), False

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def allocate(self, offset: int, nbytes: int, min_free_bytes: int) -> None:
        """Reserve disk blocks for [offset, offset+nbytes), refusing early and clearly when space is short."""
        free = shutil.disk_usage(os.path.dirname(self.path)).free
        if nbytes + min_free_bytes > free:
            raise StoreSpaceError(
                f"store {self.path} needs {nbytes} more bytes ({nbytes / 2**30:.2f} GiB) plus a safety margin of "
                f"{min_free_bytes} bytes, but only {free} bytes ({free / 2**30:.2f} GiB) are free on that disk. "
                f"Free space, or point store_dir at a larger local SSD.")
        try:
            os.posix_fallocate(self.fd, offset, nbytes)
        except OSError as e:
            if e.errno == errno_mod.ENOSPC:
                raise StoreSpaceError(f"store {self.path}: no space left to allocate {nbytes} bytes at offset "
                                      f"{offset}. Free space or use a larger disk for store_dir.") from e
            if e.errno not in (errno_mod.EOPNOTSUPP, errno_mod.EINVAL):
                raise StoreIOError(f"cannot allocate {self.path}: {e.strerror}", path=self.path, errno=e.errno) from e
            os.ftruncate(self.fd, max(self.size, offset + nbytes))

    def pwrite_full(self, mv: memoryview, offset: int, region: str) -> None:
        done = 0
        while done < len(mv):
            try:
                n = os.pwrite(self.fd, mv[done:], offset + done)
            except OSError as e:
                hint = (" The disk is full: free space on it, or move store_dir to a larger disk."
                        if e.errno == errno_mod.ENOSPC else "")
                raise StoreIOError(f"write to {self.path} failed at offset {offset + done} (region {region!r}): "
                                   f"{e.strerror}.{hint}", path=self.path, region=region, offset=offset + done,
                                   errno=e.errno) from e
            if n <= 0:
                raise StoreIOError(f"short write to {self.path} at offset {offset + done} (region {region!r}): "
                                   f"{done} of {len(mv)} bytes written", path=self.path, region=region,
                                   offset=offset + done)
            done += n

    def pread_full(self, mv: memoryview, offset: int, region: str) -> None:
        done = 0
        while done < len(mv):
            try:
                n = os.preadv(self.fd, [mv[done:]], offset + done)
            except OSError as e:
                raise StoreIOError(f"read from {self.path} failed at offset {offset + done} (region {region!r}): "
                                   f"{e.strerror}", path=self.path, region=region, offset=offset + done,
                                   errno=e.errno) from e
            if n <= 0:
                raise StoreIOError(f"short read from {self.path} at offset {offset + done} (region {region!r}): "
                                   f"{done} of {len(mv)} bytes read; the store file was truncated or removed",
                                   path=self.path, region=region, offset=offset + done)
            done += n

    def drop_cache(self, offset: int, nbytes: int) -> None:
        """Buffered I/O: drop the bytes just moved from the page cache (the RAM the offload saves)."""
        if not self.direct:
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def fdatasync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise StoreIOError(f"fdatasync of {self.path} failed: {e.strerror}", path=self.path, errno=e.errno) from e

    def close(self) -> None:
        os.close(self.fd)


def chunk_job(pool: StagingPool, tensor: torch.Tensor, a: int, n: int, file: StoreFile, file_off: int, region: str,
              *, zero_copy: bool, write: bool) -> Callable[[], None]:
    """One disk request for bytes ``[a, a + n)`` of ``tensor`` at ``file_off`` of ``file``: in place when
    the tensor is page-aligned (zero copy), else through a buffer of the bounded staging ``pool``."""
    transfer = file.pwrite_full if write else file.pread_full

    def job() -> None:
        length = align_up(n) if file.direct else n
        if zero_copy:
            transfer(memview(tensor.data_ptr() + a, length), file_off, region)
        else:
            buf = pool.acquire()
            try:
                if write:
                    copy_bytes(buf, 0, tensor, a, n)
                transfer(memview(buf.data_ptr(), length), file_off, region)
                if not write:
                    copy_bytes(tensor, a, buf, 0, n)
            finally:
                pool.release(buf)
        file.drop_cache(file_off, n)
    return job
