"""lightning_nvme: trade disk for memory in PyTorch Lightning.

Importing the package registers the ``"nvme_offload"`` strategies with Lightning's registry.
"""

from lightning_nvme.store import FlatStore, IOHandle, StoreError

__all__ = ["FlatStore", "IOHandle", "StoreError"]
__version__ = "0.1.0"
