"""``OffloadStrategy``: what every offload strategy does around its Lightning base strategy.

The common base of ``NVMeOffloadStrategy`` (``OffloadStrategy, SingleDeviceStrategy``) and
``NVMeOffloadDDPStrategy`` (``OffloadStrategy, DDPStrategy``), a ``Strategy`` itself so that each
override reaches the Lightning strategy next in the method resolution order through ``super()``: one
``FlatStore`` per process, each optimizer from ``configure_optimizers`` wrapped in an
``OffloadedOptimizer``, reads started on entry to the step, the store drained on teardown and
reopened for checkpoints saved after ``fit``, checkpoints loaded and routed between the strategy and the
user's ``CheckpointIO``. A subclass says which parameter ranges its process owns (``_owned_ranges``), what
follows an update (``_after_update``) and what its saves take besides the checkpoint (``_save_arguments``).

The hooks stay here and delegate: opening the store and offloading the optimizers to ``store_open``, the setup
refusals to ``setup_checks``, saving and loading to ``checkpoint.Saver`` and ``checkpoint.Resume``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nvme.checkpoint import Resume, Saver, SaveRecord, WeightReaders
from lightning_nvme.fs import atomic
from lightning_nvme.optim import OffloadedOptimizer, UpdateListener
from lightning_nvme.optim.plan import Plan
from lightning_nvme.preflight.resources import check_host_memory_budget
from lightning_nvme.settings import OffloadSettings
from lightning_nvme.store import ALIGN, FlatStore
from lightning_nvme.store.layout import HEADER_BYTES
from lightning_nvme.strategies.placement import Item, ShelfPlan, chunk_item, plan_shelf, resolve_budget
from lightning_nvme.strategies.setup_checks import check_overlap_supported
from lightning_nvme.strategies.store_open import offload_optimizers, open_new_store


class OffloadStrategy(Strategy):
    """List first among the bases, before the Lightning strategy; call ``_init_offload`` from ``__init__``."""

    strategy_name: str
    # overlap="backward": a gradient is final when its post-accumulate-grad hook fires (single process);
    # False where the subclass signals it itself (data parallel: after the all-reduce).
    _local_grad_hooks: bool = True
    # overlap="backward": free each gradient once its chunk is updated (single process; data parallel keeps
    # them for now), so gradient memory is bounded by the chunks not yet updated.
    _frees_grads: bool = False
    config: OffloadSettings
    nvme_store: FlatStore | None
    offloaded: list[OffloadedOptimizer]

    def _init_offload(self, config: OffloadSettings) -> None:
        self.config = config
        self.nvme_store = None
        self.offloaded = []
        self.shelf_plan: ShelfPlan | None = None  # what host_memory_budget keeps in RAM (made at setup)
        self._run_token = uuid.uuid4().hex[:12]  # names this instance's store (see store_claim)
        self.saver = Saver(self.strategy_name, config)
        self.resume = Resume()

    @property
    def _store_rank(self) -> int:
        """The rank that names this process's store file."""
        return 0

    # ---- what a subclass decides --------------------------------------------------------------------
    def _owned_ranges(self, index: int, optimizer: Optimizer) -> Mapping[int, Sequence[tuple[int, int]]] | None:
        """The element ranges whose state this process keeps (``None``: all of them)."""
        return None

    def _after_update(self, off: OffloadedOptimizer) -> None:
        """Runs after each completed step of ``off`` (data parallel: share the updated parameters)."""

    def _update_listener(self) -> UpdateListener | None:
        """Told around each chunk update (parameter offload makes the chunk's parameters resident)."""
        return None

    def _extra_store_bytes(self) -> int:
        """Store bytes beyond the optimizer state (parameter regions), for the free-space check."""
        return 0

    def _read_ahead(self, plan: Plan) -> int:
        """Chunks the optimizer of ``plan`` reads ahead of the one it updates: ``prefetch_depth``."""
        return self.config.prefetch_depth

    def _chunk_units(self) -> Mapping[int, int] | None:
        """``id(param)`` -> the unit an optimizer chunk may not cross (``plan_chunks``' ``units``); None: any."""
        return None

    def _start_offload(self) -> None:
        """After the optimizers are offloaded at setup: what else moves into the store (parameter blocks)."""

    def _shelf_items(self) -> list[Item]:
        """The regions a step moves, for the placement plan (``host_memory_budget``): optimizer chunks here,
        parameter blocks in the strategy that offloads them."""
        # a chunk's whole region (page-aligned): what the optimizer reads and writes, and what the shelf holds
        return [chunk_item(r.name, r.nbytes) for off in self.offloaded for r in off.regions()]

    # ---- the shelf: what stays in host memory (host_memory_budget, lightning_nvme.strategies.placement) --------------
    def _host_budget(self) -> int:
        """This process's share of ``host_memory_budget`` in bytes, checked against the memory available now
        (one process: all of it; data parallel splits the host's among its ranks)."""
        budget = resolve_budget(self.config.host_memory_budget)
        check_host_memory_budget(budget, self.config.host_memory_budget)
        return budget

    def _plan_shelf(self) -> None:
        """Place the store's regions in RAM or on the SSD (at setup, after every region exists), and shelve
        those in RAM; later calls place regions added since (parameters added mid-run)."""
        if self.nvme_store is None:
            return
        items = self._shelf_items()
        if self.shelf_plan is None:
            self.shelf_plan = plan_shelf([], self._host_budget())
        if len(items) == len(self.shelf_plan.items):
            return
        placed = set(self.shelf_plan.extend(items))
        if placed:
            fresh = {r.name for off in self.offloaded for r in off.regions() if r.name in placed and not r.has_state}
            self.nvme_store.shelve([r for r in placed if r not in fresh])  # hold bytes already written
            self.nvme_store.shelve([r for r in placed if r in fresh], load=False)
        rank_zero_info(f"{self.strategy_name}: {self.shelf_plan.summary()}")

    # ---- setup / teardown -----------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._has_state_to_offload():
            check_overlap_supported(self.strategy_name, self.config, trainer, self.precision_plugin, self._frees_grads)
            self._offload_optimizers(trainer)
            self._start_offload()
            self._plan_shelf()

    def _has_state_to_offload(self) -> bool:
        """False when ``configure_optimizers`` returned None: Lightning then steps its ``_MockOptimizer`` (a no-op
        step on a dummy tensor), so the run trains as under the default strategy with nothing to offload."""
        return any(not isinstance(opt, _MockOptimizer) for opt in self.optimizers)

    def _open_new_store(self, trainer: pl.Trainer, planned: int, state_bytes: int | None = None) -> FlatStore:
        """This process's store, created once after the space checks (``store_open.open_new_store``)."""
        self.nvme_store = open_new_store(trainer, self.config, self.strategy_name, self.nvme_store, self,
                                         self._store_rank, self._run_token, planned, state_bytes)
        return self.nvme_store

    def _offload_optimizers(self, trainer: pl.Trainer) -> None:
        owned = [self._owned_ranges(i, opt) for i, opt in enumerate(self.optimizers)]
        # a new store also holds its header, its owner region and the parameter blocks
        new_store_bytes = 0 if self.nvme_store is not None else HEADER_BYTES + ALIGN + self._extra_store_bytes()
        backward = self.config.overlap == "backward"
        self.offloaded = offload_optimizers(
            self.optimizers, owned, self.config, functools.partial(self._open_new_store, trainer), new_store_bytes,
            self._read_ahead, self._chunk_units(), strategy_name=self.strategy_name, token=self._run_token,
            clip_value=float(trainer.gradient_clip_val) if backward and trainer.gradient_clip_val else None,
            grad_hooks=self._local_grad_hooks, free_grads=self._frees_grads and backward, listener=self._update_listener())

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
        store = self._reopen_store()
        try:
            yield store
        finally:
            store.close()

    def _reopen_store(self) -> FlatStore:
        """The store file reopened and checked (after teardown), the offloaded optimizers and parameters pointed at it;
        the caller closes it."""
        store = self.offloaded[0].store_ref.open()
        try:
            for off in self.offloaded:
                off.attach(store)
            self._attach_store(store)
        except BaseException:
            store.close()
            raise
        return store

    def _attach_store(self, store: FlatStore) -> None:
        """Point what else reads the store (offloaded parameters) at ``store``, reopened after fit."""

    def __getstate__(self) -> dict[str, Any]:
        """Picklable and deep-copyable during fit, like Lightning's strategies: the open store (threads, lock,
        file handle) stays with this instance; a copy reopens the store file when it reads the state."""
        state = dict(super().__getstate__() or {})
        state["nvme_store"] = None
        return state

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
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if off is not None:
            self._after_update(off)
            self._plan_shelf()  # chunks planned during this step (parameters made trainable mid-run)
        return out

    # ---- checkpoints ------------------------------------------------------------------------------------
    # A checkpoint is one file Lightning's loaders open, the optimizer state inside it. ``self.saver``
    # (``lightning_nvme.checkpoint.Saver``) writes, delivers and removes it; ``self.resume``
    # (``checkpoint.Resume``) reads it back in Lightning's order: ``load_checkpoint`` (before setup) hands
    # Lightning its usual dict and keeps where the streamed state is; ``load_optimizer_state_dict`` (after setup,
    # when the offloaded optimizers exist) streams it back. Weights streamed beside the dict (``offload_params``)
    # stay references until ``load_model_state_dict`` streams them into the store (or reads them: a model in memory).
    @property
    def checkpoint_saves(self) -> list[SaveRecord]:
        """How each save copied the state (telemetry)."""
        return self.saver.records

    def _save_arguments(self) -> dict[str, Any]:
        """What ``Saver.save`` takes from this strategy besides the checkpoint (data parallel adds its ranks)."""
        return {"optimizers": self.offloaded, "open_store": self._open_store, "live_store": self.nvme_store,
                "settings": self.config}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        self.saver.save(checkpoint, filepath, self.checkpoint_io, storage_options, **self._save_arguments())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        off = self.offloaded_for(optimizer)
        if off is None:
            return super().optimizer_state(optimizer)
        return self.saver.placeholder(off)

    def _recover_before_load(self, path: str) -> None:
        """Finish or undo an interrupted commit of ``path`` before reading it (once: data-parallel overrides)."""
        atomic.recover(path)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # weights beside the file stay references until load_model_state_dict
        load_file: Callable[[str], dict[str, Any]] = functools.partial(super().load_checkpoint, weights_only=weights_only)
        return self.resume.open(checkpoint_path, self.checkpoint_io, load_file, self._recover_before_load, weights_only)

    def _weights_streamed_by(self, readers: WeightReaders) -> AbstractContextManager[set[str]]:
        """Inside, ``load_state_dict`` streams these state-dict keys' beside weights itself (into the store)."""
        return nullcontext(set())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.resume.has_beside_weights(checkpoint):
            return super().load_model_state_dict(checkpoint, strict=strict)
        with self.resume.state_dict(checkpoint, self._weights_streamed_by) as state_dict:  # the rest: in memory anyway
            super().load_model_state_dict({**checkpoint, "state_dict": state_dict}, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.offloaded:
            self.resume.parts = None
            return super().load_optimizer_state_dict(checkpoint)
        self.resume.restore(self.offloaded, checkpoint)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.saver.remove(filepath, self.checkpoint_io, self.is_global_zero)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=(cls.__doc__ or "").splitlines()[0])
