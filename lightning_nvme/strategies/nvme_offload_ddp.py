"""``NVMeOffloadDDPStrategy`` (``Trainer(strategy="nvme_offload_ddp")``): data parallel, each rank keeping
1/N of the optimizer state on its own local disk (ZeRO stage 1 with an NVMe store).

One step on every rank::

    forward + backward; DDP all-reduces the gradients    (every rank holds the full averaged gradient, so
                                                           Lightning's norm clipping is already global)
    the rank's OffloadedOptimizer updates the element ranges it owns, streaming their state through
    its store file ``<store_dir>/store-rank<r>.bin`` (``store_dir`` is node-local)
    every rank broadcasts the ranges it owns as they are updated (``ParamBroadcast``: large ranges in place,
    small ones packed into one preallocated buffer of at most ``broadcast_bucket_bytes``), so all replicas
    hold the same parameters again when the step ends

Ownership is a ``Partition`` balanced by state bytes (``partition_by_bytes``). A checkpoint is rank 0's file
plus one optimizer shard per rank beside it (``lightning_nvme.checkpoint.rank_shards``); it resumes at any
world size.

``overlap="backward"``: a gradient is final only once its all-reduce has completed, not when autograd
accumulates it, so the strategy installs a DDP communication hook (the same averaging all-reduce, with
``gradient_as_bucket_view=True`` so a parameter's ``.grad`` *is* its slice of the reduced bucket). When
bucket k is ready, its all-reduce is launched, then the previous bucket's is awaited (it ran while bucket
k's gradients were computed) and the chunks whose gradients are now all final are updated, while bucket
k's all-reduce and the rest of backward proceed. The last bucket's chunks are updated after backward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nvme.checkpoint import DDP_BACKGROUND_REFUSAL
from lightning_nvme.checks import ConfigError, reject_unknown
from lightning_nvme.fs import atomic
from lightning_nvme.memory import available_host_memory
from lightning_nvme.optim import OffloadedOptimizer, Partition, partition_by_bytes
from lightning_nvme.preflight.resources import check_host_memory_budget
from lightning_nvme.settings import DDPOffloadSettings, from_arguments, with_settings
from lightning_nvme.strategies.offload_strategy import OffloadStrategy
from lightning_nvme.strategies.param_broadcast import ParamBroadcast, broadcast_groups, plan_items
from lightning_nvme.strategies.placement import resolve_budget


def _ddp_arguments() -> list[str]:
    """What ``**kwargs`` may carry besides the settings: ``DDPStrategy``'s own arguments and those it passes on to
    ``DistributedDataParallel`` (all but the module and device ids, which Lightning sets). Anything else is a
    misspelling, refused here rather than by ``DistributedDataParallel`` when training starts."""
    strategy = inspect.signature(DDPStrategy.__init__).parameters
    ddp = inspect.signature(DistributedDataParallel.__init__).parameters
    skip = {"self", "module", "device_ids"}
    return [n for n, p in (*strategy.items(), *ddp.items()) if n not in skip and p.kind is not p.VAR_KEYWORD]


_DDP_ARGUMENTS = _ddp_arguments()


@with_settings(DDPOffloadSettings)
class NVMeOffloadDDPStrategy(OffloadStrategy, DDPStrategy):
    """Data-parallel training, each rank keeping the optimizer state of 1/N of the parameters on local disk.

    Takes the arguments listed below (each defined once in ``lightning_nvme.settings.DDPOffloadSettings``)
    and those of Lightning's ``DDPStrategy``."""

    strategy_name = "nvme_offload_ddp"
    _local_grad_hooks = False
    config: DDPOffloadSettings
    # the settings the constructor builds (set by ``with_settings``): one constructor serves nvme_offload_fsdp too
    settings_class: type[DDPOffloadSettings]

    def __init__(self, store_dir: str | list[str] | None = None, *, accelerator: pl.accelerators.Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen", **kwargs: Any) -> None:
        names = self.settings_class.__dataclass_fields__
        reject_unknown(self.strategy_name, kwargs, [*names, *_DDP_ARGUMENTS])
        settings = {k: v for k, v in kwargs.items() if k in names}
        ddp_kwargs = {k: v for k, v in kwargs.items() if k not in names}  # DDP's own, passed to DistributedDataParallel
        config = from_arguments(self.settings_class, self.strategy_name, {"store_dir": store_dir, **settings})
        self._refuse_settings(config)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method, **ddp_kwargs)
        self._init_offload(config)
        self.broadcast_bucket_bytes = config.broadcast_bucket_bytes
        self.partitions: list[Partition] = []
        self._grad_owner: dict[int, list[tuple[OffloadedOptimizer, int]]] = {}  # id(param) -> (optimizer, index)
        self._reducing: list[tuple[torch.futures.Future, list[torch.Tensor]]] = []  # launched bucket all-reduces
        self._broadcasts: list[ParamBroadcast] = []  # per offloaded optimizer
        self._broadcast_groups: list[dist.ProcessGroup] = []  # one per source rank (see param_broadcast)
        self._in_backward = False  # the closure (forward and backward) of an optimizer step is running

    def _refuse_settings(self, config: DDPOffloadSettings) -> None:
        """The settings this strategy does not support yet, refused by name before Lightning's strategy is built."""
        if config.offload_params:
            raise ConfigError("offload_params", "nvme_offload_ddp does not offload parameters yet. Fix: use "
                              "strategy='nvme_offload' (one device) for parameter offload, or offload_params=False.")
        if config.checkpoint_copy == "background":
            raise ConfigError("checkpoint_copy", DDP_BACKGROUND_REFUSAL)

    @property
    @override
    def _store_rank(self) -> int:
        return self.global_rank

    # ---- the host's memory budget ------------------------------------------------------------------------
    @override
    def _host_budget(self) -> int:
        """``host_memory_budget`` bounds the host, not each process: its ranks share it evenly. Every rank
        decides from the same numbers (the least memory any rank saw available), so all accept or all refuse
        together, before any shelves anything; a rank deciding alone could refuse while the others wait."""
        available = min(self._all_gather(available_host_memory()))
        host = resolve_budget(self.config.host_memory_budget, available)
        check_host_memory_budget(host, self.config.host_memory_budget, available)
        ranks = max(1, self.num_processes)
        if host:
            rank_zero_info(f"{self.strategy_name}: host_memory_budget {host} bytes for the host, {host // ranks} "
                           f"bytes for each of its {ranks} ranks")
        return host // ranks

    # ---- ownership ----------------------------------------------------------------------------------------
    @override
    def _offload_optimizers(self, trainer: pl.Trainer) -> None:
        self.partitions = []
        super()._offload_optimizers(trainer)
        self._broadcasts = []
        if self.world_size > 1:
            if not self._broadcast_groups:  # collective: every rank reaches this in setup
                self._broadcast_groups = broadcast_groups(self.world_size, self.root_device)
            for off, part in zip(self.offloaded, self.partitions):
                items = plan_items(part.owner_pieces(), off.params, self.broadcast_bucket_bytes,
                                   reverse=self.config.overlap == "backward")
                self._broadcasts.append(ParamBroadcast(off.params, items, self.global_rank, self._broadcast_groups))
                off.listener = _Finished(self, self._broadcasts[-1])
        self._grad_owner = {}
        for off in self.offloaded:
            for index, p in enumerate(off.params):
                self._grad_owner.setdefault(id(p), []).append((off, index))

    @override
    def _owned_ranges(self, index: int, optimizer: Optimizer) -> Mapping[int, Sequence[tuple[int, int]]]:
        partition = partition_by_bytes(optimizer, self.world_size, fmt=self.config.state_format_spec)
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            if p.requires_grad and not p.is_contiguous():
                raise ValueError(f"nvme_offload_ddp: parameter {i} of optimizer {index} ({tuple(p.shape)}) is not "
                                 "contiguous, so its owner cannot broadcast it in place; make it contiguous")
        agreed = self.broadcast(partition.to_dict())
        if agreed != partition.to_dict():
            raise RuntimeError(f"nvme_offload_ddp: rank {self.global_rank} partitions optimizer {index} differently "
                               "from rank 0: every rank must build the same model and optimizer (same parameter "
                               "shapes, order, dtypes and requires_grad)")
        self.partitions.append(partition)
        return partition.owned(self.global_rank)

    # ---- overlap="backward": updates start as buckets finish their all-reduce ---------------------------------
    @override
    def configure_ddp(self) -> None:
        if self.config.overlap != "backward":
            return super().configure_ddp()
        if self._ddp_comm_hook is not None:
            raise ValueError("nvme_offload_ddp: overlap='backward' installs its own DDP communication hook, so "
                             "ddp_comm_hook cannot be given too; use overlap='step' with a custom hook")
        self._ddp_kwargs["gradient_as_bucket_view"] = True
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        # (unannotated: DDP checks the hook's annotations by identity, which postponed annotations fail)
        self.model.register_comm_hook(None, lambda state, bucket: self._reduce_bucket(bucket))

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's averaging all-reduce of one bucket; then update what the previous bucket completed."""
        buffer = bucket.buffer()
        buffer.mul_(1.0 / self.world_size)  # averages as DDP's built-in reducer does: multiply by 1/N, then sum
        work = dist.all_reduce(buffer, async_op=True).get_future()
        self._reducing.append((work, bucket.parameters()))
        self._update_reduced(keep_last=1)
        return work.then(lambda fut: fut.value()[0])

    def _update_reduced(self, keep_last: int = 0) -> None:
        while len(self._reducing) > keep_last:
            work, params = self._reducing.pop(0)
            work.wait()
            for p in params:
                for off, index in self._grad_owner.get(id(p), ()):
                    off.grad_ready(index)

    # ---- sharing the update ----------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        self._reducing = []  # reductions of a backward outside this step (manual optimization) are not ours
        off = self.offloaded_for(optimizer)
        if off is not None and self._broadcasts:
            self._broadcasts[self.offloaded.index(off)].begin()

        def marked_closure() -> Any:
            self._in_backward = True
            try:
                return closure()
            finally:
                self._in_backward = False
        return super().optimizer_step(optimizer, marked_closure, model, **kwargs)

    @override
    def _after_update(self, off: OffloadedOptimizer) -> None:
        """Every rank broadcasts the element ranges it updated; afterwards all replicas are identical."""
        self._reducing = []  # all complete: the step updated whatever backward did not
        if self.world_size == 1:
            return
        with torch.no_grad():
            self._broadcasts[self.offloaded.index(off)].finish()

    @override
    def teardown(self) -> None:
        groups, self._broadcast_groups, self._broadcasts = self._broadcast_groups, [], []
        super().teardown()
        if dist.is_available() and dist.is_initialized():
            for group in groups:
                dist.destroy_process_group(group)

    def __getstate__(self) -> dict[str, Any]:
        """Process groups stay with this instance (a copy has none, like the store)."""
        return {**super().__getstate__(), "_broadcast_groups": [], "_broadcasts": []}

    # ---- checkpoints -----------------------------------------------------------------------------------------
    @override
    def _recover_before_load(self, path: str) -> None:
        if self.is_global_zero:
            atomic.recover(path)  # finish or undo an interrupted commit, once, before any rank reads
        self.barrier("nvme_offload_ddp.load_checkpoint")

    @override
    def _save_arguments(self) -> dict[str, Any]:
        """Every rank saves its shard, committed together (``Saver``: the ranks agree in the save)."""
        return {**super()._save_arguments(), "ranks": self, "partitions": self.partitions}

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (one process: ``[obj]``)."""
        return self._all_gather(obj)

    def _all_gather(self, obj: Any) -> list[Any]:
        if not dist.is_available() or not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


class _Finished:
    """The ``UpdateListener`` of a data-parallel offloaded optimizer: hands each chunk's finished parameters
    to the broadcast; the first chunk updated outside backward posts the receives."""

    def __init__(self, strategy: NVMeOffloadDDPStrategy, broadcast: ParamBroadcast) -> None:
        self.strategy = strategy
        self.broadcast = broadcast

    def before_update(self, touched: Sequence[torch.Tensor]) -> None:
        if not self.strategy._in_backward:
            self.broadcast.post_receives()

    def after_update(self, touched: Sequence[torch.Tensor], finished: Sequence[torch.Tensor]) -> None:
        self.broadcast.finished(finished)
