"""``Saver``: the one way a strategy writes, delivers and removes a checkpoint.

Why one owner: a save decides where the file goes (the strategy itself, atomically, or the user's ``CheckpointIO``),
how the optimizer state reaches the file (``checkpoint_copy``: streamed through memory, cloned from the store's
extents, or copied by a background thread after the save returns), and runs the commit protocol of ``paired``
(begin, state files, publish, the one file written and switched in, finish; abort on any failure), for one
process or for every data-parallel rank together. The strategies hand it what they hold (the offloaded optimizers,
a way to open the store, the offloaded weights, the ranks) and call ``save``; nothing else in ``checkpoint/``.

The clone-or-stream decision (``decide``) is made here, once, for both strategies.

Data parallel and the background copy: a sharded checkpoint is committed by rank 0 once every rank has reported
its shard complete, which the ranks agree on in a collective inside the save. A background copy completes on each
rank at its own time, after the save returned, in a thread; committing it would need that agreement from a
background thread, interleaved with training's own collectives on the same process group (whose order must be the
same on every rank). So under data parallel the state is streamed or cloned during the save, and
``checkpoint_copy="background"`` is refused (``ddp_background_refusal``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_nvme.checkpoint import paired, plugin_io, rank_shards, weights
from lightning_nvme.checkpoint.copy import background, streamed
from lightning_nvme.checkpoint.copy import reflink as reflink_copy
from lightning_nvme.checkpoint.record import SaveRecord, check_space, timed, weight_bytes
from lightning_nvme.checkpoint.state_files import file_metadata, format_entry, optimizer_placeholder
from lightning_nvme.fs import reflink
from lightning_nvme.optim import OffloadedOptimizer, Partition
from lightning_nvme.store import FlatStore

OpenStore = Callable[[], AbstractContextManager[FlatStore]]

DDP_BACKGROUND_REFUSAL = (
    "the background copy is single-device only: nvme_offload_ddp commits a sharded checkpoint once every rank "
    "agrees, in a collective inside the save, that its shard is complete; a background copy completes on each rank "
    "at its own time in a thread, where that agreement would interleave with training's collectives on the same "
    "process group. Fix: checkpoint_copy='auto' (a reflink snapshot, metadata only, where the store's XFS/btrfs "
    "allows) or 'streamed'.")


class CopySettings(Protocol):
    """The settings a save reads (``settings.OffloadSettings``): how the state reaches the file, the background
    copy's buffer, and what a save does while a background save is in flight."""

    @property
    def checkpoint_copy(self) -> str: ...

    @property
    def checkpoint_copy_buffer_bytes(self) -> int: ...

    @property
    def checkpoint_in_flight(self) -> str: ...


class Ranks(Protocol):
    """The data-parallel ranks of a save (a Lightning ``DDPStrategy`` is one)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def all_gather_objects(self, obj: Any) -> list[Any]: ...


class Blocks(Protocol):
    """Offloaded weights (``offload_params``) a save streams or clones into the file: ``params.ParamOffload``."""

    @property
    def layout(self) -> Any: ...

    def issue_writes(self) -> None: ...

    def in_store(self, block: Any) -> bool: ...

    def read_block(self, block: Any) -> dict[str, Any]: ...


class GatheredBlocks(Protocol):
    """Sharded weights a save streams beside the file (``params.ShardedParams``): rank 0 writes, asking for each
    block, and every other rank takes part in that block's gather (``reads_led_by_rank0``)."""

    def reads_led_by_rank0(self, work: Callable[[Callable[[Any], dict[str, Any]]], None]) -> None: ...


