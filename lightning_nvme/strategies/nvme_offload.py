"""``NVMeOffloadStrategy`` (``Trainer(strategy="nvme_offload")``): optimizer states on a local SSD.

The strategy owns one ``FlatStore`` per process and wraps each optimizer from
``configure_optimizers`` in an ``OffloadedOptimizer`` (see ``OffloadStrategy``). Timeline of one step::

    optimizer_step entered ──► reads of the first chunks start (prefetch)
    closure: forward + backward   (writes of step N-1 may still be in flight here)
    fence (per chunk): a chunk's read waits for its last write, then the optimizer's own update runs
    write-back of each chunk is issued asynchronously; the next chunks are already being read

A checkpoint is one file that Lightning's loaders open, with the optimizer state streamed chunk by chunk
from the store into ``<file>.optim/`` beside it, committed atomically (see ``lightning_nvme.checkpoint``);
``trainer.fit(ckpt_path=...)`` streams it back, moments and step counts included.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_nvme import checkpoint as ckpt
from lightning_nvme.checkpoint.streamed import write_optimizer
from lightning_nvme.settings import OffloadSettings, with_settings
from lightning_nvme.strategies.offload import OffloadStrategy


@with_settings(OffloadSettings)
class NVMeOffloadStrategy(OffloadStrategy, SingleDeviceStrategy):
    """Single-device training with optimizer state (and fp32 master weights of half-precision params)
    on a flat store on local disk.

    Takes the arguments listed below (each defined once in ``lightning_nvme.settings.OffloadSettings``)
    and ``device``, ``accelerator``, ``checkpoint_io``, ``precision_plugin`` as Lightning's
    ``SingleDeviceStrategy`` does."""

    strategy_name = "nvme_offload"

    def __init__(self, store_dir: str | None = None, *, device: torch.device | str | None = None,
                 accelerator: pl.accelerators.Accelerator | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, parallel_devices: list[torch.device] | None = None,
                 **settings: Any) -> None:
        config = OffloadSettings.from_arguments(self.strategy_name, {"store_dir": store_dir, **settings})
        super().__init__(device=device or "cpu", accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._init_offload(config)
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
    def _save_streamed(self, checkpoint: dict[str, Any], path: str) -> None:
        with self._open_store() as store:
            store.fence(durable=True)
            ckpt.paired.save(checkpoint, path, lambda directory, save_id: [
                write_optimizer(off, directory, i, save_id) for i, off in enumerate(self.offloaded)])
