"""Optimizer state offloaded to the flat store, updated by the user's own optimizer code."""

from lightning_nvme.optim.offloaded import OVERLAP_MODES, OffloadedOptimizer, UpdateListener
from lightning_nvme.optim.partition import Partition, partition_by_bytes
from lightning_nvme.optim.plan import MASTER_KEY, Chunk, Piece, plan_chunks

__all__ = ["MASTER_KEY", "OVERLAP_MODES", "Chunk", "OffloadedOptimizer", "Partition", "Piece", "partition_by_bytes",
           "UpdateListener", "plan_chunks"]
