"""Validated settings of the offload strategies: each bad value is refused with the key and the fix."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightning_nvme.optim import OVERLAP_MODES
from lightning_nvme.optim.state_format import MASTER_FORMATS, STATE_FORMATS, StateFormat
from lightning_nvme.store import ALIGN

MiB = 1 << 20
GiB = 1 << 30
STORE_DIR_ENV = "LIGHTNING_NVME_STORE_DIR"


@dataclass(frozen=True)
class IOSettings:
    chunk_bytes: int
    num_workers: int


@dataclass(frozen=True)
class OffloadConfig:
    store_dir: str | None = None
    chunk_bytes: int = 32 * MiB
    io_chunk_bytes: int = 8 * MiB
    staging_bytes: int = 64 * MiB
    prefetch_depth: int = 2
    io_workers: int = 4
    overlap: str = "step"
    io_profile: str | None = None
    min_free_bytes: int = 1 * GiB
    malloc_mmap_threshold: int | None = 8 * MiB
    state_format: str = "exact"
    master_format: str = "fp32"

    def __post_init__(self) -> None:
        def fail(key: str, why: str) -> None:
            raise ValueError(f"nvme_offload: invalid {key}={getattr(self, key)!r}: {why}")

        for key in ("chunk_bytes", "io_chunk_bytes", "staging_bytes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(key, "must be a positive integer number of bytes")
        if self.io_chunk_bytes % ALIGN:
            fail("io_chunk_bytes", f"must be a multiple of {ALIGN} (O_DIRECT alignment), e.g. {8 * MiB}")
        if self.staging_bytes < self.io_chunk_bytes:
            fail("staging_bytes", f"must hold at least one I/O chunk (io_chunk_bytes={self.io_chunk_bytes})")
        if self.chunk_bytes < ALIGN:
            fail("chunk_bytes", f"must be at least {ALIGN} bytes; 16-64 MiB is typical")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 1:
            fail("prefetch_depth", "must be an integer >= 1")
        if not isinstance(self.io_workers, int) or self.io_workers < 1:
            fail("io_workers", "must be an integer >= 1")
        if self.overlap not in OVERLAP_MODES:
            fail("overlap", f"must be one of {OVERLAP_MODES}")
        if self.state_format not in STATE_FORMATS:
            fail("state_format", f"must be one of {STATE_FORMATS} (see docs/state_format.md)")
        if self.master_format not in MASTER_FORMATS:
            fail("master_format", f"must be one of {MASTER_FORMATS} (see docs/state_format.md)")
        if self.malloc_mmap_threshold is not None and (not isinstance(self.malloc_mmap_threshold, int)
                                                       or self.malloc_mmap_threshold < 4096):
            fail("malloc_mmap_threshold", "must be None (leave the allocator alone) or >= 4096 bytes")
        if not isinstance(self.min_free_bytes, int) or self.min_free_bytes < 0:
            fail("min_free_bytes", "must be a non-negative integer number of bytes")
        if self.io_profile is not None and not os.path.isfile(self.io_profile):
            fail("io_profile", "file not found; create one with `lightning-nvme doctor PATH --write-profile FILE`")

    @property
    def state_format_spec(self) -> StateFormat:
        return StateFormat(self.state_format, self.master_format)

    def resolve_store_dir(self, default_root_dir: str) -> str:
        """``store_dir``, else ``$LIGHTNING_NVME_STORE_DIR``, else ``<default_root_dir>/nvme_store``."""
        return os.path.abspath(self.store_dir or os.environ.get(STORE_DIR_ENV) or
                               os.path.join(default_root_dir, "nvme_store"))

    def io_settings(self) -> IOSettings:
        """I/O request size and worker count: from the tuned ``io_profile`` if given, else the arguments."""
        if self.io_profile:
            from lightning_nvme.io_profile import IOProfile

            profile = IOProfile.load(self.io_profile)
            return IOSettings(profile.chunk_bytes, profile.num_workers)
        return IOSettings(self.io_chunk_bytes, self.io_workers)
