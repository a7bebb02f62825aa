"""``BackwardTrigger``: with ``overlap="backward"``, a chunk is updated as soon as every parameter in it has its
final gradient, inside backward.

Why: most of the optimizer's I/O then hides behind backward compute. A parameter's gradient is final when its
post-accumulate-grad hook fires (``hooks=True``), or when the caller says so through ``grad_ready`` (data
parallel: only once its all-reduce has completed). The trigger is armed only while the step's closure runs
(``armed``): a hook firing outside it (a backward of the user's own, the probe) updates nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_nvme.memory import keep_freed_heap
from lightning_nvme.optim.chunk_update import ChunkUpdater
from lightning_nvme.optim.plan import ChunkPlan


class BackwardTrigger:
    """Calls ``updater.update_chunk`` for each chunk of ``plan`` whose parameters' gradients are all final.

    ``hooks``: install post-accumulate-grad hooks on the plan's trainable parameters (and on those that
    join later, ``watch``); ``False``: the caller calls ``grad_ready``."""

    def __init__(self, plan: ChunkPlan, updater: ChunkUpdater, *, hooks: bool) -> None:
        self.plan = plan
        self.updater = updater
        self.hooks = hooks
        self.is_armed = False
        self.waiting: dict[int, set[int]] = {}  # chunk index -> param indices whose gradient is not final yet
        self.handles: list[Any] = []  # the hooks' removable handles
        if hooks:
            self.watch()

    def watch(self, indices: Collection[int] | None = None) -> None:
        """Hook the parameters ``indices`` (all, by default) if this trigger installs hooks."""
        if not self.hooks:
            return
        for index, p in enumerate(self.plan.params):
            if p.requires_grad and (indices is None or index in indices):
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(index)))

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self.grad_ready(index)
        return hook

    @contextmanager
    def armed(self) -> Iterator[None]:
        """While the step's closure runs: every chunk waits for all of its parameters."""
        self.waiting = {c.index: {p.index for p in c.pieces} for c in self.plan.chunks}
        self.is_armed = True
        try:
            yield
        finally:
            self.is_armed = False

    def grad_ready(self, index: int) -> None:
        """Parameter ``index``'s gradient is final for this step: update every chunk now complete."""
        if not self.is_armed:
            return
        for chunk, _piece in self.plan.pieces_of.get(index, []):
            if chunk is None:
                continue  # unchunked: updated after the chunks
            waiting = self.waiting.get(chunk.index)
            if waiting is None:
                continue
            waiting.discard(index)
            if not waiting and chunk.index not in self.updater.done:
                with keep_freed_heap(trim=False):  # pieces of this chunk share temporaries; backward's heap kept
                    self.updater.update_chunk(chunk.index, in_backward=True)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __getstate__(self) -> dict[str, Any]:
        """A copy (deepcopy, pickle) has no hooks and is not armed."""
        return {**self.__dict__, "handles": [], "is_armed": False}
