"""``BlockScheduler``: module hooks that make each block resident exactly while it is needed.

Forward: a block's pre-forward hook acquires it (waiting for its read) and starts the reads of the
next ``prefetch`` blocks; its post-forward hook releases it. Where autograd keeps the ``nn.Parameter``
objects themselves as saved tensors, swapping ``.data`` back in before the block's backward is enough for
backward (and for recomputation under activation checkpointing) to see the real values. Some ops save a
view instead (``F.linear``: ``weight.t()``), which keeps the bound buffer alive until backward: harmless
in host memory, unbounded on a GPU, so there activation checkpointing is required (``NOT_CHECKPOINTED``).

Backward (the FSDP2 pattern): a multi-grad hook on the block's outputs fires before any of the block's
backward runs -> acquire it, prefetch the blocks before it; an identity autograd function on the
block's inputs fires once the gradient w.r.t. the inputs is complete, i.e. the block's backward is
done -> release it. Blocks whose inputs need no gradient are released by a callback at the end of
backward. While an optimizer updates in backward, a block is also held until every one of its
trainable parameters has been updated and can be written back (``hold_for_update``), unless its frozen
head is larger than its trainable tail (LoRA): such a block leaves memory after its backward like any
other, and its update reads back only the trainable tail (``BlockResidency.acquire(tail=True)``). Why:
an optimizer chunk of adapters spans many blocks, and holding each until that chunk's update kept every
frozen weight of them in memory (LoRA needed more than the full finetune; docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_nvme.checks import ConfigError
from lightning_nvme.params.layout import BlockLayout
from lightning_nvme.params.residency import BlockResidency

NOT_CHECKPOINTED = (
    "autograd kept the device copy of {block}'s parameters after its forward (an op such as F.linear saves a "
    "view of the weight, not the Parameter): without activation checkpointing every block would stay on the "
    "GPU until its backward, which uploads it again. Activation checkpointing is required with "
    "offload_params=True on CUDA: wrap each block's call in torch.utils.checkpoint.checkpoint(block, x, "
    "use_reentrant=False) (or the model's gradient-checkpointing switch), or set offload_params=False.")

FWD, BWD, KEEP, PENDING, UPDATE, USER, RECOMPUTE = ("forward", "backward", "keep", "pending", "update", "user",
                                                    "recompute")


def holds_for_update(block: BlockLayout) -> bool:
    """Keep the block in memory from its backward to its update: worth it when most of its bytes are updated
    (a re-read would fetch them again), not when a frozen head dominates (only the tail is re-read)."""
    return block.writable_offset <= block.nbytes - block.writable_offset


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Call:
    """One forward call of a block whose backward is still to come."""

    block: BlockLayout
    pre: bool = False
    post: bool = False


class _PostBackward(torch.autograd.Function):
    """Identity on the block's inputs; its backward runs once the inputs' gradients are complete."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.done()
        return (None, *grads)


