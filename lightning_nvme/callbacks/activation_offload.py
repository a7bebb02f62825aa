"""``NVMeActivationOffload``: checkpointed activations to the NVMe flat store during the training step.

The Lightning side only decides *when*: the saved-tensor hooks are installed at batch start, removed
just before backward (so recomputation in backward is never offloaded), and everything is drained and
released at batch end, or on an exception. *What* and *how* live in
:class:`~lightning_nvme.activations.ActivationOffloader`.

Store: with ``strategy="nvme_offload"`` the strategy's store is shared (the callback adds its own
``activations.N`` regions to it); otherwise the callback opens its own store file
``activations-rank{R}.bin`` in ``store_dir`` and closes it at teardown.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_nvme.activations import ActivationOffloader, OffloadStats, ResidencyMeter
from lightning_nvme.constants import STORE_DIR_ENV, MiB
from lightning_nvme.store import FlatStore


class NVMeActivationOffload(Callback):
    """Keep the activations saved for backward on a local SSD instead of in memory.

    Args:
        store_dir: directory of the callback's own store (ignored when the strategy provides one);
            default ``$LIGHTNING_NVME_STORE_DIR``, else ``<trainer.default_root_dir>/nvme_store``.
        scope: ``"checkpoint"`` (inputs of ``torch.utils.checkpoint`` regions) or ``"all"`` (any
            saved tensor of at least ``min_bytes``).
        min_bytes: smaller storages stay in memory.
        keep_last: the last N saved storages stay in memory (backward needs them first).
        prefetch_depth: reads issued ahead of backward.
        write_inflight_bytes / prefetch_bytes: budgets of activation memory waiting for writes / read ahead.
        min_segment_bytes: the activation area of the store grows by at least this much.
        io_workers / io_chunk_bytes / staging_bytes / min_free_bytes: for the callback's own store.
        enabled: when False the callback does nothing (handy to compare runs).
    """

    def __init__(self, store_dir: str | None = None, *, scope: str = "checkpoint", min_bytes: int = 1 * MiB,
                 keep_last: int = 1, prefetch_depth: int = 2, write_inflight_bytes: int = 256 * MiB,
                 prefetch_bytes: int = 512 * MiB, min_segment_bytes: int = 256 * MiB, io_workers: int = 4,
                 io_chunk_bytes: int = 8 * MiB, staging_bytes: int = 64 * MiB, min_free_bytes: int = 0,
                 enabled: bool = True) -> None:
        self.store_dir = store_dir
        self.enabled = enabled
        self.meter = ResidencyMeter()
        self._offloader_kwargs: dict[str, Any] = dict(
            scope=scope, min_bytes=min_bytes, keep_last=keep_last, prefetch_depth=prefetch_depth,
            max_write_inflight_bytes=write_inflight_bytes, max_prefetch_bytes=prefetch_bytes,
            min_segment_bytes=min_segment_bytes)
        ActivationOffloader.check_args(**self._offloader_kwargs)
        self._store_kwargs: dict[str, Any] = dict(io_chunk_bytes=io_chunk_bytes, io_workers=io_workers, staging_bytes=staging_bytes,
                                  min_free_bytes=min_free_bytes)
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
    def _resolve_store_dir(self, trainer: pl.Trainer) -> str:
        return self.store_dir or os.environ.get(STORE_DIR_ENV) or os.path.join(trainer.default_root_dir, "nvme_store")

    def _connect(self, trainer: pl.Trainer) -> ActivationOffloader:
        shared = getattr(trainer.strategy, "nvme_store", None)
        if shared is not None:
            store, owned = shared, False
        else:
            store = FlatStore(self._resolve_store_dir(trainer), rank=trainer.global_rank,
                              name=f"activations-rank{trainer.global_rank}", **self._store_kwargs)
            owned = True
        self._store, self._owns_store = store, owned
        self.offloader = ActivationOffloader(store, meter=self.meter, **self._offloader_kwargs)
        return self.offloader

    def _disconnect(self, *, clean: bool, exc: BaseException | None = None) -> None:
        offloader, store, owned = self.offloader, self._store, self._owns_store
        self.offloader = None
        self._store, self._owns_store = None, False
        try:
            if offloader is not None:
                offloader.end_step() if clean else offloader.abort(exc)
        finally:
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
        if self.offloader is not None:
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
