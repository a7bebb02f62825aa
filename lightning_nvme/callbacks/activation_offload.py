"""``NVMeActivationOffload``: checkpointed activations to the NVMe flat store during the training step.

The Lightning side only decides *when*: the saved-tensor hooks are installed at batch start, removed
just before backward (so recomputation in backward is never offloaded), and everything is drained and
released at batch end, or on an exception. *What* and *how* live in
:class:`~lightning_nvme.activations.ActivationOffloader`.

Store: with ``strategy="nvme_offload"`` the strategy's store is shared (the callback adds its own
``activations.N`` regions to it) unless ``store_dir`` names other directories (another disk: activations then
do not compete with the optimizer state for bandwidth); otherwise the callback opens its own store file
``activations-rank{R}.bin`` in ``store_dir`` (one directory or several, striped) and closes it at teardown.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_nvme.activations import ActivationOffloader, ActivationSettings, OffloadStats, ResidencyMeter
from lightning_nvme.activations.device import release_pinned_cache
from lightning_nvme.checks import boolean, check_fields, count, directories, nbytes, resolve_store_dirs, setting
from lightning_nvme.constants import ALIGN, STORE_DIR_ENV
from lightning_nvme.preflight.resources import PreflightWarning, shared_devices
from lightning_nvme.settings import from_arguments, with_settings
from lightning_nvme.store import FlatStore
from lightning_nvme.store.flat_store import IO_CHUNK_BYTES, IO_WORKERS, STAGING_BYTES


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationOffloadSettings(ActivationSettings):
    """The callback's arguments: the offloader's (``ActivationSettings``) and those of its own store."""

    store_dir: str | list[str] | None = setting(
        None, f"Directory (or directories, striped) of the callback's own store; None, or the strategy's own "
              f"``store_dir``: the strategy's store is shared when it has one; None without one: "
              f"``${STORE_DIR_ENV}``, else ``<default_root_dir>/nvme_store``.", directories)
    io_workers: int = setting(IO_WORKERS, "I/O threads of the callback's own store.", count(1, "1-8 (4 is a good default)"))
    io_chunk_bytes: int = setting(
        IO_CHUNK_BYTES, "Size of one disk request of the callback's own store.",
        nbytes(ALIGN, aligned=True, typical=str(IO_CHUNK_BYTES)))
    staging_bytes: int = setting(
        STAGING_BYTES, "Staging pool of the callback's own store (tensors that cannot be written in place).",
        nbytes(1, typical=str(STAGING_BYTES)))
    min_free_bytes: int = setting(
        0, "Free space that must remain on the SSD after the callback's own store grows.",
        nbytes(0, typical="0 to disable the margin"))
    enabled: bool = setting(True, "When false the callback does nothing (handy to compare runs).", boolean)

    def __post_init__(self) -> None:
        check_fields(self)


@with_settings(ActivationOffloadSettings)
class NVMeActivationOffload(Callback):
    """Keep the activations saved for backward on a local SSD instead of in memory.

    Takes the arguments listed below, each defined once in ``ActivationOffloadSettings`` (this module) and
    ``lightning_nvme.activations.ActivationSettings``; a bad value raises ``ConfigError`` naming it."""

    config: ActivationOffloadSettings

    def __init__(self, store_dir: str | list[str] | None = None, **settings: Any) -> None:
        self.config = from_arguments(ActivationOffloadSettings, type(self).__name__,
                                     {"store_dir": store_dir, **settings})
        self.enabled = self.config.enabled  # the switch: may be flipped between steps (A/B runs, benchmarks)
        self.meter = ResidencyMeter()
        self._store: FlatStore | None = None
        self._owns_store = False
        self.offloader: ActivationOffloader | None = None
        self.last_step_stats = OffloadStats()  # what the last training step moved and waited for
        self.total_stats = OffloadStats()  # summed over every step of every fit

    @property
    def nvme_store(self) -> FlatStore | None:
        """The store activations go to: the strategy's, or the callback's own (None before fit starts)."""
        return self._store


    # ---- store --------------------------------------------------------------------------------
    def _connect(self, trainer: pl.Trainer) -> ActivationOffloader:
        shared = getattr(trainer.strategy, "nvme_store", None)
        c = self.config
        dirs = resolve_store_dirs(c.store_dir, trainer.default_root_dir)
        if shared is not None and (c.store_dir is None or dirs == shared.directories):
            store, owned = shared, False
        else:
            if shared is not None:  # a disk of its own was asked for: say when it is not one
                for w in shared_devices({"store_dir": shared.directories, f"{type(self).__name__} store_dir": dirs}):
                    warnings.warn(w, PreflightWarning, stacklevel=2)
            store = FlatStore(dirs, rank=trainer.global_rank,
                              name=f"activations-rank{trainer.global_rank}", io_chunk_bytes=c.io_chunk_bytes,
                              io_workers=c.io_workers, staging_bytes=c.staging_bytes, min_free_bytes=c.min_free_bytes)
            owned = True
        self._store, self._owns_store = store, owned
        self.offloader = ActivationOffloader(store, self.config, meter=self.meter)
        return self.offloader

    def _disconnect(self, *, clean: bool, exc: BaseException | None = None) -> None:
        offloader, store, owned = self.offloader, self._store, self._owns_store
        self.offloader = None
        self._store, self._owns_store = None, False
        try:
            if offloader is not None:
                offloader.end_step() if clean else offloader.abort(exc)
        finally:
            release_pinned_cache()  # the activations' pinned host buffers, cached by torch, back to the system
            if owned and store is not None:
                store.close(delete=True)

    # ---- Lightning hooks ----------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled and self.offloader is None:
            self._connect(trainer)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.enabled:
            return
        offloader = self.offloader or self._connect(trainer)
        offloader.begin(exclude=[*pl_module.parameters(), *pl_module.buffers()])

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self.offloader is not None:
            self.offloader.end_forward()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.offloader is not None and self.offloader.phase != "idle":  # not a step run with enabled=False
            self.offloader.end_step()
            self.last_step_stats = self.offloader.last_step_stats
            self.total_stats.add(self.last_step_stats)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._disconnect(clean=False, exc=exception)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Before the strategy's teardown closes a shared store.
        self._disconnect(clean=True)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._disconnect(clean=False)
