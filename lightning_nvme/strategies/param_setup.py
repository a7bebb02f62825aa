"""The single-device strategy's parameter offload at setup: its blocks started in the store, those kept on the device
(``device_memory_budget``), those the shelf may hold (``host_memory_budget``), and the module kept where it is when a
setup refuses it.

Why a module of functions: each step reads the ``ParamOffload``, the store and the settings the strategy passes in,
never the strategy's own state; ``NVMeOffloadStrategy`` calls them from its hooks (``_start_offload``,
``_shelf_items``, ``teardown``) and keeps to what Lightning calls. The plans themselves are ``placement``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_nvme.checks import ConfigError
from lightning_nvme.constants import MiB
from lightning_nvme.optim import OffloadedOptimizer
from lightning_nvme.params import ParamOffload
from lightning_nvme.params.materialize import has_meta_tensors
from lightning_nvme.preflight.resources import check_device_memory_budget
from lightning_nvme.settings import OffloadSettings
from lightning_nvme.store import FlatStore
from lightning_nvme.strategies.placement import DeskPlan, Item, block_item, desk_block_item, plan_desk
from lightning_nvme.strategies.setup_checks import refuse_stateless


def start_param_offload(strategy_name: str, config: OffloadSettings, params: ParamOffload, store: FlatStore,
                        offloaded: Sequence[OffloadedOptimizer]) -> None:
    """Move the blocks into ``store`` (after the optimizers are offloaded into it: their chunks are planned)."""
    refuse_stateless(strategy_name, offloaded, params)
    params.start(store, [p for off in offloaded for r in off.regions() for p in r.params])
    layout, frozen = params.layout, params.frozen
    in_place = (f", of which {frozen.head_bytes / MiB:.1f} MiB of frozen parameters in {len(frozen.heads)} "
                f"blocks read in place from {len(frozen.files)} base file(s) (frozen_weights='in_place', "
                f"{'O_DIRECT' if all(f.direct_fd >= 0 for f in frozen.files.values()) else 'buffered'})"
                if frozen is not None else "")
    rank_zero_info(f"{strategy_name}: parameters of {len(layout.blocks)} blocks offloaded "
                   f"({layout.offloaded_bytes / MiB:.1f} MiB{in_place}); {len(layout.outside_blocks)} parameters "
                   f"outside blocks, in memory ({layout.outside_bytes / MiB:.1f} MiB); "
                   f"param_prefetch={config.param_prefetch}")


def plan_device_blocks(strategy_name: str, config: OffloadSettings, params: ParamOffload,
                       device: torch.device) -> DeskPlan | None:
    """``device_memory_budget``: the blocks worth most host <-> device copies per byte stay on the GPU (copied
    up once, here); planned before the shelf, which then holds none of them (they no longer move). None: no budget."""
    budget = config.device_memory_budget
    if not budget:
        return None
    assert params.residency is not None
    if not params.residency.transfer.device_copies:
        raise ConfigError("device_memory_budget", f"{strategy_name}: device_memory_budget={budget} keeps "
                          "blocks in GPU memory, but the parameters are used in host memory (device "
                          f"{device}): it would be ignored. Fix: host_memory_budget keeps blocks in "
                          "host RAM; set device_memory_budget=0 off CUDA.")
    check_device_memory_budget(budget, device)
    plan = plan_desk([desk_block_item(b.region, params.block_bytes(b), b.trainable) for b in params.blocks], budget)
    params.keep_on_desk(plan.kept)
    rank_zero_info(f"{strategy_name}: {plan.summary()}")
    return plan


def block_items(params: ParamOffload, store: FlatStore, desk_plan: DeskPlan | None) -> list[Item]:
    """The blocks the shelf may hold: those that move (not kept on the device), each its writable bytes (a block
    whose frozen weights are read in place: its tail only)."""
    on_desk = desk_plan.kept if desk_plan is not None else set()
    return [block_item(b.region, store.region(b.region).capacity, 0 if params.in_place(b) else b.writable_offset,
                       b.trainable)
            for b in params.blocks if b.region not in on_desk and store.region(b.region).capacity]


@contextmanager
def meta_stays(module: torch.nn.Module | None) -> Iterator[None]:
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
