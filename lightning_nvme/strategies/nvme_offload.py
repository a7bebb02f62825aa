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

import functools
import itertools
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
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
from lightning_nvme.checks import ConfigError
from lightning_nvme.constants import MiB
from lightning_nvme.memory import release_freed_memory
from lightning_nvme.models.hub_export import MAX_SHARD_BYTES, export_hf
from lightning_nvme.optim import UpdateListener
from lightning_nvme.optim.plan import Plan
from lightning_nvme.params import ParamOffload, is_placeholder
from lightning_nvme.params.materialize import copy_checked, has_meta_tensors, initial_weights, materialize
from lightning_nvme.params.offload import chunks_per_block
from lightning_nvme.params.stream import (
    FROM_INITIAL,
    BesideSource,
    BlockSource,
    ForwardStream,
    MappingSource,
    StoreBlocks,
    StreamStats,
    TensorBlocks,
    check_streamable,
)
from lightning_nvme.params.window import LayerMajorWindow
from lightning_nvme.preflight.resources import check_device_memory_budget
from lightning_nvme.settings import OffloadSettings, from_arguments, with_settings
from lightning_nvme.store import FlatStore
from lightning_nvme.store.layout import HEADER_BYTES, align_up
from lightning_nvme.strategies.offload_strategy import OffloadStrategy
from lightning_nvme.strategies.placement import DeskPlan, Item, block_item, desk_block_item, plan_desk


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
        self.eval_stream: ForwardStream | None = None  # streamed evaluation (offload_params outside fit)
        self.eval_stats: StreamStats | None = None  # the last streamed evaluation's reads (kept after it)
        self._eval_from: ParamOffload | None = None  # the fit's offload whose store holds the weights, or None
        self._eval_store: FlatStore | None = None
        self.eval_window: LayerMajorWindow | None = None  # eval_window > 1: blocks read once per window of batches
        self.last_eval_window: LayerMajorWindow | None = None
        self._windows: deque[list[Any]] = deque()  # windows of raw batches read ahead (``_WindowLookahead``)
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
        self._eval_from, self.eval_stream = None, None
        if self.config.offload_params and trainer.state.fn != TrainerFn.FITTING:
            self._check_param_offload_supported()
            if fitted is not None and fitted.active and fitted.model is trainer.lightning_module and self.offloaded:
                self.param_offload = self._eval_from = fitted  # after fit (restore_params=False): the store has them
        if self.config.offload_params and trainer.state.fn == TrainerFn.FITTING:
            self._check_param_offload_supported()
            self._refuse_compiled(trainer.lightning_module)
            if (fitted is None or not fitted.active) and any(is_placeholder(p) for p in trainer.lightning_module.parameters()):
                raise ValueError(f"{self.strategy_name}: {type(trainer.lightning_module).__name__}'s block parameters are "
                                 "placeholders left by a streamed evaluation (validate/test/predict with offload_params): "
                                 "their values were never in this module. Build the model again (on the meta device, "
                                 "with its initial weights) or pass ckpt_path=... to fit.")
            s = self.config
            classes = None if s.param_block_classes is None else tuple(s.param_block_classes)
            self.param_offload = ParamOffload(trainer.lightning_module, classes, s.param_prefetch, self.root_device,
                                              s.frozen_weights)
        super().setup(trainer)
        if self.param_offload is not None and self.nvme_store is None and self._eval_from is None:
            self.param_offload = None  # no optimizer: nothing trains, nothing to offload

    @override
    def _start_offload(self) -> None:
        if self.param_offload is not None:
            assert self.nvme_store is not None
            s = self.config
            planned = [p for off in self.offloaded for r in off.regions() for p in r.params]
            in_blocks = self.param_offload.layout.block_of()
            stateless = [piece.index for off in self.offloaded for piece in off.unchunked if id(piece.param) in in_blocks]
            if stateless:
                raise ValueError(f"{self.strategy_name}: offload_params=True needs per-parameter optimizer state for "
                                 f"every trainable parameter in a block, but parameters {stateless} have none (e.g. "
                                 "SGD with momentum=0): they would be updated in memory while their values live in the "
                                 "store. Use an optimizer with state (SGD(momentum>0), AdamW, ...), or offload_params=False.")
            self.param_offload.start(self.nvme_store, planned)
            layout = self.param_offload.layout
            frozen = self.param_offload.frozen
            in_place = (f", of which {frozen.head_bytes / MiB:.1f} MiB of frozen parameters in {len(frozen.heads)} "
                        f"blocks read in place from {len(frozen.files)} base file(s) (frozen_weights='in_place', "
                        f"{'O_DIRECT' if all(f.direct_fd >= 0 for f in frozen.files.values()) else 'buffered'})"
                        if frozen is not None else "")
            rank_zero_info(f"{self.strategy_name}: parameters of {len(layout.blocks)} blocks offloaded "
                           f"({layout.offloaded_bytes / MiB:.1f} MiB{in_place}); {len(layout.outside_blocks)} parameters "
                           f"outside blocks, in memory ({layout.outside_bytes / MiB:.1f} MiB); param_prefetch={s.param_prefetch}")
            self._plan_desk()

    def _plan_desk(self) -> None:
        """``device_memory_budget``: the blocks worth most host <-> device copies per byte stay on the GPU (copied
        up once, here); planned before the shelf, which then holds none of them (they no longer move)."""
        if not self.config.device_memory_budget or self.param_offload is None:
            return
        assert self.nvme_store is not None and self.param_offload.residency is not None
        budget = self.config.device_memory_budget
        if not self.param_offload.residency.transfer.device_copies:
            raise ConfigError("device_memory_budget", f"{self.strategy_name}: device_memory_budget={budget} keeps "
                              "blocks in GPU memory, but the parameters are used in host memory (device "
                              f"{self.root_device}): it would be ignored. Fix: host_memory_budget keeps blocks in "
                              "host RAM; set device_memory_budget=0 off CUDA.")
        check_device_memory_budget(budget, self.root_device)
        self.desk_plan = plan_desk(
            [desk_block_item(b.region, self.param_offload.block_bytes(b), b.trainable)
             for b in self.param_offload.blocks], budget)
        self.param_offload.keep_on_desk(self.desk_plan.kept)
        rank_zero_info(f"{self.strategy_name}: {self.desk_plan.summary()}")

    @override
    def _shelf_items(self) -> list[Item]:
        items = super()._shelf_items()
        if self.param_offload is not None:
            assert self.nvme_store is not None
            on_desk = self.desk_plan.kept if self.desk_plan is not None else set()
            offload = self.param_offload
            items += [block_item(b.region, self.nvme_store.region(b.region).capacity,
                                 0 if offload.in_place(b) else b.writable_offset, b.trainable)  # in place: the tail only
                      for b in offload.blocks if b.region not in on_desk  # kept: never move
                      and self.nvme_store.region(b.region).capacity]
        return items

    def _check_param_offload_supported(self) -> None:
        device = self.root_device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{self.strategy_name}: offload_params=True runs on CPU and CUDA devices; the "
                             f"accelerator path for {device} is not implemented. Set offload_params=False.")
        if device.type == "cuda" and getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"{self.strategy_name}: offload_params=True on CUDA does not support a loss scaler "
                             "(precision='16-mixed'): its unscale and skipped steps are not verified against "
                             "in-memory training. Use precision='bf16-mixed', 'bf16-true' or '32-true', or "
                             "offload_params=False.")
        if device.type == "cuda" and self.config.overlap != "backward":
            # overlap="step" keeps every block's gradient on the device until the step: device memory then
            # grows with the whole model, which is what parameter offload is there to avoid (issue #33).
            raise ConfigError("overlap", f"{self.strategy_name}: offload_params=True on CUDA with "
                              f"overlap={self.config.overlap!r} keeps every block's gradient in device memory "
                              "until the optimizer step (as much memory as the parameters themselves). Fix: "
                              "overlap='backward' (each block updated, written back and its gradient freed "
                              "during backward), or offload_params=False.")

    def _refuse_compiled(self, module: torch.nn.Module) -> None:
        """``torch.compile`` (and the CUDA graphs of its ``mode="reduce-overhead"``) is refused with offloaded
        parameters. Why: every bind points a block's parameters at a new buffer (the host buffer or a fresh
        device copy), and between uses they are expanded placeholders (stride 0). A compiled graph guards on
        strides (recompiling at every bind, up to its limit, then falling back) and a CUDA graph replays the
        addresses it captured: reads of freed memory, silently wrong numbers. Neither is tested here."""
        from torch._dynamo.eval_frame import OptimizedModule

        compiled = getattr(module, "_compiler_ctx", None) is not None  # Lightning's trainer.fit(torch.compile(m))
        inner = [name for name, m in module.named_modules() if isinstance(m, OptimizedModule)]
        if compiled or inner:
            what = "the LightningModule" if compiled else f"submodule {inner[0]!r}"
            raise ConfigError("offload_params", f"{self.strategy_name}: {what} is compiled with torch.compile, "
                              "but offload_params=True re-points each block's parameters at a new buffer at every "
                              "load (placeholders between uses): a compiled graph would recompile at every load "
                              "and a CUDA graph (mode='reduce-overhead') would replay freed addresses. Fix: pass "
                              "the module uncompiled, or offload_params=False to compile it.")

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
            self._start_eval_stream()
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

    # ---- streamed evaluation (validate / test / predict with offload_params) -----------------------------
    def _start_eval_stream(self) -> None:
        """Outside fit, a model whose blocks are not in memory is evaluated block by block (``params.stream``):
        from the store a fit left them in (``restore_params=False``), or, for a model built on the meta device,
        from its own initial weights (a safetensors directory read in place) or the checkpoint loaded next
        (``ckpt_path``: ``load_model_state_dict`` sets the source). Only the parameters outside the blocks are
        materialized. A model in memory is evaluated in memory (nothing to stream)."""
        module = self.lightning_module
        assert module is not None
        s = self.config
        classes = None if s.param_block_classes is None else tuple(s.param_block_classes)
        source: BlockSource | None = None
        if self._eval_from is not None:
            store = self.offloaded[0].store_ref.open()  # closed at teardown; read only
            for off in self.offloaded:
                off.attach(store)
            self._attach_store(store)
            self._eval_store = store
            layout = self._eval_from.layout
            source = StoreBlocks(self._eval_from.read_block, f"the store {store.path}")
        elif has_meta_tensors(module) or any(is_placeholder(p) for p in module.parameters()):  # (an earlier stream's)
            layout = ParamOffload(module, classes, s.param_prefetch, self.root_device).layout
            streamed = {id(slot.param) for b in layout.blocks for slot in b.slots}
            check_streamable(module, layout)
            fresh = any(slot.param.is_meta for b in layout.blocks for slot in b.slots)  # never initialized
            materialize(module, self.root_device, skip=streamed)  # the parameters outside the blocks only
            initial = initial_weights(module)
            # A block never initialized (meta), or left as placeholders by a stream from these same initial weights:
            # they are its values. Placeholders for other values (a checkpoint's, a fit's store) are not served from
            # them: that would be other numbers.
            if initial is not None and (fresh or getattr(module, FROM_INITIAL, False)):
                blocks = TensorBlocks(initial, f"{type(module).__name__}.initial_weights()")
                if not blocks.missing(layout.blocks):
                    source = blocks
            setattr(module, FROM_INITIAL, source is not None)
        else:
            return
        threshold = s.mmap_threshold()
        if threshold is not None:
            release_freed_memory(threshold)  # each block's buffers go back to the OS when dropped (memory.py)
        ckpt_path = getattr(module.trainer, "ckpt_path", None)
        self.eval_stream = ForwardStream(
            layout.blocks, source, s.param_prefetch, self.root_device,
            unsourced=f"{self.strategy_name}: the block weights of {type(module).__name__} are not in memory (built on "
                      "the meta device, or placeholders left by an earlier streamed evaluation from a checkpoint or by a "
                      "fit in another trainer with restore_params=False) and nothing here gives them: no "
                      "initial_weights() covering them and no ckpt_path. Pass ckpt_path=... to validate/test/predict "
                      "(trainer.save_checkpoint of the fit), or build the model in memory.")
        for block in layout.blocks:
            self.eval_stream.unbind(block)  # placeholders on the device the blocks run on
        self.eval_stream.install()
        self._windows.clear()
        if s.eval_window > 1:
            self.eval_window = LayerMajorWindow(self.eval_stream, s.eval_window, s.eval_activation_bytes)
        rank_zero_info(f"{self.strategy_name}: streamed evaluation of {len(layout.blocks)} blocks "
                       f"({layout.offloaded_bytes / MiB:.1f} MiB) from "
                       f"{'the checkpoint ' + str(ckpt_path) if ckpt_path else (source.describe() if source else '?')}; "
                       f"param_prefetch={s.param_prefetch}")

    def _end_eval_stream(self) -> None:
        if self.eval_window is not None:
            self.last_eval_window = self.eval_window  # its figures (windows, compute and read-wait seconds) stay
        self.eval_window = None
        self._windows.clear()
        if self.eval_stream is not None:
            self.eval_stream.remove()
            self.eval_stats, self.eval_stream = self.eval_stream.stats, None
        if self._eval_store is not None:
            self._eval_store.close()
            self._eval_store = None

    def _load_for_eval(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        """A checkpoint for streamed evaluation: the block weights become the stream's source (read per forward from
        the beside file, or from the dict when inline); the others are copied into the module. Not through
        ``load_state_dict``: its hooks would bring the blocks into memory."""
        stream, module = self.eval_stream, self.lightning_module
        assert stream is not None and module is not None
        state = checkpoint["state_dict"]
        streamed = {slot.name for b in stream.blocks for slot in b.slots}
        targets = {**dict(module.named_buffers(remove_duplicate=False)),
                   **dict(module.named_parameters(remove_duplicate=False))}
        missing = sorted(n for n in streamed if n not in state)
        missing += sorted(n for n, p in module.named_parameters(remove_duplicate=False) if n not in state
                          and n not in streamed)
        unexpected = sorted(k for k in state if k not in targets)
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys "
                               f"{missing[:8]}, unexpected keys {unexpected[:8]}")
        with weights.WeightReaders() as readers, torch.no_grad():
            for key, value in state.items():
                if key in streamed or key not in targets:
                    continue
                tensor = readers.read(value) if isinstance(value, weights.BesideWeight) else value
                copy_checked(key, tensor.to(targets[key].device), targets[key])
        source = BesideSource(state) if weights.has_refs(checkpoint) else MappingSource(state)
        setattr(module, FROM_INITIAL, False)  # its placeholders stand for the checkpoint's values from now on
        stream.source = TensorBlocks(source, f"the checkpoint {getattr(module.trainer, 'ckpt_path', '')}")

    # ---- the layer-major window (eval_window > 1, lightning_nvme.params.window) ---------------------------
    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        if self.eval_window is None:
            return dataloader
        return _WindowLookahead(dataloader, self.eval_window.window, self._windows)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._windowed(super().validation_step, self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._windowed(super().test_step, self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._windowed(super().predict_step, self.precision_plugin.predict_step_context, args, kwargs)

    def _windowed(self, step: Callable[..., Any], context: Callable[[], AbstractContextManager[Any]],
                  args: tuple, kwargs: dict) -> Any:
        """A batch's step; the first of a window first computes the whole window block by block."""
        window = self.eval_window
        if window is None or not args:
            return step(*args, **kwargs)
        if not window.serving:
            window.clear()
            raw = self._windows.popleft() if self._windows else [args[0]]
            batch, index, rest = args[0], args[1] if len(args) > 1 else 0, args[2:]
            dataloader_idx = rest[0] if rest else 0
            batches = [batch] + [self._transfer(b, dataloader_idx) for b in raw[1:]]
            for j, b in enumerate(batches):
                window.capture(functools.partial(step, b, index + j, *rest, **kwargs) if len(args) > 1
                               else functools.partial(step, b, **kwargs))
            with context():
                window.compute()
        with window.serve():
            out = step(*args, **kwargs)
        window.finish_step()
        return out

    def _transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """What the loop does to a batch before its step (Lightning's ``_evaluation_step``)."""
        module = self.lightning_module
        assert module is not None
        batch = self.precision_plugin.convert_input(batch)
        batch = module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
        return self.batch_to_device(batch, dataloader_idx=dataloader_idx)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.eval_stream is not None:
            return self._load_for_eval(checkpoint, strict)
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
                if self.eval_stream is not None or self._eval_store is not None:
                    self._end_eval_stream()  # the fit's offload (if any) stopped at the end of fit already
                elif self.param_offload is not None:
                    self.param_offload.stop(restore=self.config.restore_params)
            finally:
                with _meta_stays(self.lightning_module):
                    super().teardown()

    def __getstate__(self) -> dict[str, Any]:
        # their threads, locks and open files stay with this instance
        return {**super().__getstate__(), "eval_stream": None, "_eval_store": None,
                "eval_window": None, "last_eval_window": None}

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

    @contextmanager
    def _weights_readable(self) -> Iterator[None]:
        """The store is open for reading blocks: live during fit, reopened after it."""
        with self._open_store() if self.offloaded else nullcontext():
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """A checkpoint's weights. Offloaded blocks above ``inline_weights_bytes`` are references, streamed
        beside the file by ``save_checkpoint``; smaller ones are gathered (the plain Lightning file)."""
        params = self._offloaded_weights()
        if params is None:
            return super().lightning_module_state_dict()
        with params.referencing_base_files():  # frozen weights read in place: references to the user's files
            if params.layout.offloaded_bytes > self.config.inline_weights_bytes:
                with params.by_reference():
                    return super().lightning_module_state_dict()
            with self._weights_readable():
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
        if layout not in ("lightning", "hf"):
            raise ValueError(f"export_weights: layout must be 'lightning' or 'hf', got {layout!r}")
        params = self._offloaded_weights()
        with self._weights_readable() if params is not None else nullcontext(), \
                params.by_reference() if params is not None else nullcontext():
            state = self.lightning_module.state_dict()
            if layout == "lightning":
                weights.export(path, state, params.read_block if params is not None else lambda source: {})
                return
            read_block = params.read_block if params is not None else None
            export_hf(path, self.lightning_module, state, read_block, max_shard_bytes, merge_adapters)


class _WindowLookahead:
    """An evaluation dataloader read a window ahead: each window's raw batches are queued for the strategy (its step
    computes the window's batches block by block at the window's first batch), then yielded one by one."""

    def __init__(self, dataloader: Any, window: int, queue: deque[list[Any]]) -> None:
        self.dataloader = dataloader
        self.window = window
        self.queue = queue

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, dataset, ...: the dataloader's
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __iter__(self) -> Iterator[Any]:
        self.queue.clear()
        batches = iter(self.dataloader)
        while True:
            window = list(itertools.islice(batches, self.window))
            if not window:
                return
            self.queue.append(window)
            yield from window


@contextmanager
def _meta_stays(module: torch.nn.Module | None) -> Iterator[None]:
    """Lightning's teardown moves the module to the CPU: a model still on the meta device (a setup that refused it
    before anything was read) cannot be copied, and that error would hide the refusal. Inside, it stays where it is."""
    if module is None or not has_meta_tensors(module):
        yield
        return
    module.cpu = lambda: module  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.cpu
