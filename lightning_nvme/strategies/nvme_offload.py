"""``NVMeOffloadStrategy`` (``Trainer(strategy="nvme_offload")``): optimizer states on a local SSD.

The strategy owns one ``FlatStore`` per process and wraps each optimizer from
``configure_optimizers`` in an ``OffloadedOptimizer``. Timeline of one step::

    optimizer_step entered ──► reads of the first chunks start (prefetch)
    closure: forward + backward   (writes of step N-1 may still be in flight here)
    fence (per chunk): a chunk's read waits for its last write, then the optimizer's own update runs
    write-back of each chunk is issued asynchronously; the next chunks are already being read

Checkpoints are directories streamed chunk by chunk from the store (see ``lightning_nvme.checkpoint``),
committed atomically; ``trainer.fit(ckpt_path=...)`` streams them back, moments and step counts included.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_nvme import checkpoint as ckpt
from lightning_nvme.config import MiB, GiB, OffloadConfig
from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.store import FlatStore

log = logging.getLogger(__name__)


class NVMeOffloadStrategy(SingleDeviceStrategy):
    """Single-device training with optimizer state (and fp32 master weights of half-precision params)
    on a flat store on local disk. See ``OffloadConfig`` for the arguments."""

    strategy_name = "nvme_offload"

    def __init__(self, store_dir: str | None = None, *, chunk_bytes: int = 32 * MiB, io_chunk_bytes: int = 8 * MiB,
                 staging_bytes: int = 64 * MiB, prefetch_depth: int = 2, io_workers: int = 4, overlap: str = "step",
                 io_profile: str | None = None, min_free_bytes: int = 1 * GiB,
                 device: torch.device | str | None = None, accelerator: pl.accelerators.Accelerator | None = None,
                 checkpoint_io: CheckpointIO | None = None, precision_plugin: Precision | None = None,
                 parallel_devices: list[torch.device] | None = None) -> None:
        super().__init__(device=device or "cpu", accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.config = OffloadConfig(store_dir, chunk_bytes, io_chunk_bytes, staging_bytes, prefetch_depth,
                                    io_workers, overlap, io_profile, min_free_bytes)
        self._device_given = device is not None
        # Set by the accelerator connector when built from a string, so the device follows `accelerator=`.
        self.parallel_devices = parallel_devices
        self.nvme_store: FlatStore | None = None
        self.offloaded: list[OffloadedOptimizer] = []

    # ---- device -------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and self.parallel_devices:
            return torch.device(self.parallel_devices[0])
        return self._root_device

    # ---- setup / teardown --------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.optimizers:
            self._check_overlap_supported(trainer)
            self._offload_optimizers(trainer)

    def _check_overlap_supported(self, trainer: pl.Trainer) -> None:
        if self.config.overlap != "backward":
            return
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").lower()
        if trainer.gradient_clip_val and "norm" in algorithm:
            raise ValueError("nvme_offload: overlap='backward' updates each chunk as its gradients become final, "
                             "before the global gradient norm is known, so norm clipping "
                             f"(gradient_clip_val={trainer.gradient_clip_val}) would change the maths. Use "
                             "overlap='step', or gradient_clip_algorithm='value'.")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError("nvme_offload: overlap='backward' cannot be used with a loss scaler (precision='16-mixed'): "
                             "the inf check needs all gradients first. Use overlap='step' or precision='bf16-mixed'.")

    def _offload_optimizers(self, trainer: pl.Trainer) -> None:
        store_dir = self.config.resolve_store_dir(trainer.default_root_dir)
        io = self.config.io_settings()
        self.nvme_store = FlatStore(store_dir, rank=self.global_rank, chunk_bytes=io.chunk_bytes,
                                    num_workers=io.num_workers, pool_bytes=max(self.config.staging_bytes, io.chunk_bytes),
                                    min_free_bytes=self.config.min_free_bytes)
        clip_value = None
        if self.config.overlap == "backward" and trainer.gradient_clip_val:
            clip_value = float(trainer.gradient_clip_val)
        self.offloaded = [
            OffloadedOptimizer(opt, self.nvme_store, name=f"opt{i}", chunk_bytes=self.config.chunk_bytes,
                               prefetch_depth=self.config.prefetch_depth, overlap=self.config.overlap,
                               clip_value=clip_value)
            for i, opt in enumerate(self.optimizers)
        ]
        state = sum(o.state_bytes for o in self.offloaded)
        resident = sum(o.ring.total_bytes for o in self.offloaded) + self.nvme_store.pool_bytes
        rank_zero_info(f"nvme_offload: optimizer state store {self.nvme_store.path} ({self.nvme_store.mode} I/O): "
                       f"{state / GiB:.2f} GiB on disk in {sum(len(o.chunks) for o in self.offloaded)} chunks; "
                       f"{resident / MiB:.0f} MiB of resident buffers; overlap={self.config.overlap}")

    @override
    def teardown(self) -> None:
        """Drain I/O, stop the workers and release the store's lock. The store file and the offloaded
        optimizers' bookkeeping stay, so ``trainer.save_checkpoint`` still works after ``fit``."""
        try:
            for off in self.offloaded:
                off.close()
            if self.nvme_store is not None:
                self.nvme_store.close()
        finally:
            self.nvme_store = None
            super().teardown()

    @contextmanager
    def _open_store(self) -> Iterator[FlatStore]:
        """The live store, or (after teardown) the same store file reopened and checked for the call."""
        if self.nvme_store is not None:
            yield self.nvme_store
            return
        first = self.offloaded[0].store
        store = FlatStore(first.directory, rank=self.global_rank, chunk_bytes=first.chunk_bytes, reopen=True)
        try:
            for off in self.offloaded:
                off.attach(store)
            yield store
        finally:
            store.close()

    def offloaded_for(self, optimizer: Optimizer | LightningOptimizer) -> OffloadedOptimizer | None:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return next((o for o in self.offloaded if o.optimizer is optimizer), None)

    # ---- the step ---------------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        off = self.offloaded_for(optimizer)
        if off is not None:
            off.prefetch()  # reads overlap the closure's forward and backward
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        off = self.offloaded_for(optimizer)
        if off is None:
            return super().optimizer_state(optimizer)
        return ckpt.optimizer_placeholder(off, self.offloaded.index(off))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        if not self.offloaded:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        with self._open_store() as store:
            store.fence(durable=True)
            if self.is_global_zero:
                ckpt.save_streamed(checkpoint, os.fspath(filepath), self.offloaded)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if ckpt.is_streamed(checkpoint_path):
            return ckpt.load_streamed(os.fspath(checkpoint_path))
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.offloaded:
            return super().load_optimizer_state_dict(checkpoint)
        for off, state in zip(self.offloaded, checkpoint["optimizer_states"]):
            ckpt.restore_optimizer(off, state, checkpoint)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero and ckpt.is_streamed(filepath):
            ckpt.remove_streamed(os.fspath(filepath))
        else:
            super().remove_checkpoint(filepath)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0])
