"""The NVMe flat store: one preallocated file per rank, an offset table, async fenced chunked I/O."""

from lightning_nvme.store.aligned import StagingPool, aligned_empty
from lightning_nvme.store.errors import (
    StoreError,
    StoreFormatError,
    StoreIOError,
    StoreLockedError,
    StoreSpaceError,
    StoreTimeoutError,
)
from lightning_nvme.store.flat_store import FlatStore
from lightning_nvme.store.handle import IOHandle
from lightning_nvme.store.layout import ALIGN, Layout, Region, align_up
from lightning_nvme.store.stats import IOStats

__all__ = ["ALIGN", "FlatStore", "IOHandle", "IOStats", "Layout", "Region", "StagingPool", "StoreError",
           "StoreFormatError", "StoreIOError", "StoreLockedError", "StoreSpaceError", "StoreTimeoutError",
           "aligned_empty", "align_up"]
