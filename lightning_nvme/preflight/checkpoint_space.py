"""The disk space a run plans for before training: its store plus the checkpoints its ``ModelCheckpoint`` callbacks
keep (``resources.check_checkpoint_space``), so a full disk is found in the first second, not at the tenth save."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_nvme.preflight.resources import CheckpointPlan, check_checkpoint_space


def model_bytes(module: pl.LightningModule) -> int:
    """Bytes of the model's parameters and buffers: the weights every checkpoint holds (in its file or beside it)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def checkpoint_plans(trainer: pl.Trainer, bytes_each: int, together: bool = False) -> tuple[list[CheckpointPlan], list[str]]:
    """What each ``ModelCheckpoint`` keeps: ``save_top_k`` files plus ``last`` (a copy unless a link), plus the
    save in progress that replaces one; ``save_top_k=-1`` keeps every checkpoint, which no plan can bound.
    ``together``: the saves of one instant are in progress at once (background saves that join one copy: the
    top-k and ``last`` saves both exist beside the checkpoints they replace until the copy commits)."""
    plans, unbounded = [], []
    for cb in trainer.checkpoint_callbacks:
        top_k, last, dirpath = getattr(cb, "save_top_k", 1), getattr(cb, "save_last", None), getattr(cb, "dirpath", None)
        if dirpath is None:
            continue
        if top_k < 0:
            unbounded.append(str(dirpath))
            continue
        kept = top_k + (1 if last and last != "link" else 0)
        if kept:
            plans.append(CheckpointPlan(str(dirpath), kept + (kept - top_k + (top_k > 0) if together else 1),
                                        bytes_each))
    return plans, unbounded


def check_run_space(trainer: pl.Trainer, store_dir: str, store_bytes: int, state_bytes: int, min_free_bytes: int,
                    name: str, together: bool = False) -> None:
    """Refuse (``ConfigError``) a run whose store and kept checkpoints cannot fit; rank 0 plans the checkpoints of
    all ranks (their optimizer state shards add up to ``state_bytes`` x world size)."""
    assert trainer.lightning_module is not None
    plans: list[CheckpointPlan] = []
    unbounded: list[str] = []
    if trainer.is_global_zero:
        plans, unbounded = checkpoint_plans(trainer, state_bytes * trainer.world_size + model_bytes(
            trainer.lightning_module), together)
    needed = check_checkpoint_space(store_dir, store_bytes, plans, min_free_bytes=min_free_bytes)
    kept = "; ".join(f"{p.kept} x {p.bytes_each} bytes in {p.directory}" for p in plans)
    rank_zero_info(f"{name}: disk space planned: " + ", ".join(f"{n} bytes on {m}" for m, n in needed.items()) +
                   (f" (store + checkpoints kept at once: {kept})" if kept else "") +
                   (f"; save_top_k=-1 keeps every checkpoint in {', '.join(unbounded)}: not bounded, not planned"
                    if unbounded else ""))
