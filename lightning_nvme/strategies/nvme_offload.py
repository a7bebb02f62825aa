"""``NVMeOffloadStrategy`` (``Trainer(strategy="nvme_offload")``): optimizer states on a local SSD.

The strategy owns one ``FlatStore`` per process and wraps each optimizer from
``configure_optimizers`` in an ``OffloadedOptimizer`` (see ``OffloadMixin``). Timeline of one step::

    optimizer_step entered ──► reads of the first chunks start (prefetch)
    closure: forward + backward   (writes of step N-1 may still be in flight here)
    fence (per chunk): a chunk's read waits for its last write, then the optimizer's own update runs
    write-back of each chunk is issued asynchronously; the next chunks are already being read

Checkpoints are directories streamed chunk by chunk from the store (see ``lightning_nvme.checkpoint``),
committed atomically; ``trainer.fit(ckpt_path=...)`` streams them back, moments and step counts included.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

import lightning.pytorch as pl
from lightning_nvme import checkpoint as ckpt
from lightning_nvme.config import GiB, MiB, OffloadConfig
from lightning_nvme.strategies.offload_mixin import OffloadMixin


class NVMeOffloadStrategy(OffloadMixin, SingleDeviceStrategy):
    """Single-device training with optimizer state (and fp32 master weights of half-precision params)
    on a flat store on local disk. See ``OffloadConfig`` for the arguments."""

    strategy_name = "nvme_offload"

    def __init__(self, store_dir: str | None = None, *, chunk_bytes: int = 32 * MiB, io_chunk_bytes: int = 8 * MiB,
                 staging_bytes: int = 64 * MiB, prefetch_depth: int = 2, io_workers: int = 4, overlap: str = "step",
                 io_profile: str | None = None, min_free_bytes: int = 1 * GiB,
                 malloc_mmap_threshold: int | None = 8 * MiB, state_format: str = "exact",
                 master_format: str = "fp32",
                 device: torch.device | str | None = None, accelerator: pl.accelerators.Accelerator | None = None,
                 checkpoint_io: CheckpointIO | None = None, precision_plugin: Precision | None = None,
                 parallel_devices: list[torch.device] | None = None) -> None:
        super().__init__(device=device or "cpu", accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._init_offload(OffloadConfig(store_dir, chunk_bytes, io_chunk_bytes, staging_bytes, prefetch_depth,
                                         io_workers, overlap, io_profile, min_free_bytes,
                                         malloc_mmap_threshold, state_format, master_format))
        self._device_given = device is not None
        # Set by the accelerator connector when built from a string, so the device follows `accelerator=`.
        self.parallel_devices = parallel_devices

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and self.parallel_devices:
            return torch.device(self.parallel_devices[0])
        return self._root_device

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        if not self.offloaded:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        with self._open_store() as store:
            store.fence(durable=True)
            if self.is_global_zero:
                ckpt.save_streamed(checkpoint, os.fspath(filepath), self.offloaded)
