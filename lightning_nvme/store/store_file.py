"""``StoreFile``: one file of a store, with its lock, its I/O mode and checked positional I/O.

Why a class of its own: a store striped over several disks holds one file per directory, and every
guarantee of the store holds per file: each is locked, opened ``O_DIRECT`` where its filesystem accepts
it, preallocated with a clear error when its disk is short, fdatasync'ed before a checkpoint commits,
and every failed or short transfer names that file's path.
"""

from __future__ import annotations

import errno as errno_mod
import os
import shutil

from lightning_nvme.store.errors import StoreIOError, StoreSpaceError
from lightning_nvme.store.lock import StoreLock


class StoreFile:
    """One open store file. ``create`` truncates it; otherwise it must exist (``reopen``)."""

    def __init__(self, path: str, *, direct: bool | None, create: bool, min_free_bytes: int = 0) -> None:
        self.path = path
        self.directory = os.path.dirname(path)
        self.min_free_bytes = min_free_bytes
        self.fd = -1
        self.direct = False
        self.lock = StoreLock(path + ".lock")
        self.lock.acquire()
        try:
            self._open(direct, create)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, direct: bool | None, create: bool) -> None:
        self.fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0), 0o644)
        if direct is not False and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError as e:
                if direct:
                    os.close(self.fd)
                    self.fd = -1
                    raise StoreIOError(f"O_DIRECT was requested but {self.path} does not support it ({e.strerror}). "
                                       f"Use a local ext4/xfs SSD, or set direct=None to fall back to buffered I/O.",
                                       path=self.path, errno=e.errno) from e
            else:
                os.close(self.fd)
                self.fd, self.direct = dfd, True

    def fall_back_to_buffered(self) -> None:
        """``O_DIRECT`` opened but refused at write time (``EINVAL``): continue buffered."""
        os.close(self.fd)
        self.fd, self.direct = os.open(self.path, os.O_RDWR), False

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def allocate(self, offset: int, nbytes: int) -> None:
        """Reserve disk blocks for [offset, offset+nbytes), refusing early and clearly when space is short."""
        if nbytes <= 0:
            return
        free = shutil.disk_usage(self.directory).free
        if nbytes + self.min_free_bytes > free:
            raise StoreSpaceError(
                f"store {self.path} needs {nbytes} more bytes ({nbytes / 2**30:.2f} GiB) plus a safety margin of "
                f"{self.min_free_bytes} bytes, but only {free} bytes ({free / 2**30:.2f} GiB) are free on that disk. "
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
        if not self.direct:
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def datasync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise StoreIOError(f"fdatasync of {self.path} failed: {e.strerror}", path=self.path, errno=e.errno) from e

    def close(self, *, delete: bool = False) -> None:
        """Close the descriptor (and remove the file with ``delete``), then release the lock."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if delete and os.path.exists(self.path):
            os.remove(self.path)
        self.lock.release()