class Saver:
    """Writes the strategy's checkpoints; ``records`` says how each save moved its state (telemetry), ``background``
    is the last background copy (``checkpoint_copy="background"``), waited for by ``close``."""

    def __init__(self, strategy: str, settings: CopySettings) -> None:
        self.strategy = strategy
        self.settings = settings
        self.records: list[SaveRecord] = []
        self.background: background.BackgroundCopy | None = None

    @property
    def copy(self) -> str:
        return self.settings.checkpoint_copy

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "background": None}  # its thread and files stay with this instance

    # ---- the entry point -------------------------------------------------------------------------------------
    def save(self, checkpoint: dict[str, Any], filepath: _PATH, checkpoint_io: CheckpointIO,
             storage_options: Any | None = None, *, optimizers: Sequence[OffloadedOptimizer] = (),
             open_store: OpenStore | None = None, live_store: FlatStore | None = None, params: Blocks | None = None,
             ranks: Ranks | None = None, partitions: Sequence[Partition] = (),
             settings: CopySettings | None = None, gathered: GatheredBlocks | None = None) -> SaveRecord | None:
        """Save ``checkpoint`` to ``filepath``; returns the record of a save with streamed state (``None``: a file
        without it, written atomically or by the plugin; or a save skipped, recorded as such).

        ``optimizers``: the offloaded optimizers (their state goes into the file when ``optimizer_states`` is in
        the checkpoint); ``open_store``: the store, live or reopened for the call; ``live_store``: the store during
        fit (``None``: none runs, so no background copy); ``params``: the offloaded weights whose references the
        state dict holds; ``gathered``: the sharded weights whose references it holds (``nvme_offload_fsdp``);
        ``ranks`` and ``partitions``: data parallel, every rank calls ``save`` together;
        ``settings``: the strategy's settings now (they may change between saves)."""
        if settings is not None:
            self.settings = settings
        beside = weights.has_refs(checkpoint)
        streamed = (bool(optimizers) and "optimizer_states" in checkpoint) or beside
        writes_itself = plugin_io.writes_itself(checkpoint_io, filepath, storage_options)
        if self.background is not None:
            joins = (self.copy == "background" and not background.unsupported(live_store, checkpoint)
                     and writes_itself and streamed)
            path = os.path.abspath(os.fspath(filepath))
            skipped = self.background.settle(path, self.settings.checkpoint_in_flight, joins)
            if skipped:
                rank_zero_warn(f"{self.strategy}: checkpoint {filepath} skipped: {skipped}")
                self.records.append(SaveRecord("skipped", path, skipped))
                return None
        is_zero = ranks is None or ranks.is_global_zero
        if not writes_itself:
            if streamed:
                return self._through_plugin(checkpoint, filepath, storage_options, checkpoint_io, beside,
                                            optimizers, open_store, live_store, params, ranks, partitions)
            if is_zero:
                checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return None
        if not streamed:
            if is_zero:
                paired.save_plain(checkpoint, os.fspath(filepath))
            return None
        assert open_store is not None, "a save with streamed state needs the store"
        return self._save_local(checkpoint, os.path.abspath(os.fspath(filepath)), optimizers, open_store, live_store,
                                params, ranks, partitions, gathered=gathered)

    def remove(self, filepath: _PATH, checkpoint_io: CheckpointIO, is_global_zero: bool = True) -> None:
        """Delete a checkpoint the way it was written; while a background save is in flight, after its commit."""
        def remove() -> None:
            if not is_global_zero:
                return
            if plugin_io.writes_itself(checkpoint_io, filepath, None):
                paired.remove(os.fspath(filepath))
            else:
                checkpoint_io.remove_checkpoint(filepath)
        copy = self.background
        if copy is None or not copy.remove_after(remove):
            remove()

    def report(self) -> None:
        """Raise the error of a background save that failed since the last call (the previous checkpoint stands)."""
        if self.background is not None:
            self.background.report()

    def close(self) -> None:
        """Wait for a background save to commit (it reads the store: before the store closes), and report it."""
        if self.background is not None:
            self.background.wait()
            self.background.report()

    @staticmethod
    def placeholder(off: OffloadedOptimizer) -> dict[str, Any]:
        """What ``optimizer_states`` holds for an offloaded optimizer until the save streams its state."""
        return optimizer_placeholder(off)

    # ---- the clone-or-stream decision ---------------------------------------------------------------------
    def decide(self, store: FlatStore, path: str, regions: list[str],
               fallback: str = "checkpoint_copy='streamed'") -> tuple[bool, str]:
        """Whether this save clones ``regions`` of ``store`` (``checkpoint_copy``); ``"reflink"`` refuses where it
        cannot; ``"streamed"`` and a background save that cannot run (``fallback`` says why) stream."""
        if self.copy in ("streamed", "background"):
            return False, fallback
        return reflink_copy.plan(store, path, regions, self.copy, self.strategy)

    # ---- local saves ---------------------------------------------------------------------------------------
    def _save_local(self, checkpoint: dict[str, Any], path: str, optimizers: Sequence[OffloadedOptimizer],
                    open_store: OpenStore, live_store: FlatStore | None, params: Blocks | None,
                    ranks: Ranks | None, partitions: Sequence[Partition], may_defer: bool = True,
                    gathered: GatheredBlocks | None = None) -> SaveRecord | None:
        """``may_defer=False``: the file must be complete when this returns (it is delivered next)."""
        if ranks is not None:
            return self._save_sharded(checkpoint, path, list(optimizers), open_store, ranks, partitions, gathered)
        t0 = time.perf_counter()
        fallback = "checkpoint_copy='streamed'"
        if self.copy == "background":
            fallback = background.unsupported(live_store, checkpoint) if may_defer else (
                "background copy: the file is delivered through the plugin or fsspec as soon as it is built")
            if not fallback:
                assert live_store is not None
                return self._save_background(checkpoint, path, list(optimizers), live_store, params, t0)
        return self._save_one(checkpoint, path, list(optimizers), open_store, params, fallback, t0)

    def _save_one(self, checkpoint: dict[str, Any], path: str, optimizers: list[OffloadedOptimizer],
                  open_store: OpenStore, params: Blocks | None, fallback: str, t0: float) -> SaveRecord:
        """One process, the state streamed or cloned during the save (``paired.save`` runs the protocol)."""
        optimizers = optimizers if "optimizer_states" in checkpoint else []
        beside = weights.has_refs(checkpoint)
        params = params if beside else None
        with open_store() as store:
            if params is not None:
                params.issue_writes()
            store.fence(durable=True)
            regions = [r.name for off in optimizers for r in off.regions()]
            regions += [b.region for b in params.layout.blocks] if params is not None else []
            clone, reason = self.decide(store, path, regions, fallback)
            record = SaveRecord("reflink" if clone else "streamed", path, reason)
            if not clone:  # each state file written once, straight into its record of the file
                def plan(save_id: str) -> list[paired.DirectPart]:
                    parts = [streamed.optimizer_part(off, i, save_id) for i, off in enumerate(optimizers)]
                    if beside:
                        assert params is not None, "weights streamed beside the file need the offloaded blocks"
                        parts.append(streamed.weights_part(checkpoint["state_dict"], params.read_block, save_id))
                    return parts

                check_space(path, sum(off.state_bytes for off in optimizers) + weight_bytes(checkpoint),
                            f"{record.path} save")
                parts = paired.save_direct(checkpoint, path, plan)
                record.files = sorted(part.name for part in parts)
                record.bytes_written = sum(part.size for part in parts)
                self.records.append(timed(record, t0))
                return record
            block = reflink.probe(os.path.dirname(path)).block_size

            def write_parts(directory: str, save_id: str) -> list[dict[str, Any]]:
                markers = []
                for i, off in enumerate(optimizers):
                    marker, cloned = reflink_copy.write_optimizer(off, directory, i, save_id, block)
                    markers.append(marker)
                    record.bytes_cloned += cloned
                if beside:
                    assert params is not None, "weights streamed beside the file need the offloaded blocks"
                    record.bytes_cloned += reflink_copy.write_weights(
                        os.path.join(directory, weights.WEIGHTS_FILE), checkpoint["state_dict"], store,
                        params.in_store, params.read_block, file_metadata(save_id), block)
                record.files = sorted(os.listdir(directory))
                size = sum(os.path.getsize(os.path.join(directory, f)) for f in record.files)
                record.bytes_written = size - record.bytes_cloned
                return markers

            check_space(path, weight_bytes(checkpoint), f"{record.path} save")
            paired.save(checkpoint, path, write_parts)
        self.records.append(timed(record, t0))
        return record

    def _save_background(self, checkpoint: dict[str, Any], path: str, optimizers: list[OffloadedOptimizer],
                         store: FlatStore, params: Blocks | None, t0: float) -> SaveRecord:
        """Laid out now, the state copied by a thread after the save returns (``copy.background``)."""
        if params is not None:
            params.issue_writes()
        store.fence(durable=True)
        record = SaveRecord("background", path)
        optimizers = optimizers if "optimizer_states" in checkpoint else []
        running = self.background if self.background is not None and self.background.in_flight else None
        pending = running.bytes_pending if running is not None else 0  # the copy in flight's files fill up still
        state = sum(off.state_bytes for off in optimizers)
        check_space(path, state + weight_bytes(checkpoint) + pending, "background save")
        self.background = background.start(
            store, checkpoint, path, optimizers, self.settings.checkpoint_copy_buffer_bytes, record,
            params.in_store if params is not None else None, params.read_block if params is not None else None,
            running)
        self.records.append(timed(record, t0))
        return record

    def _save_sharded(self, checkpoint: dict[str, Any], path: str, optimizers: list[OffloadedOptimizer],
                      open_store: OpenStore, ranks: Ranks, partitions: Sequence[Partition],
                      gathered: GatheredBlocks | None = None) -> SaveRecord | None:
        """Every rank streams (or clones) its shard into one temp directory named by rank 0; rank 0 publishes them
        and switches the checkpoint file in once every rank reports its shard written (or removes them if any
        failed). See ``paired`` for the commit protocol. Weights beside the file (``nvme_offload_fsdp`` above
        ``inline_weights_bytes``): rank 0 writes them one block in memory at a time, each block gathered from every
        rank's shard as it asks for it (``gathered.reads_led_by_rank0``)."""
        error: BaseException | None = None
        begun: tuple[paired.Pending | None, str | None] = (None, None)
        beside = weights.has_refs(checkpoint)
        if ranks.is_global_zero:
            try:
                if beside:
                    check_space(path, weight_bytes(checkpoint), f"{path} save")
                begun = (paired.begin(path), None)
            except OSError as e:  # e.g. the checkpoint directory is not writable: every rank must hear of it
                error, begun = e, (None, repr(e))
        pending, begin_error = ranks.broadcast(begun)
        if begin_error is not None or pending is None:
            raise error or RuntimeError(f"{self.strategy}: rank 0 could not create {path}: {begin_error}")
        scalars: list[dict[int, dict[str, Any]]] = []
        t0, record = time.perf_counter(), None
        try:
            with open_store() as store:
                store.fence(durable=True)
                record = self._write_shards(store, path, optimizers, ranks.global_rank, pending.tmp, pending.save_id,
                                            scalars)
                if beside:
                    assert gathered is not None, "weights streamed beside the file need the sharded blocks"
                    state_dict, where = checkpoint["state_dict"], os.path.join(pending.tmp, weights.WEIGHTS_FILE)
                    weights.bind(state_dict, path, pending.save_id)
                    metadata = file_metadata(pending.save_id)
                    gathered.reads_led_by_rank0(lambda read: weights.write(where, state_dict, read, metadata))
                    if ranks.is_global_zero:
                        record.files.append(weights.WEIGHTS_FILE)
                        record.bytes_written += os.path.getsize(where)
        except BaseException as e:  # reported to every rank below, then re-raised
            error = e
        reports = ranks.all_gather_objects((repr(error) if error else None, scalars))
        failed = [(r, msg) for r, (msg, _) in enumerate(reports) if msg is not None]
        if not failed and ranks.is_global_zero:
            try:
                states = _merged_optimizer_states(checkpoint, [s for _, s in reports])
                markers = [{**rank_shards.shard_marker(i, partitions[i], [tuple(p.shape) for p in off.params]),
                            **format_entry(off)} for i, off in enumerate(optimizers)]
                main = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
                paired.publish(pending)
                paired.write_main({**main, paired.REF_KEY: paired.reference(pending, states, markers)}, path,
                                  pending.tmp)
            except BaseException as e:
                error, failed = e, [(0, repr(e))]
        if ranks.is_global_zero:
            paired.abort(pending) if failed else paired.finish(pending)
        failed = ranks.broadcast(failed)  # after the abort: no rank returns while the temp dir still exists
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(f"{self.strategy}: checkpoint {path} was not written: " +
                               "; ".join(f"rank {r}: {msg}" for r, msg in failed))
        if record is not None:
            self.records.append(timed(record, t0))
        return record

    def _write_shards(self, store: FlatStore, path: str, optimizers: list[OffloadedOptimizer], rank: int,
                      directory: str, save_id: str, scalars: list[dict[int, dict[str, Any]]]) -> SaveRecord:
        """This rank's shards in ``directory``: clones of its own store where the checkpoint's filesystem allows
        (``decide``), else streamed; the record says which and why."""
        regions = [r.name for off in optimizers for r in off.regions()]
        clone, reason = self.decide(store, path, regions)
        record = SaveRecord("reflink" if clone else "streamed", path, reason)
        block = reflink.probe(os.path.dirname(os.path.abspath(path))).block_size if clone else 0
        for i, off in enumerate(optimizers):
            if clone:
                name, cloned = rank_shards.clone_shard(off, directory, i, rank, save_id, block)
                record.bytes_cloned += cloned
            else:
                name = rank_shards.write_shard(off, directory, i, rank, save_id)
            record.files.append(name)
            scalars.append(off.scalar_state())
        record.bytes_written = sum(os.path.getsize(os.path.join(directory, f)) for f in record.files) - record.bytes_cloned
        return record

    # ---- through the user's CheckpointIO or fsspec -----------------------------------------------------------
    def _through_plugin(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None,
                        checkpoint_io: CheckpointIO, beside: bool, optimizers: Sequence[OffloadedOptimizer],
                        open_store: OpenStore | None, live_store: FlatStore | None, params: Blocks | None,
                        ranks: Ranks | None, partitions: Sequence[Partition]) -> SaveRecord | None:
        """A remote URL, ``storage_options`` or a user's ``CheckpointIO``: the one file is built locally, in a hidden
        temp directory beside the store (as a local save: cloned from the store where it can be), then streamed
        through fsspec or handed to the plugin with its state records as file-mapped storages (never read into
        memory at once; ``AsyncCheckpointIO`` clones tensors, not storages). The save record says so."""
        if (ranks is not None and ranks.world_size > 1) or not (optimizers or live_store) or open_store is None:
            plugin_io.refuse_streamed(self.strategy, checkpoint_io, filepath, storage_options, beside)
        assert open_store is not None
        with open_store() as store:
            where = store.directory
        staging = tempfile.mkdtemp(prefix=".lightning_nvme-ckpt-", dir=where)
        try:
            local = os.path.join(staging, os.path.basename(os.fspath(filepath).rstrip("/")) or "checkpoint.ckpt")
            saves = len(self.records)
            record = self._save_local(checkpoint, local, optimizers, open_store, live_store, params, ranks,
                                      partitions, may_defer=False)
            how = plugin_io.ship(local, filepath, storage_options, checkpoint_io)
            for done in self.records[saves:]:
                done.checkpoint = os.fspath(filepath)
                done.reason = (f"{done.reason}; " if done.reason else "") + (
                    f"built in {staging} ({done.path}), then {how}: no reflink into a remote or plugin destination")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return record


def _merged_optimizer_states(checkpoint: dict[str, Any], scalars_by_rank: list[list[dict]]) -> list[dict[str, Any]]:
    """Each optimizer's param groups, with the scalar state (``step``) of every param from the rank owning it."""
    states = []
    for i, state in enumerate(checkpoint["optimizer_states"]):
        merged: dict[int, dict[str, Any]] = {}
        for per_rank in scalars_by_rank:
            merged.update(per_rank[i])
        states.append({**state, "state": dict(sorted(merged.items()))})
    return states
