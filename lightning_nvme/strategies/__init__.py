"""Lightning strategies of lightning_nvme, one family per module (as in ``lightning.pytorch.strategies``)."""

from lightning_nvme.strategies.nvme_offload import NVMeOffloadStrategy
from lightning_nvme.strategies.nvme_offload_ddp import NVMeOffloadDDPStrategy
from lightning_nvme.strategies.nvme_offload_fsdp import NVMeOffloadFSDPStrategy

__all__ = ["NVMeOffloadDDPStrategy", "NVMeOffloadFSDPStrategy", "NVMeOffloadStrategy"]
