"""Reflinks: a range of one file made part of another by sharing its disk extents (copy on write), so a copy of
any size costs metadata only. XFS (``mkfs.xfs -m reflink=1``, the default in current xfsprogs) and btrfs have
them; ext4 does not.

Why a probe: whether ``ioctl(FICLONERANGE)`` works depends on the filesystem and how it was made, not its type
alone, so support is learnt once per directory by cloning a small test file, and cached. A clone needs both
files on one filesystem and offsets (and the length, unless it ends at the source's end) that are multiples of
the filesystem block size; ``clone_range`` checks that first and says which rule a request broke.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import tempfile
from dataclasses import dataclass

# <linux/fs.h>: _IOW(0x94, 13, struct file_clone_range) and _IOW(0x94, 9, int)
FICLONERANGE = 0x4020940D
FICLONE = 0x40049409


@dataclass(frozen=True)
class Support:
    """Whether ``directory`` takes clones, its filesystem's block size, and if not, why."""

    directory: str
    supported: bool
    block_size: int
    device: int
    reason: str = ""


_cache: dict[tuple[int, str], Support] = {}


def _block_size(path: str) -> int:
    st = os.statvfs(path)
    return int(st.f_bsize or st.f_frsize or 4096)


def probe(directory: str) -> Support:
    """Clone a one-block test file inside ``directory`` (created if missing); cached per directory and device."""
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    device = os.stat(directory).st_dev
    key = (device, directory)
    if key in _cache:
        return _cache[key]
    bs = _block_size(directory)
    reason = ""
    # named as a dead writer's temp (``.NAME.tmp-PID``, ``atomic.sweep_dead_temps``): a kill between the probe's
    # create and unlink (it runs in a checkpoint directory, at the first save) leaves nothing the next save keeps
    fd, src = tempfile.mkstemp(prefix=".reflink-probe-", suffix=f".tmp-{os.getpid()}", dir=directory)
    head, tail = os.path.split(src)
    dst = os.path.join(head, tail.replace(".reflink-probe-", ".reflink-clone-", 1))
    try:
        os.write(fd, b"\x5a" * bs)
        os.fsync(fd)
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fcntl.ioctl(dfd, FICLONE, fd)
        except OSError as e:
            reason = f"ioctl(FICLONE) in {directory} failed: {os.strerror(e.errno or 0)} ({_why(e.errno)})"
        finally:
            os.close(dfd)
    finally:
        os.close(fd)
        for p in (src, dst):
            if os.path.exists(p):
                os.unlink(p)
    support = Support(directory, not reason, bs, device, reason)
    _cache[key] = support
    return support


def _why(code: int | None) -> str:
    if code in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.ENOSYS):
        return "this filesystem has no reflinks; XFS made with `mkfs.xfs -m reflink=1` and btrfs have them"
    if code == errno.EXDEV:
        return "the files are on different filesystems"
    return "unexpected"


def same_filesystem(a: str, b: str) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def clone_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int, block_size: int) -> None:
    """Make ``[dst_offset, +length)`` of ``dst_fd`` share the extents of ``[src_offset, +length)`` of ``src_fd``.
    Offsets must be multiples of ``block_size``; so must ``length`` unless the range ends at the source's end."""
    if src_offset % block_size or dst_offset % block_size:
        raise ValueError(f"clone offsets {src_offset} -> {dst_offset} are not multiples of the filesystem block "
                         f"size {block_size}")
    if length % block_size and src_offset + length != os.fstat(src_fd).st_size:
        raise ValueError(f"clone length {length} is not a multiple of the filesystem block size {block_size}")
    if length:
        fcntl.ioctl(dst_fd, FICLONERANGE, struct.pack("=qQQQ", src_fd, src_offset, length, dst_offset))
