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

``offload_params=True`` also moves the parameters of each block (a transformer layer) into the store
between uses (see ``lightning_nvme.params``); ``overlap="backward"`` then updates each block while it is
resident in backward and writes it back. Above ``inline_weights_bytes`` a checkpoint streams the block
weights from the store into a safetensors file beside it (``lightning_nvme.checkpoint.weights``), and
``export_weights`` writes the whole model to one safetensors file the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nvme.checkpoint import base_file, weights
from lightning_nvme.models.hub_export import MAX_SHARD_BYTES
from lightning_nvme.optim import UpdateListener
from lightning_nvme.optim.plan import Plan
from lightning_nvme.params import ParamOffload
from lightning_nvme.params.materialize import has_meta_tensors, materialize
from lightning_nvme.params.offload import chunks_per_block
from lightning_nvme.params.schedule import holds_for_update
from lightning_nvme.params.stream import StreamStats
from lightning_nvme.params.window import LayerMajorWindow
from lightning_nvme.settings import OffloadSettings, from_arguments, with_settings
from lightning_nvme.store import FlatStore
from lightning_nvme.store.layout import HEADER_BYTES, align_up
from lightning_nvme.strategies.eval_streaming import StreamedEvaluation
from lightning_nvme.strategies.offload_strategy import OffloadStrategy
from lightning_nvme.strategies.param_setup import block_items, meta_stays, plan_device_blocks, start_param_offload
from lightning_nvme.strategies.placement import DeskPlan, Item
from lightning_nvme.strategies.setup_checks import check_param_offload_supported, refuse_compiled, refuse_placeholders
from lightning_nvme.strategies.weight_export import export, state_dict_scope