class BlockScheduler:
    def __init__(self, residency: BlockResidency, prefetch: int) -> None:
        self.residency = residency
        self.blocks = residency.blocks
        self.prefetch = prefetch
        self.hold_for_update = False  # set by the strategy while an optimizer updates during backward
        self.pending: dict[int, set[int]] = {}  # block index -> id(param) still to be updated this step
        self.planned: set[int] = set()  # id(param) of every parameter an offloaded optimizer updates
        self._open: list[_Call] = []
        self._recomputed: list[BlockLayout] = []
        self._stack: dict[int, list[_Call]] = {b.index: [] for b in self.blocks}
        self._handles: list[Any] = []
        self._callback_queued_for = -1

    def install(self) -> None:
        for block in self.blocks:
            self._handles.append(block.module.register_forward_pre_hook(self._pre_forward(block), with_kwargs=True))
            self._handles.append(block.module.register_forward_hook(self._post_forward(block)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- forward ---------------------------------------------------------------------------------------
    def _pre_forward(self, block: BlockLayout) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if in_backward():
                # Recomputation under activation checkpointing: the block's backward holds it already. The
                # recomputation may stop early (checkpoint early stop) and never reach the post-forward hook,
                # so nothing is acquired per call; a block not held is held until the end of backward.
                if not +self.residency.holders(block):
                    self.residency.acquire(block, RECOMPUTE)
                    self._recomputed.append(block)
                return None
            self.residency.acquire(block, FWD)
            for ahead in self.blocks[block.index + 1:block.index + 1 + self.prefetch]:
                self.residency.prefetch(ahead)
            self.residency.upload_ready()
            call = _Call(block)
            self._stack[block.index].append(call)
            if not torch.is_grad_enabled():
                return None
            flat, spec = tree_flatten((args, kwargs))
            needs = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
            if not needs:
                return None
            wrapped = _PostBackward.apply(lambda: self._post_backward(call), *(flat[i] for i in needs))
            for i, t in zip(needs, wrapped):
                flat[i] = t
            return tree_unflatten(flat, spec)
        return hook

    def _post_forward(self, block: BlockLayout) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if in_backward():
                return
            call = self._stack[block.index].pop()
            outputs = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
            if outputs and torch.is_grad_enabled():
                self._open.append(call)
                register_multi_grad_hook(outputs, lambda _grad: self._pre_backward(call), mode="any")
                # The last blocks of the forward are the first of the backward: keep them resident.
                if block.index >= len(self.blocks) - self.prefetch and not self.residency.holders(block)[KEEP]:
                    self.residency.acquire(block, KEEP)
            self.residency.release(block, FWD)
            self.residency.upload_ready()  # the next block's read had this block's compute to complete
            if torch.is_grad_enabled() and not self.residency.is_resident(block) and self.residency.retained(block):
                raise ConfigError("offload_params", NOT_CHECKPOINTED.format(block=block.name))
        return hook

    # ---- backward --------------------------------------------------------------------------------------
    def _pre_backward(self, call: _Call) -> None:
        if call.pre:
            return
        call.pre = True
        block = call.block
        self.residency.acquire(block, BWD)
        if self.residency.holders(block)[KEEP]:
            self.residency.release(block, KEEP)
        if self.hold_for_update and block.index not in self.pending and holds_for_update(block):
            todo = {id(s.param) for s in block.slots if s.trainable and id(s.param) in self.planned}
            if todo:
                self.pending[block.index] = todo
                self.residency.acquire(block, PENDING)
        for behind in reversed(self.blocks[max(0, block.index - self.prefetch):block.index]):
            self.residency.prefetch(behind)
        self.residency.upload_ready()
        task = torch._C._current_graph_task_id()
        if task != self._callback_queued_for:
            self._callback_queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _post_backward(self, call: _Call) -> None:
        if call.pre and not call.post:
            call.post = True
            self.residency.release(call.block, BWD)
            self.residency.upload_ready()  # the block before it, read during this block's backward

    def _end_backward(self) -> None:
        """Backward is over: release what input hooks could not (inputs without gradient); a parameter
        without a gradient will not be updated in backward, so stop waiting for it."""
        for call in self._open:
            self._post_backward(call)
        self._open = [c for c in self._open if not c.pre]
        self._release_recomputed()
        self._callback_queued_for = -1
        for block in self.blocks:
            todo = self.pending.get(block.index)
            if todo is not None:
                todo.difference_update(id(s.param) for s in block.slots if s.param.grad is None)
                self._maybe_done(block)

    def _release_recomputed(self) -> None:
        for block in self._recomputed:
            self.residency.release(block, RECOMPUTE)
        self._recomputed = []

    # ---- optimizer updates ---------------------------------------------------------------------------
    def updated(self, block: BlockLayout, finished: list[torch.Tensor]) -> None:
        todo = self.pending.get(block.index)
        if todo is not None:
            todo.difference_update(id(p) for p in finished)
            self._maybe_done(block)

    def _maybe_done(self, block: BlockLayout) -> None:
        if not self.pending.get(block.index, True):
            del self.pending[block.index]
            self.residency.release(block, PENDING)

    def finish_step(self) -> None:
        """End of a training step (or of any pass): nothing may stay held; drop prefetched blocks unused."""
        for index in list(self.pending):
            del self.pending[index]
            self.residency.release(self.blocks[index], PENDING)
        for call in self._open:
            self._post_backward(call)
        self._open = []
        self._release_recomputed()
        for block in self.blocks:
            held = self.residency.holders(block)
            if held[KEEP]:
                self.residency.release(block, KEEP)
        self.residency.evict_unheld()
