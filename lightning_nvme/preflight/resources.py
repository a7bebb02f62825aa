"""Checks that run before training starts, so a bad path or a too-small disk fails in the first
second with one message naming the config key and the fix, not hours later in a background thread.

``check_store_dir`` validates the store directory (exists or can be created under an existing
parent, writable, enough free space for the planned store plus the safety margin, O_DIRECT,
not memory-backed, not remote, not shared by two ranks of one host). The strategy's numeric arguments
are checked where they are defined, in ``lightning_nvme.settings``.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import socket
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_nvme.checks import ConfigError
from lightning_nvme.constants import ALIGN, GiB
from lightning_nvme.fs import fsinfo
from lightning_nvme.memory import available_host_memory
from lightning_nvme.store.manifest import MAGIC as STORE_MAGIC


class PreflightWarning(UserWarning):
    """A store directory that works but defeats the purpose (RAM-backed) or risks speed/safety (remote)."""


@dataclass
class PreflightReport:
    """What preflight found about the store directory."""

    path: str
    fs_type: str | None
    mount_point: str | None
    mount_options: tuple[str, ...]
    free_bytes: int
    needed_bytes: int
    min_free_bytes: int
    direct_io: bool
    direct_io_detail: str
    reclaimable_bytes: int = 0  # held by stale stores in the dir that a new store replaces
    warnings: list[str] = field(default_factory=list)

    @property
    def spare_bytes(self) -> int:
        """Free bytes left after the store and the safety margin (negative never gets past preflight)."""
        return self.free_bytes + self.reclaimable_bytes - self.needed_bytes - self.min_free_bytes


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# Directories whose children are usually mount points: a missing /mnt/nvme0 means an unmounted disk.
MOUNT_ROOTS = ("/", "/mnt", "/media", "/run/media", "/Volumes")


def ensure_dir(path: str, key: str) -> None:
    """Create the store dir (and missing parents), except when the first missing directory would sit
    directly in a mount root such as ``/mnt``: ``/mnt/nvme0`` missing usually means the disk is not
    mounted, and creating it would silently put the store on the root disk."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(key, f"{path} exists and is not a directory. Fix: point {key} at a directory.")
        return
    missing = path.rstrip("/")
    while not os.path.isdir(os.path.dirname(missing) or "/"):
        missing = os.path.dirname(missing)
    parent = os.path.dirname(missing) or "/"
    if parent in MOUNT_ROOTS:
        raise ConfigError(key, f"{missing} does not exist (is the disk mounted?), so {path} cannot be created "
                               f"there. Fix: mount the disk or create it (mkdir -p {missing}), or set {key} to an "
                               f"existing directory on a local SSD.")
    try:
        os.makedirs(path, exist_ok=True)  # ranks sharing a dir create it concurrently
    except OSError as e:
        raise ConfigError(key, f"cannot create {path}: {e.strerror}. Fix: create it with write permission for this "
                               f"user, or set {key} to a writable directory.") from e


def check_writable(path: str, key: str) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".lightning-nvme-preflight-", dir=path)
        try:
            os.write(fd, b"\0" * ALIGN)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise ConfigError(key, f"{path} is not writable ({e.strerror}). Fix: make it writable for this user "
                               f"(or remount it read-write), or set {key} to a writable directory.") from e


def stale_store_bytes(path: str) -> int:
    """Disk bytes held by lightning-nvme store files in ``path`` whose lock no live process holds,
    e.g. left by a crashed run. A new store of the same name truncates and replaces such a file, so
    on a nearly full disk a restart must count them as free, not refuse."""
    total = 0
    for manifest in glob.glob(os.path.join(glob.escape(path), "*.json")):
        data_file = manifest[:-5] + ".bin"
        try:
            with open(manifest) as f:
                if json.load(f).get("magic") != STORE_MAGIC:
                    continue
            size = os.stat(data_file).st_blocks * 512
        except (OSError, ValueError, AttributeError):
            continue
        try:
            fd = os.open(data_file + ".lock", os.O_RDWR)
        except FileNotFoundError:  # no lock file: no live holder
            total += size
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            total += size
        except OSError:  # locked by a live run: not ours to reclaim
            pass
        finally:
            os.close(fd)
    return total


def _host_and_dir(value: str | tuple[str, str]) -> tuple[str, str]:
    host, d = (socket.gethostname(), value) if isinstance(value, (str, os.PathLike)) else value
    return host, os.path.realpath(os.fspath(d))


def check_rank_dirs(rank_dirs: Mapping[int, str | tuple[str, str]] | Sequence[str | tuple[str, str]],
                    key: str = "store_dir") -> None:
    """Refuse two ranks on one host using the same store directory. Values are a directory (taken to
    be on this host) or ``(hostname, directory)``, e.g. gathered from every rank."""
    items = rank_dirs.items() if isinstance(rank_dirs, Mapping) else enumerate(rank_dirs)
    seen: dict[tuple[str, str], int] = {}
    for rank, value in items:
        where = _host_and_dir(value)
        if where in seen:
            raise ConfigError(key, f"ranks {seen[where]} and {rank} on host {where[0]} both use {where[1]}. Two "
                                   f"ranks must not share one store directory. Fix: give each rank its own "
                                   f"directory, e.g. {key}=/mnt/nvme/run/rank{{rank}} (one per process).")
        seen[where] = rank