@with_settings(OffloadSettings)
class NVMeOffloadStrategy(OffloadStrategy, SingleDeviceStrategy):
    """Single-device training with optimizer state (and fp32 master weights of half-precision params)
    on a flat store on local disk, and with ``offload_params=True`` the parameters too.

    Takes the arguments listed below (each defined once in ``lightning_nvme.settings.OffloadSettings``)
    and ``device``, ``accelerator``, ``checkpoint_io``, ``precision_plugin`` as Lightning's
    ``SingleDeviceStrategy`` does."""

    strategy_name = "nvme_offload"
    _frees_grads = True

    def __init__(self, store_dir: str | list[str] | None = None, *, device: torch.device | str | None = None,
                 accelerator: pl.accelerators.Accelerator | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, parallel_devices: list[torch.device] | None = None,
                 **settings: Any) -> None:
        config = from_arguments(OffloadSettings, self.strategy_name, {"store_dir": store_dir, **settings})
        super().__init__(device=device or "cpu", accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._init_offload(config)
        self.param_offload: ParamOffload | None = None
        self.desk_plan: DeskPlan | None = None  # blocks kept on the GPU (device_memory_budget)
        self.evaluation = StreamedEvaluation(self.strategy_name, config)  # offload_params outside fit
        self._device_given = device is not None
        # Set by the accelerator connector when built from a string, so the device follows `accelerator=`.
        self.parallel_devices = parallel_devices

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and self.parallel_devices:
            return torch.device(self.parallel_devices[0])
        return self._root_device

    # ---- parameter offload -------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitted = self.param_offload
        self.param_offload = None
        self.desk_plan = None
        self.evaluation.fitted, self.evaluation.stream = None, None
        if self.config.offload_params and trainer.state.fn != TrainerFn.FITTING:
            self._check_param_offload_supported()
            if fitted is not None and fitted.active and fitted.model is trainer.lightning_module and self.offloaded:
                self.param_offload = self.evaluation.fitted = fitted  # after fit (restore_params=False): the store has them
        if self.config.offload_params and trainer.state.fn == TrainerFn.FITTING:
            self._check_param_offload_supported()
            refuse_compiled(self.strategy_name, trainer.lightning_module)
            if fitted is None or not fitted.active:
                refuse_placeholders(self.strategy_name, trainer.lightning_module)
            s = self.config
            classes = None if s.param_block_classes is None else tuple(s.param_block_classes)
            self.param_offload = ParamOffload(trainer.lightning_module, classes, s.param_prefetch, self.root_device,
                                              s.frozen_weights)
        super().setup(trainer)
        if self.param_offload is not None and self.nvme_store is None and self.evaluation.fitted is None:
            self.param_offload = None  # no optimizer: nothing trains, nothing to offload

    @override
    def _start_offload(self) -> None:
        if self.param_offload is not None:
            assert self.nvme_store is not None
            start_param_offload(self.strategy_name, self.config, self.param_offload, self.nvme_store, self.offloaded)
            self.desk_plan = plan_device_blocks(self.strategy_name, self.config, self.param_offload, self.root_device)

    @override
    def _shelf_items(self) -> list[Item]:
        items = super()._shelf_items()
        if self.param_offload is not None:
            assert self.nvme_store is not None
            items += block_items(self.param_offload, self.nvme_store, self.desk_plan)
        return items

    def _check_param_offload_supported(self) -> None:
        check_param_offload_supported(self.strategy_name, self.config, self.root_device, self.precision_plugin)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """With ``offload_params``, ``trainer.init_module()`` and ``configure_model`` create parameters on the
        meta device (no memory); setup initializes them block by block straight into the store.
        ``empty_init=False`` asks for a model in memory."""
        if not self.config.offload_params or empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        assert self.lightning_module is not None
        if self.config.offload_params and self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            self.evaluation.start(self.lightning_module, self.root_device, self._reopen_store)
        elif self.param_offload is not None and (has_meta_tensors(self.model) or self.root_device.type != "cpu"):
            assert self.lightning_module is not None
            store = self._open_new_store(self.lightning_module.trainer, HEADER_BYTES + self._extra_store_bytes())
            if has_meta_tensors(self.model):
                self.param_offload.materialize(store, self.root_device)
            else:  # an accelerator receives the blocks' placeholders, never the whole model
                self.param_offload.place(store, self.root_device)
        elif has_meta_tensors(self.model):  # not fitting: the model is needed in memory anyway
            materialize(self.model, self.root_device)
        super().model_to_device()

    # ---- streamed evaluation (validate / test / predict with offload_params: strategies.eval_streaming) ---------
    @property
    def eval_stats(self) -> StreamStats | None:
        """The last streamed evaluation's reads."""
        return self.evaluation.stats

    @property
    def last_eval_window(self) -> LayerMajorWindow | None:
        """The last streamed evaluation's layer-major window (``eval_window`` > 1): its figures."""
        return self.evaluation.last_window

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return self.evaluation.lookahead(super().process_dataloader(dataloader))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.evaluation.windowed(super().validation_step, self.precision_plugin.val_step_context, args, kwargs,
                                        self._transfer)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.evaluation.windowed(super().test_step, self.precision_plugin.test_step_context, args, kwargs,
                                        self._transfer)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.evaluation.windowed(super().predict_step, self.precision_plugin.predict_step_context, args, kwargs,
                                        self._transfer)

    def _transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """What the loop does to a batch before its step (Lightning's ``_evaluation_step``)."""
        module = self.lightning_module
        assert module is not None
        batch = self.precision_plugin.convert_input(batch)
        batch = module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
        return self.batch_to_device(batch, dataloader_idx=dataloader_idx)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.evaluation.stream is not None:
            assert self.lightning_module is not None
            return self.evaluation.load(checkpoint, strict, self.lightning_module)
        return super().load_model_state_dict(checkpoint, strict=strict)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """With ``offload_params`` the weights are loaded after setup, into the store: a model built on the
        meta device has nothing to load into before."""
        return self.config.offload_params

    def _update_listener(self) -> UpdateListener | None:
        return self.param_offload

    def _extra_store_bytes(self) -> int:
        return sum(align_up(n) for _, n in self.param_offload.regions()) if self.param_offload else 0

    def _read_ahead(self, plan: Plan) -> int:
        """With blocks in the store and ``overlap="backward"``: at least the chunks of one block's state, so each
        chunk is read while the block after it (in backward order) computes. Why: a block's backward makes its
        gradients final in bursts (a projection's weight gradient completes all its chunks at once), and with only
        ``prefetch_depth`` chunks ahead the updates of a burst waited for reads queued behind the write-backs in
        flight (``benchmarks/hf_7b.py``'s phase profile; docs/performance.md, #38). Memory: one
        chunk buffer per chunk read ahead (``chunk_bytes`` each), about one block's optimizer state."""
        depth = super()._read_ahead(plan)
        if self.param_offload is None or self.config.overlap != "backward":
            return depth
        return max(depth, chunks_per_block(self.param_offload.layout, plan.chunks))

    def _chunk_units(self) -> Mapping[int, int] | None:
        """With blocks in the store: no optimizer chunk holds state of two blocks that wait in memory for their
        update, so such a block waits (on the device, on a GPU) for its own chunks only: ``param_prefetch + 2``
        blocks at most, whatever ``chunk_bytes`` and the optimizer's parameter groups (``plan_chunks``). Blocks
        whose frozen head dominates (LoRA) do not wait (their update re-reads the tail): their adapters still
        share chunks, many blocks' per chunk, rather than one small chunk per block."""
        if self.param_offload is None:
            return None
        return {pid: block.index for pid, block in self.param_offload.layout.block_of().items()
                if holds_for_update(block)}

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        self.saver.report()  # a background save that failed since the last step
        params = self.param_offload
        if params is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        params.hold_for_update = self.config.overlap == "backward" and self.offloaded_for(optimizer) is not None
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            params.hold_for_update = False
            params.finish_step()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        plain = self.resume.plain  # read before super() restores it: no streamed part means a plain checkpoint
        if self.param_offload is not None and plain:
            with self.param_offload.resident():  # fp32 masters of a plain checkpoint come from the parameters
                return super().load_optimizer_state_dict(checkpoint)
        return super().load_optimizer_state_dict(checkpoint)

    @override
    def teardown(self) -> None:
        try:
            self.saver.close()  # a background copy reads the store: it ends (commits) before the store closes
        finally:
            try:
                if self.evaluation.running:
                    self.evaluation.end()  # the fit's offload (if any) stopped at the end of fit already
                elif self.param_offload is not None:
                    self.param_offload.stop(restore=self.config.restore_params)
            finally:
                with meta_stays(self.lightning_module):
                    super().teardown()

    # ---- checkpoints (lightning_nvme.checkpoint.Saver) ------------------------------------------------
    @property
    def _background(self) -> Any:
        """The last background save (``checkpoint_copy="background"``): its copy, until the next one."""
        return self.saver.background

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        saves = len(self.checkpoint_saves)
        super().save_checkpoint(checkpoint, filepath, storage_options)
        referenced = [i.path for i in base_file.base_files(checkpoint.get("state_dict"))]
        if referenced:  # frozen_weights="in_place": the checkpoint needs the user's base files as they are
            for record in self.checkpoint_saves[saves:]:
                record.base_files = referenced
            rank_zero_info(f"{self.strategy_name}: checkpoint {filepath} references the frozen weights in "
                           f"{referenced} (frozen_weights='in_place'), not a copy: a resume checks those files are "
                           "unchanged (size, mtime, header sha256).")

    @override
    def _save_arguments(self) -> dict[str, Any]:
        return {**super()._save_arguments(), "params": self._offloaded_weights()}

    # ---- checkpoints and export of offloaded weights ---------------------------------------------------
    def _offloaded_weights(self) -> ParamOffload | None:
        """The parameter offload whose blocks live in the store now (during fit, after it without restore)."""
        return self.param_offload if self.param_offload is not None and self.param_offload.active else None

    @override
    def _attach_store(self, store: FlatStore) -> None:
        if self.param_offload is not None:
            self.param_offload.attach(store)

    def _weights_readable(self) -> AbstractContextManager[object]:
        """The store is open for reading blocks: live during fit, reopened after it."""
        return self._open_store() if self.offloaded else nullcontext()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """A checkpoint's weights. Offloaded blocks above ``inline_weights_bytes`` are references, streamed
        beside the file by ``save_checkpoint``; smaller ones are gathered (the plain Lightning file)."""
        params = self._offloaded_weights()
        if params is None:
            return super().lightning_module_state_dict()
        with state_dict_scope(params, self.config.inline_weights_bytes, self._weights_readable):
            return super().lightning_module_state_dict()

    @override
    def _weights_streamed_by(self, readers: weights.WeightReaders) -> AbstractContextManager[set[str]]:
        params = self._offloaded_weights()
        return nullcontext(set()) if params is None else params.loading_from(readers)

    def export_weights(self, path: str, layout: str = "lightning", max_shard_bytes: int = MAX_SHARD_BYTES,
                       merge_adapters: bool = False) -> None:
        """Write the LightningModule's weights, streaming offloaded blocks from the store one at a time: the way to
        get the trained weights of a model too big to bring back into memory (``restore_params=False``), during or
        after fit. ``layout="lightning"``: its ``state_dict()`` as one safetensors file ``path``
        (``safetensors.torch.load_file`` reads it). ``layout="hf"``: the Hugging Face model inside it written to the
        directory ``path`` as ``save_pretrained`` would (config.json + sharded safetensors + index, transformers'
        names), for ``AutoModelForCausalLM.from_pretrained(path)``; of a peft (LoRA) model, its adapters alone
        in peft's layout, for ``PeftModel.from_pretrained(base, path)``, or with ``merge_adapters`` the base with
        the adapters merged in (peft's ``merge_and_unload``), in the Hub layout."""
        assert self.lightning_module is not None
        export(path, self.lightning_module, self._offloaded_weights(), self._weights_readable, layout, max_shard_bytes,
               merge_adapters)
