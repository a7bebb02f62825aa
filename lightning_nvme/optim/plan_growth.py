"""``GrowingPlan``: the plan follows the optimizer, and with ``overlap="backward"`` updates follow gradients.

Why: parameters join an optimizer after setup (``add_param_group``, ``requires_grad_(True)`` by a
fine-tuning callback); each is planned, given store space and stepped from the step it first has a
gradient. With ``overlap="backward"`` a chunk is updated as soon as every parameter in it has its final
gradient (``register_post_accumulate_grad_hook``), so most optimizer I/O hides behind backward compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_nvme.memory import keep_freed_heap
from lightning_nvme.optim.chunk_update import ChunkUpdater
from lightning_nvme.optim.plan import plan_chunks
from lightning_nvme.optim.probe import UnsupportedOptimizerError


class GrowingPlan(ChunkUpdater):
    """Plan growth (``_follow_optimizer``) and the backward hooks (``grad_ready``)."""

    _known: list[int]  # id of each param, in the order the plan's indices refer to
    _signature: list[tuple[int, int]]  # (id, length) of each group's param list when last checked
    _unplanned: list[tuple[int, torch.Tensor]]  # params the plan has not decided on (frozen at setup)
    _waiting: dict[int, set[int]]  # chunk index -> param indices whose gradient is not final yet
    _hooks: list[Any]  # handles of the post-accumulate-grad hooks

    def _follow_optimizer(self) -> None:
        """Plan, store and step from now on every parameter that has a gradient but no plan yet."""
        signature = [(id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups]
        if signature != self._signature:  # groups added or edited: check what changed (cheap path otherwise)
            params = self.params
            if len(params) < len(self._known) or any(id(p) != k for p, k in zip(params, self._known)):
                raise UnsupportedOptimizerError(
                    f"{type(self.optimizer).__name__}: parameters were removed from or reordered in its param "
                    "groups during training; the offloaded state follows parameters by position, so only appending "
                    "(optimizer.add_param_group) is supported. Rebuild the optimizer, or use strategy='auto'.")
            self._known, self._signature = [id(p) for p in params], signature
            self._unplanned = [(i, p) for i, p in enumerate(params) if i not in self.plan.planned]
        new = [i for i, p in self._unplanned if p.grad is not None]
        if not new:
            return
        if self.owned is not None:
            raise UnsupportedOptimizerError(
                f"nvme_offload_ddp: parameters {new} of {type(self.optimizer).__name__} became trainable after fit "
                "started (optimizer.add_param_group or requires_grad_(True), e.g. BackboneFinetuning); data-parallel "
                "ranks partition the optimizer state once at setup and cannot grow it. Make them trainable (and in "
                "the optimizer) from the start, or use strategy='nvme_offload' (single device).")
        if self.listener is not None:
            raise UnsupportedOptimizerError(
                f"nvme_offload: parameters {new} of {type(self.optimizer).__name__} became trainable after fit started "
                "(optimizer.add_param_group or requires_grad_(True), e.g. BackboneFinetuning); with offload_params=True "
                "the blocks written back after each update are fixed at setup. Make them trainable (and in the "
                "optimizer) from the start, or set offload_params=False.")
        extra = plan_chunks(self.optimizer, self.chunk_bytes, self.name, only=new, first_chunk=len(self.chunks),
                            specs=self.plan.specs, fmt=self.fmt)  # the same state format as the rest of the plan
        self.reads.drain()
        store = self._live_store()
        store.add_regions([(c.region, c.nbytes) for c in extra.chunks])
        self.capacity.update({c.index: store.region(c.region).capacity for c in extra.chunks})
        self.reads.fit_ring(self.fence)
        self.chunks.extend(extra.chunks)
        self.resident.extend(extra.resident)
        self.plan.planned |= extra.planned
        self._unplanned = [(i, p) for i, p in self._unplanned if i not in extra.planned]
        self._index(extra)
        self._set_order()
        if self.overlap == "backward" and self.grad_hooks:
            self._install_grad_hooks(extra.planned)

    def _set_order(self) -> None:
        """Chunks in update order: as planned, or last first with ``overlap="backward"`` (backward's order)."""
        self._order = list(range(len(self.chunks)))
        if self.overlap == "backward":
            self._order.reverse()

    def _install_grad_hooks(self, indices: set[int] | None = None) -> None:
        for index, p in enumerate(self.params):
            if p.requires_grad and (indices is None or index in indices):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(index)))

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self.grad_ready(index)
        return hook

    def grad_ready(self, index: int) -> None:
        """Parameter ``index``'s gradient is final for this step: update every chunk now complete."""
        if not self._armed:
            return
        for chunk, _piece in self.pieces_of.get(index, []):
            if chunk is None:
                continue  # resident: updated after the chunks
            waiting = self._waiting.get(chunk.index)
            if waiting is None:
                continue
            waiting.discard(index)
            if not waiting and chunk.index not in self._done:
                with keep_freed_heap(trim=False):  # pieces of this chunk share temporaries; backward's heap kept
                    self._update_chunk(chunk.index)