def check_store_dir(path: str | os.PathLike | None, needed_bytes: int, *, min_free_bytes: int = 0,
                    key: str = "store_dir",
                    rank_dirs: Mapping[int, str | tuple[str, str]] | Sequence[str | tuple[str, str]] | None = None,
                    ) -> PreflightReport:
    """Validate ``path`` as the home of a store of ``needed_bytes`` plus a free-space margin.

    Raises ``ConfigError`` naming ``key`` and the fix; warns (``PreflightWarning``) for RAM-backed or
    network filesystems. Creates ``path`` if its parent exists.
    """
    if path is None or not os.fspath(path):
        raise ConfigError(key, f"no store directory given. Fix: set {key} to a directory on a local SSD.")
    if needed_bytes < 0:
        raise ConfigError(key, f"planned store size must be >= 0 bytes, got {needed_bytes}")
    if min_free_bytes < 0:
        raise ConfigError("min_free_bytes", f"must be >= 0, got {min_free_bytes}. Fix: use 0 to disable the margin.")
    path = os.path.abspath(os.fspath(path))
    if rank_dirs is not None:
        check_rank_dirs(rank_dirs, key)
    ensure_dir(path, key)
    check_writable(path, key)
    info = fsinfo.inspect(path)
    mount = info.mount
    where = f"{mount.mount_point} ({mount.fs_type})" if mount else "its filesystem"
    reclaimable = stale_store_bytes(path)
    available = info.free_bytes + reclaimable
    if needed_bytes + min_free_bytes > available:
        short = needed_bytes + min_free_bytes - available
        stale = f" (plus {reclaimable} bytes of stale stores it would replace)" if reclaimable else ""
        raise ConfigError(key, f"{path} cannot hold the planned store: it needs {needed_bytes} bytes "
                               f"({_gib(needed_bytes)}) plus the safety margin min_free_bytes={min_free_bytes} "
                               f"({_gib(min_free_bytes)}), but only {info.free_bytes} bytes ({_gib(info.free_bytes)}) "
                               f"are free on {where}{stale}. Fix: free at least {short} bytes ({_gib(short)}), set "
                               f"{key} to a larger local SSD, or lower min_free_bytes.")
    report = PreflightReport(path, mount.fs_type if mount else None, mount.mount_point if mount else None,
                             mount.options if mount else (), info.free_bytes, needed_bytes, min_free_bytes,
                             info.direct_io, info.direct_io_detail, reclaimable)
    if mount is not None and mount.is_memory:
        report.warnings.append(f"{key}={path} is on {mount.fs_type} ({mount.mount_point}), which lives in RAM: "
                               f"offloading there saves no memory. Fix: point {key} at a local SSD.")
    if mount is not None and mount.is_network:
        report.warnings.append(f"{key}={path} is on a network/FUSE filesystem ({mount.fs_type} at "
                               f"{mount.mount_point}): expect low bandwidth, high latency and weaker durability. "
                               f"Fix: point {key} at a local SSD.")
    for w in report.warnings:
        warnings.warn(w, PreflightWarning, stacklevel=2)
    return report


@dataclass
class CheckpointPlan:
    """Checkpoints a run will keep in ``directory``: ``kept`` of ``bytes_each`` at once (a save writes the new one
    before it deletes the one it replaces, so the caller counts that one too)."""

    directory: str
    kept: int
    bytes_each: int


def checkpoint_bytes_on_disk(directory: str) -> int:
    """Bytes the checkpoints already in ``directory`` occupy (``*.ckpt`` files and their ``.optim`` trees): the
    checkpoints a resumed run replaces, so they count toward what it keeps."""
    total = 0
    for entry in os.listdir(directory) if os.path.isdir(directory) else []:
        if not (entry.endswith(".ckpt") or entry.endswith(".ckpt.optim")):
            continue
        path = os.path.join(directory, entry)
        files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
        total += sum(os.lstat(f).st_blocks * 512 for f in files)
    return total


