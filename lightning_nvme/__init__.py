"""lightning_nvme: trade disk for memory in PyTorch Lightning.

``import lightning_nvme`` registers ``Trainer(strategy="nvme_offload")`` and ``"nvme_offload_ddp"`` with
Lightning's registry, and lets ``torch.load(weights_only=True)`` read checkpoints whose weights are streamed
beside the file (``lightning_nvme.checkpoint.weights.beside_weight``) or referenced in the user's base file
(``lightning_nvme.checkpoint.base_file.file_weight``).
"""

import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_nvme.checkpoint.base_file import file_weight
from lightning_nvme.checkpoint.weights import beside_weight
from lightning_nvme.store import FlatStore, IOHandle, StoreError
from lightning_nvme.strategies import NVMeOffloadDDPStrategy, NVMeOffloadStrategy

NVMeOffloadStrategy.register_strategies(StrategyRegistry)
NVMeOffloadDDPStrategy.register_strategies(StrategyRegistry)
torch.serialization.add_safe_globals([beside_weight, file_weight])

__all__ = ["FlatStore", "IOHandle", "NVMeOffloadDDPStrategy", "NVMeOffloadStrategy", "StoreError"]
__version__ = "0.1.0"
