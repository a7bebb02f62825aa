"""Facts about the filesystem under a path: which mount, which fs type and options, whether it is
memory-backed or remote, whether it accepts O_DIRECT, and whether swap shares its disk.

Why: offloading to disk only saves memory when the disk is a real local block device. A store on
tmpfs/ramfs lives in RAM anyway, one on NFS/SMB/FUSE is slow and may lose writes, and swap on the
same SSD competes with the store for bandwidth. Preflight and ``doctor`` both read these facts.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass, field

MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
                        "afs", "9p", "virtiofs", "fuse", "fuseblk", "sshfs", "davfs", "ncpfs", "orangefs"})


@dataclass(frozen=True)
class MountInfo:
    """One line of ``/proc/mounts``: the mount that holds a path."""

    mount_point: str
    device: str
    fs_type: str
    options: tuple[str, ...]

    @property
    def is_memory(self) -> bool:
        return self.fs_type in MEMORY_FS

    @property
    def is_network(self) -> bool:
        return self.fs_type in NETWORK_FS or self.fs_type.startswith("fuse.")

    @property
    def noatime(self) -> bool:
        return "noatime" in self.options


@dataclass(frozen=True)
class SwapEntry:
    """One line of ``/proc/swaps``."""

    filename: str
    kind: str  # "partition" or "file"
    size_bytes: int
    used_bytes: int
    priority: int


@dataclass
class FsInfo:
    """Everything preflight and doctor report about one directory."""

    path: str
    mount: MountInfo | None
    free_bytes: int
    total_bytes: int
    disk: str | None  # whole-disk name (e.g. "nvme0n1") or None for virtual filesystems
    direct_io: bool
    direct_io_detail: str
    swap_same_disk: list[SwapEntry] = field(default_factory=list)


def _unescape(s: str) -> str:
    """``/proc/mounts`` writes space, tab, newline and backslash in paths as octal escapes."""
    for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        s = s.replace(esc, ch)
    return s


def existing_ancestor(path: str | os.PathLike) -> str:
    """The path itself, or its nearest ancestor that exists (facts about a not-yet-created dir)."""
    p = os.path.abspath(os.fspath(path))
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def read_mounts(mounts_file: str = "/proc/mounts") -> list[MountInfo]:
    mounts = []
    with open(mounts_file) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                mounts.append(MountInfo(_unescape(parts[1]), _unescape(parts[0]), parts[2],
                                        tuple(parts[3].split(","))))
    return mounts


def mount_of(path: str | os.PathLike, mounts_file: str = "/proc/mounts") -> MountInfo | None:
    """The mount holding ``path``: the longest mount point that prefixes its real path; the last
    such line wins because a later mount on the same point hides the earlier one."""
    real = os.path.realpath(os.fspath(path))
    try:
        mounts = read_mounts(mounts_file)
    except OSError:
        return None
    best: MountInfo | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        if real == mp or real.startswith(mp + "/") or mp == "/":
            if best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/"):
                best = m
    return best


def disk_of_dev(dev: int) -> str | None:
    """The whole-disk name for a device number via sysfs (a partition maps to its parent disk);
    None for virtual filesystems (major 0: tmpfs, overlay, nfs...)."""
    major, minor = os.major(dev), os.minor(dev)
    if major == 0:
        return None
    sys_path = f"/sys/dev/block/{major}:{minor}"
    try:
        real = os.path.realpath(sys_path)
    except OSError:
        return f"{major}:{minor}"
    if not os.path.exists(real):
        return f"{major}:{minor}"
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return os.path.basename(real)


def disk_of_path(path: str | os.PathLike) -> str | None:
    return disk_of_dev(os.stat(existing_ancestor(path)).st_dev)


def read_swaps(swaps_file: str = "/proc/swaps") -> list[SwapEntry]:
    entries = []
    try:
        with open(swaps_file) as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) >= 5:
            entries.append(SwapEntry(_unescape(parts[0]), parts[1], int(parts[2]) * 1024, int(parts[3]) * 1024,
                                     int(parts[4])))
    return entries


def swap_disk(entry: SwapEntry) -> str | None:
    """The disk a swap area lives on: a partition's own device, or the device holding a swap file."""
    try:
        st = os.stat(entry.filename)
    except OSError:
        return None
    return disk_of_dev(st.st_rdev if entry.kind == "partition" else st.st_dev)


def swap_on_same_disk(path: str | os.PathLike, swaps: list[SwapEntry] | None = None) -> list[SwapEntry]:
    """Swap areas that live on the same physical disk as ``path`` (they compete for its bandwidth)."""
    disk = disk_of_path(path)
    if disk is None:
        return []
    return [s for s in (read_swaps() if swaps is None else swaps) if swap_disk(s) == disk]


def probe_direct_io(directory: str | os.PathLike) -> tuple[bool, str]:
    """Whether files in ``directory`` accept O_DIRECT: open, write and read one aligned 4 KiB block
    in a temporary file (some filesystems accept the open flag but refuse the I/O)."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    try:
        fd_tmp, tmp = tempfile.mkstemp(prefix=".lightning-nvme-odirect-", dir=os.fspath(directory))
    except OSError as e:
        return False, f"cannot create a probe file: {e.strerror}"
    os.close(fd_tmp)
    buf = mmap.mmap(-1, 4096)
    buf.write(b"\xa5" * 4096)
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_DIRECT)
        try:
            os.pwrite(fd, buf, 0)
            back = mmap.mmap(-1, 4096)
            if os.preadv(fd, [back], 0) != 4096 or back[:] != buf[:]:
                return False, "O_DIRECT read-back differed"
        finally:
            os.close(fd)
        return True, "O_DIRECT write and read of an aligned block succeeded"
    except OSError as e:
        return False, f"O_DIRECT refused: {e.strerror}"
    finally:
        os.remove(tmp)


def inspect(path: str | os.PathLike, *, probe_direct: bool = True) -> FsInfo:
    """Gather the facts for ``path`` (or its nearest existing ancestor when it does not exist yet)."""
    where = existing_ancestor(path)
    usage = shutil.disk_usage(where)
    if probe_direct and os.path.isdir(where) and os.access(where, os.W_OK):
        direct, detail = probe_direct_io(where)
    else:
        direct, detail = False, "not probed"
    return FsInfo(path=os.path.abspath(os.fspath(path)), mount=mount_of(where), free_bytes=usage.free,
                  total_bytes=usage.total, disk=disk_of_path(where), direct_io=direct, direct_io_detail=detail,
                  swap_same_disk=swap_on_same_disk(where))