def check_checkpoint_space(store_dir: str, store_bytes: int, plans: Sequence[CheckpointPlan], *,
                           min_free_bytes: int = 0, key: str = "ModelCheckpoint(save_top_k=...)") -> dict[str, int]:
    """Refuse a run whose store plus the checkpoints it keeps cannot fit, per filesystem, before training.
    Returns the bytes needed per mount point. A reflink checkpoint needs the same space in the end: its extents
    stay with the checkpoint once training rewrites the store (docs/checkpoints.md)."""
    needs: dict[int, tuple[str, list[tuple[str, int]]]] = {}

    def need(path: str, what: str, nbytes: int) -> None:
        where = fsinfo.existing_ancestor(path)
        needs.setdefault(os.stat(where).st_dev, (where, []))[1].append((what, nbytes))

    need(store_dir, f"the store in {store_dir}", store_bytes - stale_store_bytes(store_dir))
    store_dev = os.stat(fsinfo.existing_ancestor(store_dir)).st_dev
    for plan in plans:
        held = checkpoint_bytes_on_disk(plan.directory)
        need(plan.directory, f"{plan.kept} checkpoints of {plan.bytes_each} bytes in {plan.directory}" + (
             f" ({held} bytes of them there already)" if held else ""), max(0, plan.kept * plan.bytes_each - held))
    out = {}
    for dev, (where, items) in needs.items():
        free = shutil.disk_usage(where).free
        margin = min_free_bytes if dev == store_dev else 0
        needed = sum(n for _, n in items) + margin
        mount = fsinfo.mount_of(where)
        name = mount.mount_point if mount else where
        out[name] = needed
        if needed > free:
            parts = " + ".join(f"{what}: {n} bytes ({_gib(n)})" for what, n in items)
            extra = f" + min_free_bytes={margin}" if margin else ""
            raise ConfigError(key, f"{name} cannot hold this run: it needs {needed} bytes ({_gib(needed)}) = "
                                   f"{parts}{extra}, but {free} bytes ({_gib(free)}) are free. Fix: free "
                                   f"{needed - free} bytes, keep fewer checkpoints (save_top_k), put the checkpoints "
                                   "on another disk (ModelCheckpoint(dirpath=...)), or use a larger disk.")
    return out


def check_host_memory_budget(budget: int, setting: int | str, available: int | None = None) -> None:
    """Refuse a ``host_memory_budget`` above the memory available now: the shelf would push the run (or its
    neighbours) into swap or the OOM killer instead of saving disk I/O."""
    free = available_host_memory() if available is None else available
    if budget > free:
        raise ConfigError("host_memory_budget", f"{budget} bytes ({_gib(budget)}) asked, but only {free} bytes "
                                                f"({_gib(free)}) of memory are available now (MemAvailable). Fix: "
                                                f"set host_memory_budget <= {free}, or \"auto\", or 0.")


def device_free_bytes(device: torch.device) -> int:
    """Memory free on a CUDA device now (``torch.cuda.mem_get_info``)."""
    return int(torch.cuda.mem_get_info(device)[0])


def check_device_memory_budget(budget: int, device: torch.device, free: int | None = None) -> None:
    """Refuse a ``device_memory_budget`` above the device memory free now (after the model's other parameters
    went there): the blocks kept would leave no room for activations and gradients, or not fit at all."""
    free = device_free_bytes(device) if free is None else free
    if budget > free:
        raise ConfigError("device_memory_budget", f"{budget} bytes ({_gib(budget)}) asked, but only {free} bytes "
                                                  f"({_gib(free)}) of {device} are free now (torch.cuda.mem_get_info), "
                                                  "and activations and gradients need room too. Fix: set "
                                                  f"device_memory_budget well below {free}, or 0.")


def device_of(path: str | os.PathLike) -> str:
    """The disk ``path`` is on (``fsinfo.disk_of_path``), or its filesystem's device number where there is no
    block device (tmpfs, overlay): two paths with the same answer share their bandwidth."""
    disk = fsinfo.disk_of_path(path)
    if disk is not None:
        return disk
    dev = os.stat(fsinfo.existing_ancestor(path)).st_dev
    return f"dev {os.major(dev)}:{os.minor(dev)}"


def shared_devices(roles: Mapping[str, Sequence[str]]) -> list[str]:
    """One warning per device that holds two of the given directories (``roles``: a name such as
    ``"store_dir stripe 2"`` or ``"checkpoints"`` for each list of directories): striping over them, or
    giving them separate roles, gains no bandwidth."""
    by_device: dict[str, list[str]] = {}
    for role, dirs in roles.items():
        for i, d in enumerate(dirs):
            label = role if len(dirs) == 1 else f"{role} stripe {i + 1}"
            by_device.setdefault(device_of(d), []).append(f"{label} ({os.path.abspath(d)})")
    return [f"{' and '.join(users)} are on the same device {dev}: they share its bandwidth, so separating them gains "
            f"nothing. Fix: put each on its own SSD." for dev, users in by_device.items() if len(users) > 1]


def check_store_dirs(dirs: Sequence[str], needed_bytes: int, stripe_bytes: int, *, min_free_bytes: int = 0,
                     key: str = "store_dir", roles: Mapping[str, Sequence[str]] | None = None) -> list[PreflightReport]:
    """``check_store_dir`` for each directory of a (possibly striped) store, each holding its share of
    ``needed_bytes``; then a ``PreflightWarning`` for each device that two stripes (or a stripe and another
    role in ``roles``, e.g. checkpoints) share."""
    if len(dirs) == 1:
        return [check_store_dir(dirs[0], needed_bytes, min_free_bytes=min_free_bytes, key=key)]
    share = -(-needed_bytes // len(dirs)) + stripe_bytes + ALIGN  # round-robin: one unit more at most, a header
    reports = [check_store_dir(d, share, min_free_bytes=min_free_bytes, key=key) for d in dirs]
    for w in shared_devices({key: list(dirs), **(roles or {})}):
        warnings.warn(w, PreflightWarning, stacklevel=2)
    return reports
