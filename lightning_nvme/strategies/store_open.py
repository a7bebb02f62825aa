"""Opening a strategy's store and offloading its optimizers into it: what ``OffloadStrategy.setup`` runs once.

Why a module of functions: both steps read the settings, the trainer and the sizes the strategy passes in, never the
strategy's own state, so they take those as arguments and the strategy keeps to Lightning's hooks and its subclasses'
choices (which ranges a rank owns, what is read ahead, who listens to an update). The store's file name is claimed by
``store_claim``; the checks before anything is written are ``preflight``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_nvme.constants import GiB, MiB
from lightning_nvme.doctor.profile import IOProfile, io_request, slowest_disk_note
from lightning_nvme.memory import release_freed_memory
from lightning_nvme.optim import OffloadedOptimizer, UpdateListener, plan_chunks
from lightning_nvme.optim.plan import Plan
from lightning_nvme.optim.store_ref import StoreRef
from lightning_nvme.preflight.checkpoint_space import check_run_space
from lightning_nvme.preflight.resources import check_store_dirs
from lightning_nvme.settings import OffloadSettings
from lightning_nvme.store import ALIGN, FlatStore
from lightning_nvme.store.layout import align_up
from lightning_nvme.strategies.store_claim import claim_store_name, owner_region

Owned = Mapping[int, Sequence[tuple[int, int]]] | None


def other_roles(trainer: pl.Trainer, store_dirs: list[str]) -> dict[str, list[str]]:
    """With several disks asked for, the checkpoint directory too, so preflight says if it shares one."""
    callback = getattr(trainer, "checkpoint_callback", None)
    dirpath = getattr(callback, "dirpath", None)
    return {"checkpoints": [str(dirpath)]} if len(store_dirs) > 1 and dirpath else {}


def open_new_store(trainer: pl.Trainer, config: OffloadSettings, strategy_name: str, live: FlatStore | None,
                   owner: object, rank: int, token: str, planned: int, state_bytes: int | None = None) -> FlatStore:
    """The store of ``owner`` (a strategy instance; ``live`` when it has one already), created once; ``planned``
    bytes (beyond what it already holds) are checked against the free space first: writable, enough free space
    (+ margin), warn on tmpfs/NFS; with the optimizer's ``state_bytes`` known, also with the checkpoints the run keeps
    (on one store dir's disk with the store's bytes; a striped store's stripes are checked above)."""
    store_dirs = config.resolve_store_dirs(trainer.default_root_dir)
    io_chunk_bytes, io_workers, stripe_bytes = io_request(config)
    check_store_dirs(store_dirs, planned, stripe_bytes, min_free_bytes=config.min_free_bytes,
                     roles=other_roles(trainer, store_dirs))
    if state_bytes is not None:
        together = config.checkpoint_copy == "background" and config.checkpoint_in_flight == "join"
        check_run_space(trainer, store_dirs[0], planned if len(store_dirs) == 1 else 0, state_bytes,
                        config.min_free_bytes, strategy_name, together)
    if live is not None:
        return live
    threshold = config.mmap_threshold()
    if threshold is not None:
        release_freed_memory(threshold)  # see lightning_nvme.memory: bounded RSS
    if len(store_dirs) > 1 and config.io_profile:
        note = slowest_disk_note(IOProfile.load(config.io_profile), store_dirs)
        if note:
            rank_zero_warn(f"{strategy_name}: {note}")
    name = claim_store_name(store_dirs, rank, owner, token)
    store = FlatStore(store_dirs, rank=rank, io_chunk_bytes=io_chunk_bytes, io_workers=io_workers,
                      staging_bytes=max(config.staging_bytes, io_chunk_bytes), min_free_bytes=config.min_free_bytes,
                      name=name, stripe_bytes=stripe_bytes)
    store.add_region(owner_region(token), ALIGN)
    return store


def offload_optimizers(optimizers: Sequence[Optimizer], owned: Sequence[Owned], config: OffloadSettings,
                       open_store: Callable[[int, int], FlatStore], new_store_bytes: int, read_ahead: Callable[[Plan], int],
                       units: Mapping[int, int] | None, *, strategy_name: str, token: str, clip_value: float | None,
                       grad_hooks: bool, free_grads: bool, listener: UpdateListener | None) -> list[OffloadedOptimizer]:
    """Each optimizer wrapped in an ``OffloadedOptimizer`` over its chunks (of the ``owned`` ranges): planned first,
    so that ``open_store(planned bytes, state bytes)`` checks the space for them (plus ``new_store_bytes``: a new
    store's header, owner region and parameter blocks) before anything is written. ``units``: see
    ``plan_chunks`` (the parameter blocks, with parameter offload)."""
    fmt = config.state_format_spec
    plans = [plan_chunks(opt, config.chunk_bytes, f"opt{i}", owned=owned[i], fmt=fmt, units=units)
             for i, opt in enumerate(optimizers)]
    state = sum(align_up(c.nbytes) for plan in plans for c in plan.chunks)
    store = open_store(state + new_store_bytes, state)
    store_ref = StoreRef.of(store, owner_region(token))
    offloaded = [
        OffloadedOptimizer(opt, store, name=f"opt{i}", chunk_bytes=config.chunk_bytes, prefetch_depth=read_ahead(plans[i]),
                           overlap=config.overlap, clip_value=clip_value, owned=owned[i], plan=plans[i],
                           grad_hooks=grad_hooks, store_ref=store_ref, free_grads=free_grads, listener=listener, fmt=fmt)
        for i, opt in enumerate(optimizers)
    ]
    held = sum(o.state_bytes for o in offloaded)
    resident = sum(o.ring.total_bytes for o in offloaded) + store.staging_bytes
    rank_zero_info(f"{strategy_name}: optimizer state store {store.path} ({store.mode} I/O): {held / GiB:.2f} GiB on "
                   f"disk in {sum(len(o.regions()) for o in offloaded)} chunks; {resident / MiB:.0f} MiB of resident "
                   f"buffers (read ahead: {', '.join(str(o.reads.depth) for o in offloaded)} chunks); "
                   f"overlap={config.overlap}; {fmt.describe()}")
    return offloaded
