"""lightning_nvme: trade disk for memory in PyTorch Lightning.

``import lightning_nvme`` registers ``Trainer(strategy="nvme_offload")`` and ``"nvme_offload_ddp"`` with
Lightning's registry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_nvme.store import FlatStore, IOHandle, StoreError
from lightning_nvme.strategies import NVMeOffloadDDPStrategy, NVMeOffloadStrategy

NVMeOffloadStrategy.register_strategies(StrategyRegistry)
NVMeOffloadDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["FlatStore", "IOHandle", "NVMeOffloadDDPStrategy", "NVMeOffloadStrategy", "StoreError"]
__version__ = "0.1.0"
