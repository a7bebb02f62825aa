"""Optimizer state offloaded to the flat store, updated by the user's own optimizer code."""

from lightning_nvme.optim.offloaded import OVERLAP_MODES, OffloadedOptimizer
from lightning_nvme.optim.plan import MASTER_KEY, Chunk, Piece, plan_chunks

__all__ = ["MASTER_KEY", "OVERLAP_MODES", "Chunk", "OffloadedOptimizer", "Piece", "plan_chunks"]
