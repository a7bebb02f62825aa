"""lightning_nvme: trade disk for memory in PyTorch Lightning.

``import lightning_nvme`` registers ``Trainer(strategy="nvme_offload")`` with Lightning's registry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_nvme.store import FlatStore, IOHandle, StoreError
from lightning_nvme.strategies import NVMeOffloadStrategy

NVMeOffloadStrategy.register_strategies(StrategyRegistry)

__all__ = ["FlatStore", "IOHandle", "NVMeOffloadStrategy", "StoreError"]
__version__ = "0.1.0"
