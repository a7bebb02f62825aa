"""Fault injection for the store: failing or hanging syscalls on the store file only, and small
real filesystems (loop-mounted ext4, size-limited tmpfs) that fill up for real."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

STUCK_LIMIT_S = 30.0  # an injected hang never outlives the test, even if the test forgets to release it


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lightning-nvme-io")]


class FaultyDisk:
    """Wraps ``os.pwrite``/``os.preadv`` so faults hit only files whose path ends with ``suffix``
    (the store file), never the lock file or anything else the process touches."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, suffix: str = ".bin") -> None:
        self.suffix = suffix
        self.real_pwrite, self.real_preadv = os.pwrite, os.preadv
        self.write_errno: int | None = None
        self.read_errno: int | None = None
        self.fail_offset: int | None = None  # None: every offset; else only requests covering this offset
        self.written_budget: int | None = None  # ENOSPC once this many bytes were written
        self.hang = threading.Event()  # set -> the next matching write blocks until release()
        self._release = threading.Event()
        self.blocked = threading.Event()  # set once a write is blocked
        self._lock = threading.Lock()
        self.bytes_written = 0
        monkeypatch.setattr(os, "pwrite", self._pwrite)
        monkeypatch.setattr(os, "preadv", self._preadv)

    def _targets(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").endswith(self.suffix)
        except OSError:
            return False

    def _covers(self, offset: int, n: int) -> bool:
        return self.fail_offset is None or offset <= self.fail_offset < offset + n

    def _pwrite(self, fd, data, offset):
        if self._targets(fd):
            n = len(memoryview(data))
            if self.hang.is_set():
                self.blocked.set()
                self._release.wait(STUCK_LIMIT_S)
            if self.write_errno is not None and self._covers(offset, n):
                raise OSError(self.write_errno, os.strerror(self.write_errno))
            with self._lock:
                if self.written_budget is not None and self.bytes_written + n > self.written_budget:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.bytes_written += n
        return self.real_pwrite(fd, data, offset)

    def _preadv(self, fd, buffers, offset):
        if self._targets(fd) and self.read_errno is not None:
            n = sum(len(memoryview(b)) for b in buffers)
            if self._covers(offset, n):
                raise OSError(self.read_errno, os.strerror(self.read_errno))
        return self.real_preadv(fd, buffers, offset)

    def release(self) -> None:
        self.hang.clear()
        self._release.set()


@pytest.fixture
def faulty_disk(monkeypatch) -> Iterator[FaultyDisk]:
    disk = FaultyDisk(monkeypatch)
    yield disk
    disk.release()


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@contextmanager
def small_fs(kind: str, size_bytes: int, where) -> Iterator[str]:
    """Mount a ``size_bytes`` filesystem (``"ext4"`` loop image or ``"tmpfs"``) under ``where``;
    skip the test when this sandbox does not permit mounting."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small filesystem needs root and mount(8)")
    mnt = os.path.join(where, f"mnt-{kind}")
    os.makedirs(mnt)
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", mnt]
    else:
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("mkfs.ext4 not installed")
        image = os.path.join(where, "fs.img")
        with open(image, "wb") as f:
            f.truncate(size_bytes)
        made = _run(["mkfs.ext4", "-q", "-F", "-m", "0", image])
        if made.returncode:
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
        cmd = ["mount", "-o", "loop", image, mnt]
    mounted = _run(cmd)
    if mounted.returncode:
        pytest.skip(f"mount not permitted here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        if _run(["umount", mnt]).returncode:
            _run(["umount", "-l", mnt])


@pytest.fixture(params=["ext4", "tmpfs"])
def tiny_fs(request, tmp_path) -> Iterator[str]:
    """A real 32 MiB filesystem that really runs out of space."""
    with small_fs(request.param, 32 << 20, str(tmp_path)) as mnt:
        yield mnt
