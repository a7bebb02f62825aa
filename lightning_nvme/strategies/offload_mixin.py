"""``OffloadMixin``: what every offload strategy does around its Lightning base strategy.

Shared by ``NVMeOffloadStrategy`` (single device) and ``NVMeOffloadDDPStrategy`` (data parallel): one
``FlatStore`` per process, each optimizer from ``configure_optimizers`` wrapped in an
``OffloadedOptimizer``, reads started on entry to the step, the store drained on teardown and
reopened for checkpoints saved after ``fit``. A subclass says which parameter ranges its process
owns (``_owned_ranges``) and what follows an update (``_after_update``); checkpoint writing is its own.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_nvme import checkpoint as ckpt
from lightning_nvme.config import GiB, MiB, OffloadConfig
from lightning_nvme.memory import release_freed_memory
from lightning_nvme.optim import OffloadedOptimizer, plan_chunks
from lightning_nvme.preflight import check_store_dir
from lightning_nvme.store import FlatStore
from lightning_nvme.store.layout import HEADER_BYTES, align_up


class OffloadMixin:
    """Mix in before a Lightning strategy class; call ``_init_offload`` from ``__init__``."""

    strategy_name: str
    # overlap="backward": a gradient is final when its post-accumulate-grad hook fires (single process);
    # False where the subclass signals it itself (data parallel: after the all-reduce).
    _local_grad_hooks: bool = True
    config: OffloadConfig
    nvme_store: FlatStore | None
    offloaded: list[OffloadedOptimizer]
    # provided by the Lightning strategy mixed with
    global_rank: int
    is_global_zero: bool
    optimizers: list[Optimizer]
    precision_plugin: Any

    def _init_offload(self, config: OffloadConfig) -> None:
        self.config = config
        self.nvme_store = None
        self.offloaded = []

    # ---- what a subclass decides --------------------------------------------------------------------
    def _owned_ranges(self, index: int, optimizer: Optimizer) -> Mapping[int, Sequence[tuple[int, int]]] | None:
        """The element ranges whose state this process keeps (``None``: all of them)."""
        return None

    def _after_update(self, off: OffloadedOptimizer) -> None:
        """Runs after each completed step of ``off`` (data parallel: share the updated parameters)."""

    # ---- setup / teardown -----------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if trainer.state.fn == TrainerFn.FITTING and self.optimizers:
            self._check_overlap_supported(trainer)
            self._offload_optimizers(trainer)

    def _check_overlap_supported(self, trainer: pl.Trainer) -> None:
        if self.config.overlap != "backward":
            return
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").lower()
        if trainer.gradient_clip_val and "norm" in algorithm:
            raise ValueError(f"{self.strategy_name}: overlap='backward' updates each chunk as its gradients become "
                             "final, before the global gradient norm is known, so norm clipping "
                             f"(gradient_clip_val={trainer.gradient_clip_val}) would change the maths. Use "
                             "overlap='step', or gradient_clip_algorithm='value'.")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"{self.strategy_name}: overlap='backward' cannot be used with a loss scaler "
                             "(precision='16-mixed'): the inf check needs all gradients first. Use overlap='step' "
                             "or precision='bf16-mixed'.")

    def _offload_optimizers(self, trainer: pl.Trainer) -> None:
        store_dir = self.config.resolve_store_dir(trainer.default_root_dir)
        io = self.config.io_settings()
        owned = [self._owned_ranges(i, opt) for i, opt in enumerate(self.optimizers)]
        fmt = self.config.state_format_spec
        plans = [plan_chunks(opt, self.config.chunk_bytes, f"opt{i}", owned=owned[i], fmt=fmt)
                 for i, opt in enumerate(self.optimizers)]
        planned = HEADER_BYTES + sum(align_up(c.nbytes) for chunks, _ in plans for c in chunks)
        # Before anything is allocated: writable, enough free space (+ margin), warn on tmpfs/NFS.
        check_store_dir(store_dir, planned, min_free_bytes=self.config.min_free_bytes)
        if self.config.malloc_mmap_threshold is not None:
            release_freed_memory(self.config.malloc_mmap_threshold)  # see lightning_nvme.memory: bounded RSS
        self.nvme_store = FlatStore(store_dir, rank=self.global_rank, chunk_bytes=io.chunk_bytes,
                                    num_workers=io.num_workers,
                                    pool_bytes=max(self.config.staging_bytes, io.chunk_bytes),
                                    min_free_bytes=self.config.min_free_bytes)
        clip_value = None
        if self.config.overlap == "backward" and trainer.gradient_clip_val:
            clip_value = float(trainer.gradient_clip_val)
        self.offloaded = [
            OffloadedOptimizer(opt, self.nvme_store, name=f"opt{i}", chunk_bytes=self.config.chunk_bytes,
                               prefetch_depth=self.config.prefetch_depth, overlap=self.config.overlap,
                               clip_value=clip_value, owned=owned[i], plan=plans[i],
                               grad_hooks=self._local_grad_hooks, fmt=fmt)
            for i, opt in enumerate(self.optimizers)
        ]
        state = sum(o.state_bytes for o in self.offloaded)
        resident = sum(o.ring.total_bytes for o in self.offloaded) + self.nvme_store.pool_bytes
        rank_zero_info(f"{self.strategy_name}: optimizer state store {self.nvme_store.path} ({self.nvme_store.mode} "
                       f"I/O): {state / GiB:.2f} GiB on disk in {sum(len(o.chunks) for o in self.offloaded)} "
                       f"chunks; {resident / MiB:.0f} MiB of resident buffers; overlap={self.config.overlap}; "
                       f"{fmt.describe()}")

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
            super().teardown()  # type: ignore[misc]

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

    # ---- the step ---------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        off = self.offloaded_for(optimizer)
        if off is not None:
            off.prefetch()  # reads overlap the closure's forward and backward
        out = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        if off is not None:
            self._after_update(off)
        return out

    # ---- checkpoints ------------------------------------------------------------------------------------
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        off = self.offloaded_for(optimizer)
        if off is None:
            return super().optimizer_state(optimizer)  # type: ignore[misc]
        return ckpt.optimizer_placeholder(off, self.offloaded.index(off))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if ckpt.is_streamed(checkpoint_path):
            return ckpt.load_streamed(os.fspath(checkpoint_path))
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.offloaded:
            return super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
        for off, state in zip(self.offloaded, checkpoint["optimizer_states"]):
            ckpt.restore_optimizer(off, state, checkpoint)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero and ckpt.is_streamed(filepath):
            ckpt.remove_streamed(os.fspath(filepath))
        else:
            super().remove_checkpoint(filepath)  # type: ignore[misc]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0])
