"""``StreamedEvaluation``: validate / test / predict of a model whose blocks are not in memory (``offload_params=True``
outside fit), the state ``NVMeOffloadStrategy`` holds for it between its hooks.

Why an object of its own: a streamed evaluation has its own life cycle (started by ``model_to_device``, given its
weights by ``load_model_state_dict``, ended by ``teardown``) and its own state (the ``ForwardStream``, the store a
fit left the blocks in, the layer-major window and the batches read ahead for it), none of which training reads. The
strategy's hooks pass it what it needs (the module, the device, how to reopen the store) and delegate; the blocks
are read by ``params.stream`` and computed window by window by ``params.window``.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_nvme.checkpoint import weights
from lightning_nvme.constants import MiB
from lightning_nvme.memory import release_freed_memory
from lightning_nvme.params import ParamOffload, is_placeholder
from lightning_nvme.params.materialize import copy_checked, has_meta_tensors, initial_weights, materialize
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
from lightning_nvme.settings import OffloadSettings
from lightning_nvme.store import FlatStore


class StreamedEvaluation:
    """One strategy's streamed evaluations: at most one running (``stream``), the figures of the last one kept."""

    def __init__(self, strategy_name: str, config: OffloadSettings) -> None:
        self.strategy_name = strategy_name
        self.config = config
        self.stream: ForwardStream | None = None  # the running evaluation's block hooks
        self.stats: StreamStats | None = None  # the last streamed evaluation's reads (kept after it)
        self.fitted: ParamOffload | None = None  # the fit's offload whose store holds the weights, or None
        self.store: FlatStore | None = None  # that store, reopened read only for the evaluation
        self.window: LayerMajorWindow | None = None  # eval_window > 1: blocks read once per window of batches
        self.last_window: LayerMajorWindow | None = None
        self.windows: deque[list[Any]] = deque()  # windows of raw batches read ahead (``WindowLookahead``)

    @property
    def running(self) -> bool:
        return self.stream is not None or self.store is not None

    def start(self, module: torch.nn.Module, device: torch.device, reopen_store: Callable[[], FlatStore]) -> None:
        """Outside fit, a model whose blocks are not in memory is evaluated block by block (``params.stream``):
        from the store a fit left them in (``restore_params=False``; ``reopen_store()`` opens it), or, for a model
        built on the meta device, from its own initial weights (a safetensors directory read in place) or the
        checkpoint loaded next (``ckpt_path``: ``load`` sets the source). Only the parameters outside the blocks are
        materialized. A model in memory is evaluated in memory (nothing to stream)."""
        s = self.config
        classes = None if s.param_block_classes is None else tuple(s.param_block_classes)
        source: BlockSource | None = None
        if self.fitted is not None:
            store = self.store = reopen_store()  # closed at teardown; read only
            layout = self.fitted.layout
            source = StoreBlocks(self.fitted.read_block, f"the store {store.path}")
        elif has_meta_tensors(module) or any(is_placeholder(p) for p in module.parameters()):  # (an earlier stream's)
            layout = ParamOffload(module, classes, s.param_prefetch, device).layout
            streamed = {id(slot.param) for b in layout.blocks for slot in b.slots}
            check_streamable(module, layout)
            fresh = any(slot.param.is_meta for b in layout.blocks for slot in b.slots)  # never initialized
            materialize(module, device, skip=streamed)  # the parameters outside the blocks only
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
        ckpt_path = getattr(getattr(module, "trainer", None), "ckpt_path", None)
        self.stream = ForwardStream(
            layout.blocks, source, s.param_prefetch, device,
            unsourced=f"{self.strategy_name}: the block weights of {type(module).__name__} are not in memory (built on "
                      "the meta device, or placeholders left by an earlier streamed evaluation from a checkpoint or by a "
                      "fit in another trainer with restore_params=False) and nothing here gives them: no "
                      "initial_weights() covering them and no ckpt_path. Pass ckpt_path=... to validate/test/predict "
                      "(trainer.save_checkpoint of the fit), or build the model in memory.")
        for block in layout.blocks:
            self.stream.unbind(block)  # placeholders on the device the blocks run on
        self.stream.install()
        self.windows.clear()
        if s.eval_window > 1:
            self.window = LayerMajorWindow(self.stream, s.eval_window, s.eval_activation_bytes)
        rank_zero_info(f"{self.strategy_name}: streamed evaluation of {len(layout.blocks)} blocks "
                       f"({layout.offloaded_bytes / MiB:.1f} MiB) from "
                       f"{'the checkpoint ' + str(ckpt_path) if ckpt_path else (source.describe() if source else '?')}; "
                       f"param_prefetch={s.param_prefetch}")

    def end(self) -> None:
        if self.window is not None:
            self.last_window = self.window  # its figures (windows, compute and read-wait seconds) stay
        self.window = None
        self.windows.clear()
        if self.stream is not None:
            self.stream.remove()
            self.stats, self.stream = self.stream.stats, None
        if self.store is not None:
            self.store.close()
            self.store = None

    def load(self, checkpoint: Mapping[str, Any], strict: bool, module: torch.nn.Module) -> None:
        """A checkpoint for streamed evaluation: the block weights become the stream's source (read per forward from
        the beside file, or from the dict when inline); the others are copied into the module. Not through
        ``load_state_dict``: its hooks would bring the blocks into memory."""
        stream = self.stream
        assert stream is not None
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
        stream.source = TensorBlocks(source, f"the checkpoint {getattr(getattr(module, 'trainer', None), 'ckpt_path', '')}")

    # ---- the layer-major window (eval_window > 1, lightning_nvme.params.window) ---------------------------
    def lookahead(self, dataloader: Any) -> Any:
        """``dataloader``, read a window ahead when windows are computed (``eval_window`` > 1)."""
        return dataloader if self.window is None else WindowLookahead(dataloader, self.window.window, self.windows)

    def windowed(self, step: Callable[..., Any], context: Callable[[], AbstractContextManager[Any]],
                 args: tuple, kwargs: dict, transfer: Callable[[Any, int], Any]) -> Any:
        """A batch's step; the first of a window first computes the whole window block by block (the window's other
        batches brought to the device by ``transfer(batch, dataloader_idx)``, as the loop would before their steps)."""
        window = self.window
        if window is None or not args:
            return step(*args, **kwargs)
        if not window.serving:
            window.clear()
            raw = self.windows.popleft() if self.windows else [args[0]]
            batch, index, rest = args[0], args[1] if len(args) > 1 else 0, args[2:]
            dataloader_idx = rest[0] if rest else 0
            batches = [batch] + [transfer(b, dataloader_idx) for b in raw[1:]]
            for j, b in enumerate(batches):
                window.capture(functools.partial(step, b, index + j, *rest, **kwargs) if len(args) > 1
                               else functools.partial(step, b, **kwargs))
            with context():
                window.compute()
        with window.serve():
            out = step(*args, **kwargs)
        window.finish_step()
        return out

    def __getstate__(self) -> dict[str, Any]:
        # their threads, locks and open files stay with this instance
        return {**vars(self), "stream": None, "store": None, "window": None, "last_window": None}


class WindowLookahead:
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
