"""``NVMeOffloadFSDPStrategy`` (``Trainer(strategy="nvme_offload_fsdp", devices=N)``): parameters, gradients and
optimizer state sharded 1/N across the ranks, each rank's shard in its own store on its local disk (ZeRO stage 3
with an NVMe tier; docs/fsdp.md).

Built on ``nvme_offload_ddp`` (its process groups, host budget, sharded checkpoints and their resharding on load),
but the model is not wrapped in ``DistributedDataParallel``: no rank ever holds the whole gradient. The blocks'
shards, gathers and reductions are ``lightning_nvme.params.sharded.ShardedParams``; the optimizer is the user's own,
run by ``OffloadedOptimizer`` on the elements this rank owns (its shard of each block, 1/N of every other
parameter), during backward (``overlap="backward"``) as each block's reduce-scatter completes.

A checkpoint is ``nvme_offload_ddp``'s: rank 0's file with the weights gathered into it (one block at a time,
every rank taking part) and one optimizer shard per rank beside it, named by parameter and element range, so it
resumes at any number of ranks (and under ``nvme_offload_ddp``, ``nvme_offload`` or, converted, plain Lightning).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nvme.checks import ConfigError
from lightning_nvme.constants import MiB
from lightning_nvme.models.hub_export import MAX_SHARD_BYTES
from lightning_nvme.optim import OffloadedOptimizer, Partition, UpdateListener
from lightning_nvme.optim.plan import Plan, bytes_per_element, describe_params
from lightning_nvme.params.comm import Comm, open_comm
from lightning_nvme.params.materialize import has_meta_tensors
from lightning_nvme.params.offload import chunks_per_unit
from lightning_nvme.params.sharded import ShardedParams, owned_ranges
from lightning_nvme.params.stream import BesideSource
from lightning_nvme.settings import DDPOffloadSettings, FSDPOffloadSettings, with_settings
from lightning_nvme.strategies.nvme_offload_ddp import NVMeOffloadDDPStrategy
from lightning_nvme.strategies.placement import Item, block_item
from lightning_nvme.strategies.weight_export import check_layout, export, write_export

# Settings of the single-device strategy that this one does not carry yet, with the value it runs with; any other
# value is refused by name at construction (docs/fsdp.md, "Not yet").
_NOT_YET: dict[str, tuple[tuple[Any, ...], str]] = {
    "overlap": (("backward",), "each block's gradient shard is consumed by its update during backward; overlap='step' "
                            "would keep every block gathered until the step"),
    "checkpoint_copy": (("auto", "streamed", "reflink"), "each rank streams (or reflinks) its shard during the save; "
                                                          "the background copy is single-device only"),
    "device_memory_budget": ((0,), "blocks are gathered per use; none is kept on the device"),
    "eval_window": ((1,), "evaluation gathers each block per batch"),
}


@with_settings(FSDPOffloadSettings)
class NVMeOffloadFSDPStrategy(NVMeOffloadDDPStrategy):
    """Fully sharded data parallel: each rank keeps 1/N of every block's parameters, their gradients and their
    optimizer state, in its own store on local disk.

    Takes the arguments listed below (each defined once in ``lightning_nvme.settings.FSDPOffloadSettings``; see
    docs/fsdp.md for those not supported yet) and those of Lightning's ``DDPStrategy`` that concern the process
    group (``process_group_backend``, ``timeout``, ...). ``offload_params`` is implied: the shards always live in
    the store."""

    strategy_name = "nvme_offload_fsdp"
    _frees_grads = True  # a block's gradient lives from its backward to its update, never the whole model's
    config: FSDPOffloadSettings

    def __init__(self, store_dir: str | list[str] | None = None, *, accelerator: pl.accelerators.Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen", **kwargs: Any) -> None:
        super().__init__(store_dir, accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method, **kwargs)
        self.sharded: ShardedParams | None = None
        self._shard_group: Any = None  # the gathers' and reductions' own process group
        self._comm: Comm | None = None  # what moves their bytes (params.comm: the backend or shared memory)
        self._resumed: BesideSource | None = None  # a checkpoint's weights for a model on the meta device

    @override
    def _refuse_settings(self, config: DDPOffloadSettings) -> None:
        for key, (allowed, why) in _NOT_YET.items():
            if getattr(config, key) not in allowed:
                raise ConfigError(key, f"{self.strategy_name} does not support {key}={getattr(config, key)!r} yet "
                                       f"({why}). Fix: {key}={allowed[0]!r}, or strategy='nvme_offload' (one device).")

    # ---- setup -----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.sharded = None
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_supported(trainer)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.sharded is None:
            raise ValueError(f"{self.strategy_name}: configure_optimizers returned no optimizer, so nothing would "
                             "reduce the gradients or update the shards. Return an optimizer, or use strategy='ddp'.")

    def _check_supported(self, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise ConfigError("automatic_optimization", f"{self.strategy_name}: manual optimization is not supported "
                              "yet: each block is updated during its backward, inside the optimizer step's closure. "
                              "Fix: automatic optimization, or strategy='nvme_offload_ddp'.")
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError("accumulate_grad_batches", f"{self.strategy_name}: accumulate_grad_batches="
                              f"{trainer.accumulate_grad_batches} is not supported yet: each block's gradient is "
                              "reduce-scattered and consumed in the backward that produced it. Fix: "
                              "accumulate_grad_batches=1 with a larger batch, or strategy='nvme_offload_ddp'.")

    @override
    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: the blocks' gradients are reduce-scattered and the other parameters'
        all-reduced by ``ShardedParams``. As DDP does when it wraps the model, every rank starts from rank 0's
        parameters and buffers."""
        assert self.model is not None
        if not has_meta_tensors(self.model):  # built on the meta device: ShardedParams.start broadcasts as it builds
            _sync_module_states(self.model)

    @override
    def model_to_device(self) -> None:
        """A model built on the meta device stays there until ``ShardedParams.start`` initializes it module by
        module, sharding each block into the store as it completes (the whole model is never in memory)."""
        assert self.model is not None
        if not has_meta_tensors(self.model):
            super().model_to_device()

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module()`` and ``configure_model`` create parameters on the meta device (no memory), as
        ``nvme_offload`` does with ``offload_params``; setup initializes them block by block into the shards.
        ``empty_init=False`` asks for a model in memory."""
        if empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
    def _offload_optimizers(self, trainer: pl.Trainer) -> None:
        self.partitions = []
        if self._shard_group is None:
            self._shard_group = dist.new_group(list(range(self.world_size))) if dist.is_initialized() else None
        s = self.config
        if self._comm is None:
            self._comm = open_comm(s.collectives, self._shard_group, self.root_device, s.collective_buffer_bytes)
        classes = None if s.param_block_classes is None else tuple(s.param_block_classes)
        self.sharded = ShardedParams(trainer.lightning_module, classes, self.global_rank, self.world_size,
                                     self._shard_group, s.param_prefetch, self.root_device, reduced=self._reduced,
                                     reduce_order=s.reduce_order, inflight=max(1, s.param_prefetch),
                                     state_align=s.state_format_spec.align, comm=self._comm)
        super(NVMeOffloadDDPStrategy, self)._offload_optimizers(trainer)
        self._grad_owner = {}
        for off in self.offloaded:
            for index, p in enumerate(off.params):
                self._grad_owner.setdefault(id(p), []).append((off, index))

    @override
    def _owned_ranges(self, index: int, optimizer: Optimizer) -> dict[int, list[tuple[int, int]]]:
        assert self.sharded is not None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        fmt = self.config.state_format_spec
        infos, _ = describe_params(optimizer, fmt=fmt)
        per_elem = {i.index: bytes_per_element(i.keys, fmt) for i in infos}
        ranges = [owned_ranges(self.sharded, params, r) for r in range(self.world_size)]
        state = [int(sum((hi - lo) * per_elem.get(i, 0) for i, rs in r.items() for lo, hi in rs)) for r in ranges]
        partition = Partition(self.world_size, ranges, state)
        agreed = self.broadcast(partition.to_dict())
        if agreed != partition.to_dict():
            raise RuntimeError(f"{self.strategy_name}: rank {self.global_rank} shards optimizer {index} differently "
                               "from rank 0: every rank must build the same model and optimizer")
        self.partitions.append(partition)
        return ranges[self.global_rank]

    @override
    def _chunk_units(self) -> Mapping[int, int] | None:
        """No optimizer chunk holds state of two blocks: a block stays gathered (and its owned gradient alive) until
        its owned parameters are updated, and a chunk spanning blocks held them all until its last one's reduction
        (with a decay / no-decay parameter split, or LoRA adapters packed together, every block of the model)."""
        assert self.sharded is not None
        return {id(p): u.index for u in self.sharded.units for p in u.params}

    @override
    def _read_ahead(self, plan: Plan) -> int:
        """With ``overlap="backward"``: at least the chunks of one block's shard of state, so a block's state is read
        while the block after it (in backward order) computes, as ``nvme_offload`` does with ``offload_params``. Why:
        with only ``prefetch_depth`` chunks ahead (16 MiB at the default 8 MiB chunks, of a 2.56 B model's 315 MB
        per block and rank) each update waited for its own state's read, and the step was the sum of its compute,
        its disk and its collectives, not their maximum (``benchmarks/fsdp_offload.py``, docs/performance.md). Memory:
        one chunk buffer per chunk read ahead (``chunk_bytes`` each), about one block shard's optimizer state."""
        depth = super()._read_ahead(plan)
        units = self._chunk_units()
        if units is None or self.config.overlap != "backward":
            return depth
        return max(depth, chunks_per_unit(units, plan.chunks))

    @override
    def _extra_store_bytes(self) -> int:
        return sum(-(-n // 4096) * 4096 for _, n in self.sharded.regions()) if self.sharded is not None else 0

    @override
    def _shelf_items(self) -> list[Item]:
        """The shelf (``host_memory_budget``, the host's split evenly among its ranks) may hold this rank's block
        shards as well as its optimizer chunks: a shard on the shelf is gathered from RAM and updated in place,
        never read from or written to the disk."""
        items = super()._shelf_items()
        if self.sharded is not None and self.nvme_store is not None:
            items += [block_item(region, self.nvme_store.region(region).capacity, 0, True)
                      for region, _ in self.sharded.regions()]
        return items

    @override
    def _update_listener(self) -> UpdateListener | None:
        return self.sharded

    @override
    def _start_offload(self) -> None:
        assert self.sharded is not None and self.nvme_store is not None
        trained = [p for off in self.offloaded for p in off.params]
        stateless = [piece.index for off in self.offloaded for piece in off.unchunked]
        if stateless:
            raise ValueError(f"{self.strategy_name}: parameters {stateless} have no per-element optimizer state (e.g. "
                             "SGD with momentum=0); each rank updates only its shard of a parameter, which needs "
                             "per-element state. Use an optimizer with state (SGD(momentum>0), AdamW, ...).")
        resumed, self._resumed = self._resumed, None
        try:
            self.sharded.start(self.nvme_store, trained, resumed)
        finally:
            if resumed is not None:
                resumed.close()
        units = self.sharded.units
        rank_zero_info(f"{self.strategy_name}: {len(units)} blocks sharded over {self.world_size} ranks "
                       f"({self.sharded.sharded_bytes / MiB:.1f} MiB of block parameters, "
                       f"{sum(u.flat.shard_bytes for u in units) / MiB:.1f} MiB per rank in its store); "
                       f"{len(self.sharded.outside)} trainable parameters outside blocks replicated; "
                       f"param_prefetch={self.config.param_prefetch}")

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A model built on the meta device has nothing to load into before setup (Lightning loads the weights
        first): its checkpoint's weights are kept (references beside the file unread) and become the values
        ``ShardedParams.start`` builds it from, module by module, instead of its initialization."""
        module = self.lightning_module
        if module is None or not has_meta_tensors(module):
            return super().load_model_state_dict(checkpoint, strict=strict)
        state = checkpoint["state_dict"]
        if strict:
            expected = set(module.state_dict().keys())
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            if missing or unexpected:
                raise RuntimeError(f"{self.strategy_name}: the checkpoint does not match the model built on the meta "
                                   f"device: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        self._resumed = BesideSource(state)

    # ---- the step ----------------------------------------------------------------------------------------------
    def _reduced(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            for off, index in self._grad_owner.get(id(p), ()):
                off.grad_ready(index)

    @override
    def _after_update(self, off: OffloadedOptimizer) -> None:
        """Every block is updated and written back; the replicated parameters are gathered from their owners."""
        if self.sharded is not None:
            self.sharded.finish_step()

    # ---- weights -------------------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The weights, each block gathered from every rank's shard (a collective: every rank takes part, as Lightning
        calls it on every rank): up to ``inline_weights_bytes`` of block weights into the checkpoint file's state
        dict; above it, references that the save fills one gathered block at a time (rank 0 writing them into the
        file's weights record), so a model bigger than memory is never whole in any process."""
        sharded = self.sharded
        if sharded is not None and sharded.active and sharded.sharded_bytes > self.config.inline_weights_bytes:
            with sharded.weights.by_reference():
                return super().lightning_module_state_dict()
        return super().lightning_module_state_dict()

    def export_weights(self, path: str, layout: str = "lightning", max_shard_bytes: int = MAX_SHARD_BYTES,
                       merge_adapters: bool = False) -> None:
        """``nvme_offload``'s ``export_weights`` (``layout="lightning"``: one safetensors file; ``"hf"``: the Hugging
        Face directory), written by rank 0 with every block gathered from the ranks' shards one at a time, so a model
        bigger than memory is never whole in any process. A collective: every rank calls it, during fit (e.g. in
        ``on_train_end``) or after it; after a fit with ``restore_params=True`` the module holds the weights and rank
        0 writes them from memory. After ``restore_params=False`` the shards are gone with the fit's store: refused."""
        module = self.lightning_module
        assert module is not None
        check_layout(layout)
        sharded = self.sharded
        if sharded is not None and sharded.active:
            with sharded.weights.by_reference():
                state = module.state_dict()

            def work(read_block: Any) -> None:
                write_export(path, module, state, read_block, layout, max_shard_bytes, merge_adapters)
            sharded.weights.reads_led_by_rank0(work)
        else:  # the module holds the weights (or placeholders, refused by its state_dict hook): rank 0 writes
            error: BaseException | None = None
            if self.is_global_zero:
                try:
                    export(path, module, None, nullcontext, layout, max_shard_bytes, merge_adapters)
                except BaseException as e:  # every rank raises, none waits for the others
                    error = e
            failure = self.broadcast(None if error is None else f"{type(error).__name__}: {error}")
            if error is not None:
                raise error
            if failure is not None:
                raise RuntimeError(f"{self.strategy_name}: export_weights failed on rank 0: {failure}")
        self.barrier("export_weights")

    @override
    def _save_arguments(self) -> dict[str, Any]:
        sharded = self.sharded
        return {**super()._save_arguments(),
                "gathered": sharded.weights if sharded is not None and sharded.active else None}

    @override
    def teardown(self) -> None:
        try:
            if self.sharded is not None and self.sharded.active:
                # after a failure another rank may be gone: gathering the weights back would fail or hang, so the
                # module keeps placeholders (the last checkpoint is the way back, as after a kill)
                trainer = getattr(self.lightning_module, "_trainer", None)
                failed = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
                self.sharded.stop(restore=not failed and self.config.restore_params)
        finally:
            group, self._shard_group = self._shard_group, None
            comm, self._comm = self._comm, None
            if comm is not None:
                comm.close()
            super().teardown()
            if group is not None and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group(group)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_shard_group": None, "_comm": None, "sharded": None}
