"""``IOProfile``: the store's I/O knobs (request size, worker count) tuned on one disk by ``doctor``.

Why a file: the best chunk size and queue depth depend on the SSD, its filesystem and its driver;
``lightning-nvme doctor PATH --write-profile FILE`` measures them once, and the strategy loads the
result with ``io_profile=FILE`` instead of guessing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

from lightning_nvme.checks import ConfigError
from lightning_nvme.fs import atomic
from lightning_nvme.settings import OffloadSettings, check_values

PROFILE_VERSION = 2
_RENAMED = {"chunk_bytes": "io_chunk_bytes", "num_workers": "io_workers"}  # version 1 names


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class IOProfile:
    """Tuned store settings and the figures they were chosen on.

    ``io_chunk_bytes``/``io_workers`` are the strategy arguments of the same names (and
    ``FlatStore(io_chunk_bytes=, io_workers=)``). Bandwidths are MiB/s measured on ``path``.
    """

    io_chunk_bytes: int
    io_workers: int
    stripe_bytes: int | None = None  # for a store striped over ``stripe_dirs`` (doctor DIR DIR ...)
    stripe_dirs: list[str] | None = None  # the directories measured together, in order
    disks: list[dict[str, Any]] | None = None  # each of stripe_dirs alone: path, write_mib_s, read_mib_s
    write_mib_s: float | None = None  # of the chosen setting, writes timed through fsync
    read_mib_s: float | None = None
    speedup_vs_default: float | None = None  # re-measured against the default in alternating pairs
    default: dict[str, int] | None = None  # the setting that ratio compares with
    path: str | None = None  # directory the figures were measured in
    fs_type: str | None = None
    direct_io: bool | None = None
    created_at: str = field(default_factory=_now)
    trials: list[dict[str, Any]] = field(default_factory=list)  # every measured candidate
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        check_values(io_chunk_bytes=self.io_chunk_bytes, io_workers=self.io_workers)
        if self.stripe_bytes is not None:
            check_values(stripe_bytes=self.stripe_bytes)

    def save(self, file: str | os.PathLike) -> None:
        """Write atomically (``atomic.write_json``), so a reader never sees half a profile."""
        atomic.write_json(os.fspath(file), asdict(self), indent=2)

    @classmethod
    def load(cls, file: str | os.PathLike, *, key: str = "io_profile") -> IOProfile:
        """Read a profile, raising ``ConfigError`` naming ``key`` and the file when it is unusable.
        Unknown fields (from a newer version) are ignored."""
        file = os.fspath(file)
        try:
            with open(file) as f:
                data = json.load(f)
        except OSError as e:
            raise ConfigError(key, f"cannot read I/O profile {file}: {e.strerror}. Fix: create it with "
                                   f"`lightning-nvme doctor STORE_DIR --write-profile {file}`, or unset {key}.") from e
        except ValueError as e:
            raise ConfigError(key, f"I/O profile {file} is not valid JSON ({e}). Fix: regenerate it with "
                                   f"`lightning-nvme doctor STORE_DIR --write-profile {file}`.") from e
        if isinstance(data, dict):
            data = {_RENAMED.get(k, k): v for k, v in data.items()}
        if not isinstance(data, dict) or "io_chunk_bytes" not in data or "io_workers" not in data:
            raise ConfigError(key, f"I/O profile {file} lacks io_chunk_bytes/io_workers. Fix: regenerate it with "
                                   f"`lightning-nvme doctor STORE_DIR --write-profile {file}`.")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except ConfigError as e:
            raise ConfigError(key, f"I/O profile {file}: {e}") from e


def io_request(config: OffloadSettings) -> tuple[int, int, int]:
    """``(io_chunk_bytes, io_workers, stripe_bytes)`` of a strategy: from its tuned ``io_profile`` if given (a
    profile of one disk leaves ``stripe_bytes`` to the argument), else its arguments."""
    if config.io_profile:
        profile = IOProfile.load(config.io_profile)
        return profile.io_chunk_bytes, profile.io_workers, profile.stripe_bytes or config.stripe_bytes
    return config.io_chunk_bytes, config.io_workers, config.stripe_bytes


def combined(write_mib_s: float, read_mib_s: float) -> float:
    """MiB/s over the bytes moved both ways (the harmonic mean: a step writes and reads the same bytes)."""
    return 2 / (1 / write_mib_s + 1 / read_mib_s)


def slowest_disk(speeds: list[float]) -> tuple[int, float]:
    """Striped round-robin, every disk moves the same share, so the set delivers about ``N x slowest``: the
    slowest disk's index, and the fraction of the disks' summed bandwidth that costs (``1 - N x slowest / sum``)."""
    i = min(range(len(speeds)), key=speeds.__getitem__)
    return i, 1 - len(speeds) * speeds[i] / sum(speeds)


def slowest_disk_text(dirs: Sequence[str], speeds: list[float], source: str = "") -> str:
    """What the slowest of ``dirs`` (combined MiB/s ``speeds``, measured ``source``) costs a striped store: the one
    sentence the doctor prints and the strategy warns with (they add ``SLOWEST_DISK_FIX`` where it costs enough)."""
    i, cost = slowest_disk(speeds)
    return (f"the slowest disk {dirs[i]} ({speeds[i]:.0f} MiB/s{source}) sets the pace of the striped store: about "
            f"{len(dirs)} x {speeds[i]:.0f} = {len(dirs) * speeds[i]:.0f} MiB/s of the {sum(speeds):.0f} MiB/s the "
            f"disks sum to ({cost:.0%} lost to it)")


# what to do about a slowest disk that costs enough to be worth a warning
SLOWEST_DISK_FIX = ". Fix: leave it out of store_dir if the others are enough."


def slowest_disk_note(profile: IOProfile, dirs: list[str], min_cost: float = 0.1) -> str | None:
    """What the slowest of ``dirs`` costs by the profile's measurements, when over ``min_cost``; None when it costs
    less, or when the profile did not measure exactly these directories."""
    measured = {d.get("path"): d for d in profile.disks or []}
    if len(dirs) < 2 or any(os.path.abspath(d) not in measured for d in dirs):
        return None
    rows = [measured[os.path.abspath(d)] for d in dirs]
    speeds = [combined(r["write_mib_s"], r["read_mib_s"]) for r in rows]
    if slowest_disk(speeds)[1] < min_cost:
        return None
    return slowest_disk_text(dirs, speeds, " by the I/O profile") + SLOWEST_DISK_FIX
