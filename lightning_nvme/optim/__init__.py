"""Optimizer state offloaded to the flat store, updated by the user's own optimizer code."""

from lightning_nvme.optim.offloaded import (
    CHUNK_BYTES,
    OVERLAP_MODES,
    PREFETCH_DEPTH,
    OffloadedOptimizer,
    StateRegion,
    UpdateListener,
)
from lightning_nvme.optim.partition import Partition, partition_by_bytes
from lightning_nvme.optim.plan import Chunk, Piece, Plan, plan_chunks
from lightning_nvme.optim.probe import ELEMENTWISE_OPT_IN, MASTER_KEY, UnsupportedOptimizerError

__all__ = ["CHUNK_BYTES", "ELEMENTWISE_OPT_IN", "MASTER_KEY", "OVERLAP_MODES", "PREFETCH_DEPTH", "Chunk", "OffloadedOptimizer",
           "Partition", "Piece",
           "Plan", "StateRegion", "UnsupportedOptimizerError", "UpdateListener", "partition_by_bytes", "plan_chunks"]
